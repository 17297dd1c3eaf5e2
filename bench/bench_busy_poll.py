"""What vLLM's engine processes spend on a CPU host between rollouts, with the busy-poll of their
shared-memory queues as vLLM sets it (a second after every message) beside the fleet's default
(``cpu_busy_poll_s``). One engine of the tiny model at a time, the same rollouts for each: a
number of 16-token greedy rollouts, one after the other, a fixed gap between them; the CPU
seconds of the engine's own processes (its engine core and model worker) and the wall time.

    unshare -n .venv/bin/python bench/bench_busy_poll.py --gaps 0,2 --rollouts 20
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from process_load import snapshot  # noqa: E402

from rollout_fleet.adapters.tiny_model import build_tiny_model
from rollout_fleet.adapters.vllm.host import VllmEngine, VllmEngineConfig
from rollout_fleet.adapters.vllm.host.config import CPU_BUSY_POLL_S
from rollout_fleet.core.rollout import GREEDY

SETTINGS = {"vLLM's 1 s": None, f"{CPU_BUSY_POLL_S} s": CPU_BUSY_POLL_S}


def engine_cpu_s() -> float:
    """CPU seconds so far of this process's living descendants: the engine's own processes."""
    me = os.getpid()
    return sum(process["cpu_s"] for pid, process in snapshot([me])["processes"].items()
               if pid != me)


async def measure(model: Path, polling: float | None, gaps: list[float],
                  rollouts: int) -> dict[float, tuple[float, float]]:
    """gap -> (the engine processes' CPU seconds, wall seconds) for ``rollouts`` rollouts."""
    engine = VllmEngine(VllmEngineConfig(model=str(model), cpu_busy_poll_s=polling))
    await engine.start(0)
    figures = {}
    try:
        for gap in gaps:
            await asyncio.sleep(2.0)  # past any busy-poll of the start or the last gap
            cpu_before, started = engine_cpu_s(), time.monotonic()
            for index in range(rollouts):
                await engine.serve_rollout([1, 50 + index, 60], request_id=f"gap{gap}-{index}",
                                           max_new_tokens=16, sampling=GREEDY)
                await asyncio.sleep(gap)
            figures[gap] = (engine_cpu_s() - cpu_before,
                            time.monotonic() - started)
    finally:
        await engine.close()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gaps", default="0,2", help="seconds between rollouts, comma-separated")
    parser.add_argument("--rollouts", type=int, default=20)
    args = parser.parse_args(argv)
    gaps = [float(part) for part in args.gaps.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-busy-poll-") as folder:
        model = build_tiny_model(Path(folder) / "tiny")
        results = {name: asyncio.run(measure(model, polling, gaps, args.rollouts))
                   for name, polling in SETTINGS.items()}
    vllms, ours = results.values()
    print(f"{args.rollouts} rollouts of 16 tokens; the engine's processes: CPU s (wall s)")
    print(f"{'gap s':>6} " + "  ".join(f"{name:>16}" for name in SETTINGS) + "  CPU ratio")
    for gap in gaps:
        cells = "  ".join(f"{result[gap][0]:7.2f} ({result[gap][1]:5.1f})" for result in (vllms, ours))
        print(f"{gap:6.1f} {cells}  {ours[gap][0] / vllms[gap][0]:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
