"""The serving sweep's records and report (bench/bench_serve_sweep.py): shapes, the engines' KV
cache facts read from their logs, the time budget, and the markdown table and plot made from
one or several runs' records."""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

ROUNDS_FILE = "rounds.jsonl"
ENGINES_FILE = "engines.json"
FLEET, VLLM = "fleet", "vllm"
# What a user would deploy instead of the fleet, each a way of its own in the rounds: vLLM's
# server with K API processes (``vllm`` is one), and Dynamo's own vLLM worker behind Dynamo's
# frontend. Each shape's anchor is the best of those measured (its median output tokens/s).
VLLM_API_SERVERS = {VLLM: 1, "vllm-k2": 2, "vllm-k4": 4, "vllm-k8": 8}
DYNAMO_VLLM = "dynamo-vllm"
ANCHORS = (*VLLM_API_SERVERS, DYNAMO_VLLM)


@dataclass(frozen=True, order=True)
class Shape:
    input_len: int
    output_len: int
    concurrency: int

    @classmethod
    def parse(cls, text: str) -> "Shape":
        """``INPUTxOUTPUTxCONCURRENCY``, e.g. ``1024x128x256``."""
        parts = text.lower().split("x")
        if len(parts) != 3 or not all(part.isdigit() and int(part) > 0 for part in parts):
            raise ValueError(f"shape {text!r}: expected INPUTxOUTPUTxCONCURRENCY of positive"
                             f" integers, e.g. 1024x128x256")
        return cls(*map(int, parts))

    def __str__(self) -> str:
        return f"{self.input_len}x{self.output_len}x{self.concurrency}"

    def work(self, prompts: int) -> float:
        """A rough cost for the budget: a prefill token costs about an eighth of a decode step's
        token at these batch sizes (so the estimate errs long for prefill-heavy shapes)."""
        return prompts * (self.input_len / 8 + self.output_len)


# What each vLLM version logs about its KV cache once the engine has sized it.
_KV_PATTERNS = {
    "kv_cache_gib": r"Available KV cache memory: ([\d.]+) GiB|set \(([\d.]+)/[\d.]+\) GiB for KV cache",
    "kv_cache_tokens": r"KV cache size: ([\d,]+) tokens",
    "max_concurrency": r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x",
    "max_model_len": r"Maximum concurrency for ([\d,]+) tokens per request",
}


def engine_facts(log_text: str) -> dict[str, float | None]:
    """The first value each KV pattern finds in a server's log (None where it logs none)."""
    facts: dict[str, float | None] = {}
    for name, pattern in _KV_PATTERNS.items():
        found = re.search(pattern, log_text)
        value = next((group for group in found.groups() if group), None) if found else None
        facts[name] = None if value is None else float(value.replace(",", ""))
    return facts


class Budget:
    """Whether the next shape fits in what is left of ``seconds``: its estimate is its work at
    the slowest pace seen so far (work per second of wall time over the shapes done)."""

    def __init__(self, seconds: float | None, started: float, reserve_s: float = 45.0) -> None:
        self.deadline = None if seconds is None else started + seconds - reserve_s
        self.seconds_per_work: float | None = None

    def fits(self, now: float, work: float) -> bool:
        if self.deadline is None:
            return True
        if self.seconds_per_work is None:  # nothing measured yet: the first shape always runs
            return now < self.deadline
        return now + work * self.seconds_per_work <= self.deadline

    def record(self, work: float, seconds: float) -> None:
        pace = seconds / work
        self.seconds_per_work = max(pace, self.seconds_per_work or 0.0)


def check_positions(model: Path, max_model_len: int) -> Path:
    """A model folder an earlier call built, if its positions hold this run's context (a GPU
    model is built with exactly the positions its first run asked for); else a clear exit."""
    positions = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    if positions < max_model_len:
        raise SystemExit(f"--model-dir {model}: its model has {positions} positions, this run "
                         f"needs max_model_len {max_model_len}; name another folder")
    return model


def append_round(out: Path, record: dict) -> None:
    with open(out / ROUNDS_FILE, "a") as stream:
        stream.write(json.dumps(record) + "\n")


