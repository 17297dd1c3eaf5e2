#!/usr/bin/env python3
"""`ip link set lo up` for a machine without iproute2 (the GPU machine): the one call that a
fleet's or a bench's private network namespace needs, made with SIOCGIFFLAGS/SIOCSIFFLAGS.
scripts/gpu_tier.sh and scripts/scale_on_device.sh install it as /root/bin/ip."""
import fcntl
import socket
import struct
import sys

if sys.argv[1:] != ["link", "set", "lo", "up"]:
    sys.exit(f"ip (shim): only 'ip link set lo up', not {' '.join(sys.argv[1:])!r}")
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack("16sH22x", fcntl.ioctl(sock, 0x8913, struct.pack("16sH22x", b"lo", 0)))[1]
fcntl.ioctl(sock, 0x8914, struct.pack("16sH22x", b"lo", flags | 1))
