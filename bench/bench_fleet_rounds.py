"""Rounds of rollouts through a local vLLM fleet's frontend: how even are they?

    .venv/bin/python bench/bench_fleet_rounds.py [--rounds 12] [--prompts 64] [--tokens 32]

Starts a fleet of 2 vLLM workers on the tiny model (Ray, Dynamo, loopback; the script
re-executes itself inside `unshare -n`), warms a pooled aiohttp client, then sends the same
shape of batch ``--rounds`` times, half a second apart, and prints each round's wall time, the
median and worst/median. A round that waits for a core (see docs/running-a-fleet.md, CPU
settings) shows as a worst/median far above 1.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


async def rounds(url: str, count: int, tokens: int, how_many: int) -> list[float]:
    import aiohttp

    from bench_vllm_frontend import make_requests, post_all

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=count)) as session:
        await post_all(session, url, make_requests(count, 1, "pool"))
        times = []
        for index in range(how_many):
            batch = make_requests(count, tokens, f"round-{index}")
            started = time.perf_counter()
            await post_all(session, url, batch)
            times.append(time.perf_counter() - started)
            await asyncio.sleep(0.5)
        return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()

    from private_netns import reexec_in_private_netns

    reexec_in_private_netns()
    from bench_vllm_frontend import SERVED_MODEL
    from rollout_fleet.wiring.config import parse_config
    from rollout_fleet.wiring.fleet import Fleet

    work = Path(tempfile.mkdtemp(prefix="bench-fleet-rounds-"))
    fleet = Fleet.start(parse_config({
        "engine": {"kind": "vllm"}, "num_workers": 2, "max_model_len": 512,
        "served_model_name": SERVED_MODEL, "run_dir": str(work / "fleet"),
        "timeouts": {"start_s": 900}}))
    try:
        times = asyncio.run(rounds(fleet.frontend_url, args.prompts, args.tokens, args.rounds))
    finally:
        fleet.shutdown()
    median = statistics.median(times)
    print(f"{args.prompts} prompts x {args.tokens} tokens, rounds (s): "
          + " ".join(f"{t:.2f}" for t in times))
    print(f"median {median:.3f} s, worst {max(times):.3f} s, worst/median {max(times) / median:.2f}")


if __name__ == "__main__":
    main()
