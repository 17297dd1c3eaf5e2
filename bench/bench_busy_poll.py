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
import tempfile
import time
from pathlib import Path

from rollout_fleet.adapters.tiny_model import build_tiny_model
from rollout_fleet.adapters.vllm.host import VllmEngine, VllmEngineConfig
from rollout_fleet.adapters.vllm.host.config import CPU_BUSY_POLL_S
from rollout_fleet.core.rollout import GREEDY

SETTINGS = {"vLLM's 1 s": None, f"{CPU_BUSY_POLL_S} s": CPU_BUSY_POLL_S}


def descendants_cpu_s(root: int) -> float:
    """User and system CPU seconds of every living descendant of ``root``."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[tuple[int, float]]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu_s = (int(fields[11]) + int(fields[12])) / tick
        children.setdefault(int(fields[1]), []).append((int(entry), cpu_s))
    total, waiting = 0.0, [root]
    while waiting:
        for pid, cpu_s in children.get(waiting.pop(), []):
            total += cpu_s
            waiting.append(pid)
    return total


async def measure(model: Path, polling: float | None, gaps: list[float],
                  rollouts: int) -> dict[float, tuple[float, float]]:
    """gap -> (the engine processes' CPU seconds, wall seconds) for ``rollouts`` rollouts."""
    engine = VllmEngine(VllmEngineConfig(model=str(model), cpu_busy_poll_s=polling))
    await engine.start(0)
    figures = {}
    try:
        for gap in gaps:
            await asyncio.sleep(2.0)  # past any busy-poll of the start or the last gap
            cpu_before, started = descendants_cpu_s(os.getpid()), time.monotonic()
            for index in range(rollouts):
                await engine.serve_rollout([1, 50 + index, 60], request_id=f"gap{gap}-{index}",
                                           max_new_tokens=16, sampling=GREEDY)
                await asyncio.sleep(gap)
            figures[gap] = (descendants_cpu_s(os.getpid()) - cpu_before,
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