def load_records(folders: list[Path]) -> tuple[list[dict], dict[str, dict]]:
    rounds, engines = [], {}
    for number, folder in enumerate(folders, 1):
        if (folder / ROUNDS_FILE).exists():
            rounds += [{**json.loads(line), "call": number}
                       for line in (folder / ROUNDS_FILE).read_text().splitlines() if line.strip()]
        if (folder / ENGINES_FILE).exists():
            call = f"call {number}" if len(folders) > 1 else folder.name  # calls share folder names
            for key, facts in json.loads((folder / ENGINES_FILE).read_text()).items():
                engines[f"{call}: {key}"] = facts
    return rounds, engines


def failure_record(arrangement: str, shape: Shape, why: str) -> dict:
    """A shape a server failed requests of, kept among the rounds: none of its rounds makes a
    ratio, in this call's table or in a table combined later."""
    return {"arrangement": arrangement, "shape": str(shape), "failed": why}


def failures(rounds: list[dict]) -> dict[tuple[str, Shape], str]:
    return {(r["arrangement"], Shape.parse(r["shape"])): r["failed"] for r in rounds if "failed" in r}


def medians(rounds: list[dict]) -> dict[tuple[str, Shape, str], dict]:
    """(arrangement, shape, way) -> median output tokens/s, median TTFT and TPOT, round count."""
    grouped: dict[tuple[str, Shape, str], list[dict]] = {}
    for record in (r for r in rounds if "failed" not in r):
        key = (record["arrangement"], Shape.parse(record["shape"]), record["way"])
        grouped.setdefault(key, []).append(record)
    return {key: {"tokens_s": statistics.median(r["output_throughput"] for r in group),
                  "ttft_ms": statistics.median(r["median_ttft_ms"] for r in group),
                  "tpot_ms": statistics.median(r["median_tpot_ms"] for r in group),
                  "rounds": len(group)}
            for key, group in grouped.items()}


def round_ratios(rounds: list[dict], arrangement: str, shape: Shape, anchor: str) -> list[float]:
    """Fleet / ``anchor`` output tokens/s of each round both ways ran (a round of one call),
    sorted: the spread the medians hide."""
    pairs: dict[tuple, dict[str, float]] = {}
    for record in rounds:
        if ("round" in record and record["arrangement"] == arrangement
                and Shape.parse(record["shape"]) == shape and "failed" not in record):
            pair = pairs.setdefault((record.get("call"), record["round"]), {})
            pair[record["way"]] = record["output_throughput"]
    return sorted(pair[FLEET] / pair[anchor] for pair in pairs.values()
                  if FLEET in pair and anchor in pair)


def ratio_rows(rounds: list[dict]) -> list[dict]:
    """One row per (arrangement, shape) measured on the fleet and at least one anchor, and
    failed by none: fleet / the best anchor (the highest median output tokens/s) of the
    medians, and of each round; every anchor's medians beside it."""
    table, failed = medians(rounds), failures(rounds)
    rows = []
    for arrangement, shape in sorted({(a, s) for a, s, _ in table} - set(failed)):
        fleet = table.get((arrangement, shape, FLEET))
        anchors = {way: table[(arrangement, shape, way)] for way in ANCHORS
                   if (arrangement, shape, way) in table}
        if fleet is None or not anchors:
            continue
        best = max(anchors, key=lambda way: anchors[way]["tokens_s"])
        rows.append({"arrangement": arrangement, "shape": shape, "fleet": fleet,
                     "anchor": best, "vllm": anchors[best], "anchors": anchors,
                     "tokens_ratio": fleet["tokens_s"] / anchors[best]["tokens_s"],
                     "ttft_ratio": fleet["ttft_ms"] / anchors[best]["ttft_ms"],
                     "round_ratios": round_ratios(rounds, arrangement, shape, best)})
    return rows


