"""Nodes on one machine: network namespaces joined by a Linux bridge, each one node of a real
Ray cluster (``ray start``, as on real machines), on private addresses 10.77.0.0/24.

Node 1 (the head) holds the bridge and 10.77.0.1; node i > 1 is joined to it by a veth pair and
has 10.77.0.i. Each namespace is held by a keeper process (``unshare -n cat``) that ends when
this process closes its stdin, or dies. Nothing is added to the caller's own namespace, and no
traffic goes anywhere but between these namespaces.

    layout = NodeLayout(tmp_path, count=3).start()      # namespaces, bridge, Ray on each node
    try:
        layout.run_on(1, [python, "driver.py"])         # a process on the head node
    finally:
        layout.stop()                                   # every process of every node, by PID

Stopping kills every process in each node's namespace (read from /proc: nothing by name).
It needs root (namespaces, a bridge) and ``ip``; the 3-node tests and ``bench/bench_load.py
--nodes`` use it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from rollout_fleet.adapters.shared.net import socket_inodes

SUBNET = "10.77.0"
WORKER_RESOURCE = "rollout_worker"  # offered by each worker node: one fleet worker per node
BRIDGE = "rfbr0"
RAY_PORT = 6379


class LayoutError(RuntimeError):
    pass


class Node:
    def __init__(self, index: int, root: Path) -> None:
        self.index = index
        self.address = f"{SUBNET}.{index}"
        self.root = root
        self.keeper: subprocess.Popen | None = None
        self.ray: subprocess.Popen | None = None
        self.inode: int | None = None

    @property
    def name(self) -> str:
        return f"node-{self.index}"

    def enter(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this node's network namespace."""
        return ["nsenter", f"--net=/proc/{self.keeper.pid}/ns/net", "--", *argv]

    def ip(self, *args: str) -> None:
        _run(self.enter(["ip", *args]))

    def processes(self) -> list[int]:
        """Every live process in this node's namespace."""
        if self.inode is None:
            return []
        return [pid for pid in _all_pids() if _netns_inode(pid) == self.inode and _alive(pid)]

    def kill_all(self, wait_s: float = 15.0) -> list[int]:
        """SIGKILL every process of this node (again and again, until none is left: a dying
        daemon may still start a child); returns those that would not go."""
        deadline = time.monotonic() + wait_s
        while True:
            left = [p for p in self.processes() if p != os.getpid()]
            if not left or time.monotonic() > deadline:
                return left
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)


