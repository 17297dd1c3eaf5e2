"""The sender's NCCL path on ONE GPU: a data group of a single rank (the sender alone).

    python3 bench/smoke_nccl_single_gpu.py

NCCL refuses two ranks on one device, so a real sender -> receiver run needs two GPUs. This runs what one GPU allows: the NCCL process group built from the TCPStore
without init_process_group, the header all-reduce, packing on the GPU and the broadcasts with
their bounded waits, and checks the global default group was never initialised.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu_pack  # noqa: E402  (imports rollout_fleet, through a path shim if needed)

from rollout_fleet.adapters.collective import TorchWeightSender  # noqa: E402
from rollout_fleet.adapters.collective.group import CollectiveGroup, _process_group  # noqa: E402
from rollout_fleet.adapters.collective.transfer import refit_info_of  # noqa: E402
from rollout_fleet.core.refit import CollectiveSenderSpec  # noqa: E402


def main() -> None:
    torch.cuda.set_device(0)
    listen = socket.socket()
    listen.bind(("127.0.0.1", 0))
    listen.listen()
    port = listen.getsockname()[1]
    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", port, None, True, timeout, wait_for_workers=False,
                          master_listen_fd=os.dup(listen.fileno()))  # the store closes its own
    listen.close()
    pg = _process_group(store, "nccl", "127.0.0.1", 0, 1, timeout, 0, 30.0)
    # world_size 1, no trainer ranks beyond rank 0: a data group of the sender alone.
    group = CollectiveGroup(host="127.0.0.1", port=port, rank=0, world_size=1, train_world_size=1,
                            backend="nccl", timeout_s=30.0, store=store,
                            process_group=pg, data_rank=0)
    state = bench_gpu_pack.state_dict(1, torch.device("cuda"))
    info = refit_info_of(state)
    for mib, buffers in ((256, 2), (1024, 2)):
        sender = TorchWeightSender(group, CollectiveSenderSpec(buffer_bytes=mib << 20,
                                                               num_buffers=buffers))
        sender.send(info, state)  # warm-up: NCCL communicator creation
        torch.cuda.synchronize()
        start = time.perf_counter()
        sender.send(info, state)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        print(f"NCCL sender alone, {info.total_bytes / 2**30:.2f} GiB, buffer {mib} MiB x"
              f" {buffers}: {seconds * 1e3:.1f} ms (pack + broadcast to no one)")
    assert not dist.is_initialized(), "the global default group was initialised"
    group.close()
    print("ok: NCCL group without init_process_group, header exchange, packed sends")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