def markdown(rounds: list[dict], engines: dict[str, dict]) -> str:
    rows = ratio_rows(rounds)
    measured = [way for way in ANCHORS if any(way in row["anchors"] for row in rows)]
    lines = ["| arrangement | input | output | concurrency | best anchor |"
             " fleet / anchor output tokens/s | fleet / anchor median TTFT | fleet tokens/s |"
             " anchor tokens/s | fleet TTFT ms | anchor TTFT ms | fleet TPOT ms | anchor TPOT ms |"
             " rounds | fleet / anchor tokens/s of each round, lowest-highest |"
             + "".join(f" {way} tokens/s |" for way in measured),
             "| --- " * (15 + len(measured)) + "|"]
    for row in rows:
        s, f, v = row["shape"], row["fleet"], row["vllm"]
        others = "".join(f" {row['anchors'][way]['tokens_s']:,.0f} |" if way in row["anchors"]
                         else " - |" for way in measured)
        lines.append(f"| {row['arrangement']} | {s.input_len} | {s.output_len} | {s.concurrency} |"
                     f" {anchor_arrangement(row['anchor'])} |"
                     f" **{row['tokens_ratio']:.3f}** | **{row['ttft_ratio']:.2f}x** |"
                     f" {f['tokens_s']:,.0f} | {v['tokens_s']:,.0f} | {f['ttft_ms']:,.0f} |"
                     f" {v['ttft_ms']:,.0f} | {f['tpot_ms']:.1f} | {v['tpot_ms']:.1f} |"
                     f" {min(f['rounds'], v['rounds'])} | {_spread(row['round_ratios'])} |{others}")
    failed = failures(rounds)
    if failed:
        lines += ["", "Failed, no ratio (a server failed some of the shape's requests):", ""]
        lines += [f"- {a} {shape}: {why}" for (a, shape), why in sorted(failed.items())]
    lines += ["", "Each engine's KV cache, as its log says:", "",
              "| engine | KV cache GiB | KV cache tokens | max concurrency (x max_model_len) |"
              " max_model_len | start s |", "| --- | --- | --- | --- | --- | --- |"]
    for name, facts in sorted(engines.items()):
        cells = [_cell(facts.get(key)) for key in
                 ("kv_cache_gib", "kv_cache_tokens", "max_concurrency", "max_model_len", "start_s")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def anchor_arrangement(way: str) -> str:
    """An anchor's arrangement in words: what a user would run instead of the fleet."""
    if way == DYNAMO_VLLM:
        return "Dynamo's vLLM worker + Dynamo's frontend"
    count = VLLM_API_SERVERS[way]
    return f"vLLM's server, {count} API process{'es' if count > 1 else ''}"


def _spread(ratios: list[float]) -> str:
    return f"{ratios[0]:.3f}-{ratios[-1]:.3f}" if ratios else "-"


def _cell(value: float | None) -> str:
    if value is None:
        return "not logged"
    return f"{value:,.0f}" if value == int(value) else f"{value:,.2f}"


def plot(rounds: list[dict], path: Path) -> str:
    """Both ratios per shape, one panel per arrangement; or why there is no plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed"
    rows = ratio_rows(rounds)
    if not rows:
        return "no plot: no shape was measured on the fleet and an anchor"
    arrangements = sorted({row["arrangement"] for row in rows})
    figure, axes = plt.subplots(len(arrangements), 1, squeeze=False,
                                figsize=(max(6, len(rows) * 0.6), 3.5 * len(arrangements)))
    for axis, arrangement in zip(axes[:, 0], arrangements):
        mine = [row for row in rows if row["arrangement"] == arrangement]
        where = range(len(mine))
        axis.bar([x - 0.2 for x in where], [r["tokens_ratio"] for r in mine], 0.4,
                 label="output tokens/s, fleet / best anchor")
        axis.bar([x + 0.2 for x in where], [r["ttft_ratio"] for r in mine], 0.4,
                 label="median TTFT, fleet / best anchor")
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xticks(list(where), [str(r["shape"]) for r in mine], rotation=60, fontsize=7)
        axis.set_title(f"{arrangement} (input x output x concurrency)")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return f"plot: {path}"


def write_report(folders: list[Path], out: Path) -> str:
    """The table (sweep.md) and the plot (sweep.png) of every round recorded in ``folders``."""
    rounds, engines = load_records(folders)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rounds, engines)
    note = plot(rounds, out / "sweep.png")
    (out / "sweep.md").write_text(table + "\n" + note + "\n")
    return table + "\n" + note