class NodeLayout:
    def __init__(self, root: str | Path, count: int = 3, *, worker_cpus: int = 1,
                 worker_slots: int = 1, env: Mapping[str, str] | None = None) -> None:
        if not 2 <= count <= 9:
            raise ValueError(f"count={count}: a layout has 2..9 nodes")
        self.root = Path(root)
        self.nodes = [Node(i, self.root) for i in range(1, count + 1)]
        self.worker_cpus = worker_cpus
        self.worker_slots = worker_slots  # fleet workers each worker node takes
        self.env = {**os.environ, **(env or {})}

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def workers(self) -> list[Node]:
        return self.nodes[1:]

    @property
    def ray_address(self) -> str:
        return f"{self.head.address}:{RAY_PORT}"

    def node_of(self, address: str) -> Node:
        return next(n for n in self.nodes if n.address == address)

    # -- start ---------------------------------------------------------------------------------
    def start(self, timeout_s: float = 120.0) -> "NodeLayout":
        """Namespaces, bridge, addresses, then Ray: the head, then every worker node, and wait
        until the cluster lists them all. On failure, stops what was started."""
        for tool in ("ip", "nsenter", "unshare"):
            if shutil.which(tool) is None:
                raise LayoutError(f"`{tool}` is not installed; the nodes layout needs it")
        if os.geteuid() != 0:
            raise LayoutError("the nodes layout makes network namespaces and a bridge: run as root")
        self.root.mkdir(parents=True, exist_ok=True)
        self._write_auth_token()
        try:
            self._make_network()
            self._start_ray(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _write_auth_token(self) -> None:
        """Ray's token authentication, with a token of this cluster's own (a real cluster
        copies it to every node): every node and driver reads it from a file only we can read."""
        token = self.root / "ray-auth-token"
        token.touch(mode=0o600)
        token.write_text(secrets.token_hex(32))
        self.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
        self.env.pop("RAY_AUTH_TOKEN", None)

    def _make_network(self) -> None:
        for node in self.nodes:
            node.keeper = subprocess.Popen(["unshare", "-n", "cat"], stdin=subprocess.PIPE,
                                           stdout=subprocess.DEVNULL, start_new_session=True)
        for node in self.nodes:
            node.inode = _wait_netns(node.keeper.pid)
            node.ip("link", "set", "lo", "up")
        head = self.head
        head.ip("link", "add", BRIDGE, "type", "bridge")
        head.ip("addr", "add", f"{head.address}/24", "dev", BRIDGE)
        head.ip("link", "set", BRIDGE, "up")
        for node in self.workers:
            host_end = f"rfv{node.index}"
            head.ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns",
                    str(node.keeper.pid))
            head.ip("link", "set", host_end, "master", BRIDGE, "up")
            node.ip("addr", "add", f"{node.address}/24", "dev", "eth0")
            node.ip("link", "set", "eth0", "up")

    def _ray_command(self, node: Node) -> list[str]:
        ray = str(Path(sys.executable).with_name("ray"))
        common = ["start", "--block", "--node-ip-address", node.address, "--disable-usage-stats",
                  "--temp-dir", str(self.root / f"ray-{node.index}"),
                  "--object-store-memory", str(80 * 2**20)]
        if node is self.head:
            # The driver, the frontend and the trainer live here; no fleet worker does.
            return [ray, *common, "--head", "--port", str(RAY_PORT), "--num-cpus", "0",
                    "--include-dashboard", "false"]
        return [ray, *common, "--address", self.ray_address, "--num-cpus", str(self.worker_cpus),
                "--resources", json.dumps({WORKER_RESOURCE: self.worker_slots})]

    def _start_ray(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            log = open(self.root / f"ray-start-{node.index}.log", "ab")
            with log:
                node.ray = subprocess.Popen(node.enter(self._ray_command(node)), stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=self.env, start_new_session=True)
            if node is self.head:
                self._wait_for(node, "Ray runtime started", deadline)
        for node in self.workers:
            self._wait_for(node, "Ray runtime started", deadline)
        self._wait_for_nodes(deadline)

    def _wait_for(self, node: Node, mark: str, deadline: float) -> None:
        log = self.root / f"ray-start-{node.index}.log"
        while mark not in log.read_text(errors="replace"):
            if node.ray.poll() is not None or time.monotonic() > deadline:
                raise LayoutError(f"ray start on {node.name} did not come up (exit "
                                  f"{node.ray.poll()}):\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)

    def _wait_for_nodes(self, deadline: float) -> None:
        """Until the head's GCS lists every node alive (asked from the head, as a driver would)."""
        script = ("import json, ray; ray.init(address=%r, _node_ip_address=%r, "
                  "include_dashboard=False, log_to_driver=False, configure_logging=False); "
                  "print(json.dumps(sum(n['Alive'] for n in ray.nodes()))); ray.shutdown()"
                  % (self.ray_address, self.head.address))
        while True:
            result = subprocess.run(self.head.enter([sys.executable, "-c", script]),
                                    capture_output=True, text=True, env=self.env,
                                    timeout=max(5.0, deadline - time.monotonic()))
            lines = result.stdout.strip().splitlines()
            if lines and lines[-1] == str(len(self.nodes)):
                return
            if time.monotonic() > deadline:
                raise LayoutError(f"the cluster did not list {len(self.nodes)} nodes: "
                                  f"{result.stdout[-500:]} {result.stderr[-2000:]}")
            time.sleep(1.0)

    # -- use -----------------------------------------------------------------------------------
    def run_on(self, index: int, argv: Sequence[str], *, timeout_s: float,
               log_path: str | Path | None, env: Mapping[str, str] | None = None) -> int:
        """Run ``argv`` on node ``index`` (its own process group), output to ``log_path``
        (None: this process's stdout); its exit code. Past ``timeout_s`` its group is killed
        and LayoutError raised."""
        node = self.nodes[index - 1]
        with open(log_path, "ab") if log_path else open(os.dup(1), "wb") as log:
            process = subprocess.Popen(node.enter(argv), stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env={**self.env, **(env or {})},
                                       start_new_session=True)
        try:
            return process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise LayoutError(f"{argv[:3]} on {node.name} ran past {timeout_s:.0f} s") from None
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def listeners(self) -> dict[str, list[tuple[str, int]]]:
        """Node name -> (address, port) of every TCP listener in its namespace."""
        return {node.name: _listeners_of(node) for node in self.nodes}

    # -- stop ----------------------------------------------------------------------------------
    def stop(self) -> list[int]:
        """Ray on every node (SIGTERM to each `ray start`'s group, then every process left in the
        namespace is killed), then the keepers: the namespaces, the bridge and the veth pairs go
        with their last process. Returns PIDs that would not go (none, normally)."""
        for node in reversed(self.nodes):
            if node.ray is not None and node.ray.poll() is None:
                _signal_group(node.ray.pid, signal.SIGTERM)
        for node in reversed(self.nodes):
            if node.ray is not None:
                try:
                    node.ray.wait(10)
                except subprocess.TimeoutExpired:
                    _signal_group(node.ray.pid, signal.SIGKILL)
                    node.ray.wait()
        stuck = []
        for node in self.nodes:
            if node.keeper is not None and node.keeper.poll() is None:
                node.keeper.stdin.close()  # the keeper ends; it is in the namespace too
            stuck += node.kill_all()
            if node.keeper is not None:
                node.keeper.wait(10)
        return stuck


def _run(argv: Sequence[str]) -> None:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise LayoutError(f"{' '.join(argv)} failed: {result.stderr.strip()}")


def _all_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _netns_inode(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _wait_netns(pid: int, timeout_s: float = 10.0) -> int:
    """The inode of the keeper's own namespace, once unshare has made it."""
    mine = _netns_inode(os.getpid())
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        inode = _netns_inode(pid)
        if inode is not None and inode != mine:
            return inode
        time.sleep(0.02)
    raise LayoutError(f"process {pid} did not enter a network namespace of its own")


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _listeners_of(node: Node) -> list[tuple[str, int]]:
    """(address, port) of each listening TCP socket in the node's namespace."""
    pids = node.processes()
    return sorted({(a, p) for a, p, _inode in _listen_rows(pids[0])}) if pids else []


def listeners_of_processes(pids: Sequence[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that one of ``pids`` holds, each read
    from the process's own network namespace (they may be on different nodes)."""
    found = set()
    for pid in pids:
        inodes = socket_inodes(pid)
        found |= {(a, p) for a, p, inode in _listen_rows(pid) if inode in inodes}
    return sorted(found)


def _listen_rows(pid: int) -> list[tuple[str, int, str]]:
    rows = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            hex_address, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_address)
            if family == socket.AF_INET:
                address = socket.inet_ntop(family, raw[::-1])
            else:  # four little-endian 32-bit words
                address = socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1]
                                                            for i in range(0, 16, 4)))
            rows.append((address, int(hex_port, 16), fields[9]))
    return rows
