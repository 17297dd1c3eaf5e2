"""The agentic load's plan and its figures (bench/bench_agentic.py): what each trajectory sends
turn by turn, and what a side's answers add up to. Pure logic: no server, no network.

A trajectory opens with ``first_context`` words; each turn the model answers ``answer_tokens``
tokens; after a seeded tool latency the agent appends that answer and a tool result of
``tool_result_tokens`` words and sends the whole conversation again, so the last turn's prompt
and answer come to about ``last_context`` tokens.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from fresh_prompts import prompt_seed


@dataclass(frozen=True)
class LoadShape:
    trajectories: int
    turns: int
    first_context: int
    last_context: int
    answer_tokens: int
    tool_latency_ms: tuple[float, float] = (0.0, 200.0)

    def __post_init__(self) -> None:
        if min(self.trajectories, self.turns, self.first_context, self.answer_tokens) < 1:
            raise ValueError(f"{self}: trajectories, turns, contexts and answers must be >= 1")
        if self.turns > 1 and self.tool_result_tokens < 1:
            raise ValueError(f"{self}: from {self.first_context} to {self.last_context} tokens"
                             f" in {self.turns} turns of {self.answer_tokens}-token answers"
                             " leaves no room for a tool result")
        low, high = self.tool_latency_ms
        if not 0 <= low <= high:
            raise ValueError(f"tool latency {self.tool_latency_ms}: want 0 <= low <= high ms")

    @property
    def tool_result_tokens(self) -> int:
        """What each turn after the first appends beside the previous answer, so that the last
        turn's prompt and answer come to ``last_context``."""
        if self.turns == 1:
            return 0
        grown = self.last_context - self.first_context - self.answer_tokens
        return round(grown / (self.turns - 1)) - self.answer_tokens

    def planned_prompt(self, turn: int) -> int:
        """Turn ``turn``'s prompt tokens (0-based), the chat template's own tokens left out."""
        return self.first_context + turn * (self.answer_tokens + self.tool_result_tokens)

    def live_tokens(self, turn: int) -> int:
        """Every trajectory's context once turn ``turn`` is answered: what a prefix cache must
        hold for the next turn to find all of its earlier tokens."""
        return self.trajectories * (self.planned_prompt(turn) + self.answer_tokens)


@dataclass(frozen=True)
class TrajectoryPlan:
    """One trajectory's seeded draws: its content's seed and the tool latency before each turn
    after the first."""

    index: int
    content_seed: int
    tool_latencies_s: tuple[float, ...]


def trajectory_plans(shape: LoadShape, label: str) -> list[TrajectoryPlan]:
    """Every trajectory of one run, seeded by ``label`` (its round and content): the same label,
    the same draws on every side and in every process."""
    plans = []
    for index in range(shape.trajectories):
        rng = random.Random(prompt_seed(label, index))
        low, high = shape.tool_latency_ms
        latencies = tuple(rng.uniform(low, high) / 1e3 for _ in range(shape.turns - 1))
        plans.append(TrajectoryPlan(index, rng.getrandbits(32), latencies))
    return plans


def words_text(words: Sequence[str], count: int, rng: random.Random) -> str:
    """``count`` words drawn from ``words`` (each one token after a space), space-joined."""
    return " ".join(rng.choice(words) for _ in range(count))


@dataclass(frozen=True)
class TurnRecord:
    """One answered turn as the client saw it. ``earlier_tokens``: the trajectory's previous
    prompt and answer (what a prefix cache could hold of this turn's prompt; 0 on turn 0);
    ``cached_tokens``: the prompt tokens the server says it found cached (None: not told)."""

    trajectory: int
    turn: int
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    earlier_tokens: int
    ended_at: float  # wall clock (time.time()): arms span several client processes


def hit_fraction(records: Iterable[TurnRecord]) -> float | None:
    """Of the earlier turns' tokens of the turns after the first, the share found in the
    prefix cache (None where no answer told its cached tokens)."""
    told = [r for r in records if r.turn > 0 and r.cached_tokens is not None]
    earlier = sum(r.earlier_tokens for r in told)
    return None if not told or earlier == 0 else min(sum(r.cached_tokens or 0 for r in told),
                                                     earlier) / earlier


def per_turn(records: Sequence[TurnRecord], turns: int) -> list[dict]:
    """Each turn's count, median TTFT (ms), median prompt tokens and prefix-cache hit share."""
    rows = []
    for turn in range(turns):
        mine = [r for r in records if r.turn == turn]
        rows.append({
            "turn": turn + 1, "answered": len(mine),
            "median_ttft_ms": _median([r.ttft_s * 1e3 for r in mine]),
            "median_prompt_tokens": _median([r.prompt_tokens for r in mine]),
            "prefix_cache_hits": hit_fraction(mine) if turn > 0 else None})
    return rows


def arm_figures(records: Sequence[TurnRecord], started_at: float, planned_turns: int) -> dict:
    """One side's figures over a run that began at ``started_at`` (wall clock): output tokens
    per second to its last answer, median TTFT, turns answered of those planned, the prefix
    cache's share of the earlier turns' tokens."""
    if not records:
        return {"answered": 0, "planned": planned_turns, "output_tokens_per_s": 0.0,
                "median_ttft_ms": None, "prefix_cache_hits": None, "duration_s": 0.0}
    duration = max(r.ended_at for r in records) - started_at
    output = sum(r.completion_tokens for r in records)
    return {"answered": len(records), "planned": planned_turns,
            "output_tokens": output, "duration_s": round(duration, 2),
            "output_tokens_per_s": output / max(duration, 1e-9),
            "median_ttft_ms": _median([r.ttft_s * 1e3 for r in records]),
            "median_latency_ms": _median([r.latency_s * 1e3 for r in records]),
            "prefix_cache_hits": hit_fraction(records)}


def best_anchor(figures: dict[str, dict], anchors: Iterable[str]) -> str | None:
    """The anchor with the highest output tokens/s (None if none ran)."""
    ran = [a for a in anchors if a in figures and figures[a]["answered"]]
    return max(ran, key=lambda a: figures[a]["output_tokens_per_s"]) if ran else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def counter_share(before: dict[str, float], after: dict[str, float], hits: str,
                  queried: str, earlier_tokens: int) -> dict:
    """A server's prefix-cache counters over a run: hit tokens, queried tokens, and the hits
    as a share of the earlier turns' tokens the client sent."""
    hit = after.get(hits, 0.0) - before.get(hits, 0.0)
    asked = after.get(queried, 0.0) - before.get(queried, 0.0)
    return {"hit_tokens": hit, "queried_tokens": asked,
            "hits_of_queried": ratio(hit, asked), "hits_of_earlier": ratio(hit, earlier_tokens)}


def records_as_rows(records: Iterable[TurnRecord]) -> list[dict]:
    return [asdict(r) for r in records]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None
