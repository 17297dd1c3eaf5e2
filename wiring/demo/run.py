"""The demo: a short GRPO loop on the embedded fleet (tiny model, 2 vLLM workers on Ray,
Dynamo frontend, refits over gloo), printing what an RL engineer watches."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import attrs
from rollout_fleet.core.errors import InvalidValue, RolloutFleetError
from rollout_fleet.wiring.progress import progress_bar


def _at_least_one(_settings: Any, field: "attrs.Attribute[int]", value: int) -> None:
    if value < 1:
        raise InvalidValue(field.name, value, "the demo needs at least one")


@attrs.frozen
class DemoSettings:
    """What the demo runs; the CLI's flags set these (``rollout-fleet demo --help``)."""

    # Each step: `prompts` random prompts of `prompt_len` tokens, `group_size` samples each.
    steps: int = attrs.field(default=6, validator=_at_least_one)
    prompts: int = attrs.field(default=8, validator=_at_least_one)
    group_size: int = attrs.field(default=8, validator=_at_least_one)
    prompt_len: int = attrs.field(default=8, validator=_at_least_one)
    max_new_tokens: int = attrs.field(default=16, validator=_at_least_one)
    # The fleet it runs on.
    workers: int = attrs.field(default=2, validator=_at_least_one)
    learning_rate: float = 1e-2
    seed: int = 0
    mismatch_bound: float = 1e-3  # float32 noise between two implementations of one model
    out_dir: str = "out/demo"
    engine: str = "vllm"
    progress: bool = True
    # One-step off-policy: the fleet generates batch k+1 while the trainer trains on batch k,
    # and each refit swaps weights under the rollouts in flight (keep mode).
    asynchronous: bool = False
    # After the synchronous loop, as many steps one step off-policy on the same fleet,
    # continuing from its weights (their figures in ``out_dir/async``).
    then_async: bool = False
    # The colocated demo's own: the model folder ("tiny": built), its dtype (the trainer's and
    # the engine's), the sleep level between phases (GPU), the trainer's parameters held in the
    # sender's buffers (one copy per refit), and the size of each of its two buffers.
    model: str = "tiny"
    dtype: str = "float32"
    sleep_level: int = 1
    in_place: bool = False
    buffer_mib: float = 1.0  # several buckets per refit even for the tiny model


class DemoFailed(RolloutFleetError):
    """A check of the demo did not hold (refit missed a worker, mismatch too large)."""


def run_demo(settings: DemoSettings) -> list[dict[str, Any]]:
    import ray
    import torch
    from rollout_fleet.adapters.collective import TrainerRefitSession
    from rollout_fleet.adapters.shared import free_port
    from rollout_fleet.wiring.demo.trainer import (
        PolicyTrainer,
        TargetTokenReward,
    )
    from rollout_fleet.wiring.fleet import Fleet

    torch.set_num_threads(1)  # the workers need the cores more than the tiny trainer does
    config = _demo_config(settings)
    print(f"starting a fleet of {settings.workers} {settings.engine} workers on Ray ...", flush=True)
    started = time.perf_counter()
    fleet = Fleet.start(config)
    steps: list[list[dict[str, Any]]] = []  # each loop's
    loops: list[DemoSettings] = []
    session = None
    generation = None
    try:
        print(f"fleet up in {time.perf_counter() - started:.1f} s: frontend {fleet.frontend_url}",
              flush=True)
        # Off-policy by at most one step: a refit waits for rollouts two versions old.
        off_policy = settings.asynchronous or settings.then_async
        generation = fleet.generation(max_staleness=1 if off_policy else None)
        trainer = PolicyTrainer(fleet.model_path, learning_rate=settings.learning_rate,
                                seed=settings.seed)
        reward = TargetTokenReward(trainer.model.config.vocab_size, seed=settings.seed)
        prompts = demo_prompts(settings, trainer.model.config.vocab_size)

        port = free_port("127.0.0.1")
        world_size = 1 + settings.workers
        joining = generation.init_collective("127.0.0.1", port, world_size, train_world_size=1)
        session = TrainerRefitSession("127.0.0.1", port, 0, world_size,
                                      spec=generation.get_collective_sender_spec(), timeout_s=120)
        ray.get(joining, timeout=300)
        info = generation.prepare_refit_info(trainer.state_dict_info())

        loops = [settings]
        if settings.then_async and not settings.asynchronous:
            loops.append(attrs.evolve(settings, asynchronous=True,
                                      out_dir=str(Path(settings.out_dir) / "async")))
        for loop in loops:
            steps.append(_run_loop(generation, trainer, session, info, prompts, loop, reward,
                                   first_version=sum(len(done) for done in steps)))
    finally:
        shut_down(fleet, generation, session)
    for loop, loop_steps in zip(loops, steps):
        write_figures(loop_steps, loop)
    return steps[0]


def _run_loop(generation, trainer, session, info, prompts, settings: DemoSettings, reward, *,
              first_version: int) -> list[dict[str, Any]]:
    """One loop's steps, from the fleet at weight version ``first_version`` (the trainer's)."""
    from rollout_fleet.wiring.demo.report import header

    print(header(), flush=True)
    started = time.perf_counter()
    run = _async_steps if settings.asynchronous else _sync_steps
    steps = run(generation, trainer, session, info, prompts, settings, reward, first_version)
    print_summary(steps, time.perf_counter() - started, settings)
    return steps


def shut_down(fleet, generation, weights_channel) -> None:
    """Close what a demo opened (None: never opened): the trainer's way to send weights, the
    driver, then the fleet."""
    if weights_channel is not None:
        weights_channel.close()
    if generation is not None:
        generation.shutdown()
    fleet.shutdown()


def write_figures(steps: list[dict[str, Any]], settings: DemoSettings) -> list[dict[str, Any]]:
    from rollout_fleet.wiring.demo.report import write_outputs

    json_path, png_path = write_outputs(steps, Path(settings.out_dir), attrs.asdict(settings))
    print(f"figures: {json_path}  plot: {png_path}")
    return steps


def _demo_config(settings: DemoSettings):
    from rollout_fleet.wiring.config import parse_config

    return parse_config({
        "engine": {"kind": settings.engine}, "num_workers": settings.workers, "model": "tiny",
        "served_model_name": "tiny", "max_new_tokens": settings.max_new_tokens,
        "max_model_len": 512, "refit": {"buffer_bytes": 8 << 20, "num_buffers": 2},
        "timeouts": {"start_s": 600, "refit_s": 300}})


def _sync_steps(generation, trainer, session, info, prompts, settings: DemoSettings, reward,
                first_version: int = 0):
    """On-policy GRPO: generate a batch, train on it, refit the fleet, and again."""
    from rollout_fleet.wiring.demo.report import row

    steps: list[dict[str, Any]] = []
    for step in range(1, settings.steps + 1):
        scored, seconds = scored_rollouts(generation, prompts, settings, reward)
        figures = batch_figures(step, scored, seconds, trainer)
        figures["loss"] = trainer.step(scored, settings.group_size)
        figures.update(_refit(generation, trainer, session, info, mode=None))
        steps.append(figures)
        print(row(figures), flush=True)
        _check_step(figures, step, settings, first_version)
    return steps


def _async_steps(generation, trainer, session, info, prompts, settings: DemoSettings, reward,
                 first_version: int = 0):
    """One-step off-policy GRPO: while the fleet generates the next batch (on the weights of
    the last refit), the trainer trains on the batch just finished, then refits in keep mode:
    the next batch's rollouts in flight go on under the new weights, and their per-token
    versions say which weights sampled each token."""
    import concurrent.futures

    from rollout_fleet.wiring.demo.report import row

    steps: list[dict[str, Any]] = []
    quiet = attrs.evolve(settings, progress=False)  # the bar would cross the table's rows
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="demo-rollouts") as fleet_side:
        pending = fleet_side.submit(scored_rollouts, generation, prompts, quiet, reward)
        for step in range(1, settings.steps + 1):
            scored, seconds = pending.result()
            trainer_version = first_version + step - 1  # the trainer's weights before this step
            if step < settings.steps:  # the next batch runs while this one trains
                pending = fleet_side.submit(scored_rollouts, generation, prompts, quiet, reward)
            figures = batch_figures(step, scored, seconds, trainer)
            figures["off_policy_tokens"] = _share_older_than(scored, trainer_version)
            figures["loss"] = trainer.step(scored, settings.group_size)
            figures.update(_refit(generation, trainer, session, info, mode="keep"))
            steps.append(figures)
            print(row(figures), flush=True)
            _check_step(figures, step, settings, first_version)
    return steps


def _refit(generation, trainer, session, info, *, mode: str | None) -> dict[str, Any]:
    """Send the trainer's weights to every worker; ``mode`` None drains and then invalidates
    every cache, "keep" lets rollouts in flight go on. Its seconds and the workers' versions."""
    import ray

    started = time.perf_counter()
    updating = (generation.update_weights_from_collective() if mode is None
                else generation.update_weights_from_collective(mode=mode))
    session.send_state_dict(trainer.state_dict(), info)
    ray.get(updating, timeout=300)
    if mode is None:
        generation.invalidate_kv_cache()
    seconds = time.perf_counter() - started
    versions = generation.get_weight_versions()
    return {"refit_s": seconds, "weight_versions": [versions[w] for w in sorted(versions)]}


def batch_figures(step: int, scored, seconds: float, trainer) -> dict[str, Any]:
    tokens = sum(len(s.tokens) for s in scored)
    figures: dict[str, Any] = {"step": step}
    figures["mean_reward"] = sum(s.reward for s in scored) / len(scored)
    figures["rollouts_per_s"] = len(scored) / seconds
    figures["tokens_per_s"] = tokens / seconds
    figures["mismatch_mean"], figures["mismatch_max"] = trainer.mismatch(scored)
    return figures


def _share_older_than(scored, version: int) -> float:
    """The share of generated tokens that weights older than ``version`` sampled."""
    versions = [v for s in scored for v in s.versions]
    return sum(v < version for v in versions) / len(versions) if versions else 0.0


def print_summary(steps: list[dict[str, Any]], seconds: float, settings: DemoSettings) -> None:
    """Rollouts per second of the whole loop (generation, training and refits together)."""
    rollouts = len(steps) * settings.prompts * settings.group_size
    mode = "async (one step off-policy, keep refits)" if settings.asynchronous else "synchronous"
    print(f"{mode}: {rollouts} rollouts in {seconds:.1f} s = {rollouts / seconds:.1f} rollouts/s "
          f"over the whole loop; reward {steps[0]['mean_reward']:.3f} -> "
          f"{steps[-1]['mean_reward']:.3f}", flush=True)
    steps[-1]["loop_rollouts_per_s"] = rollouts / seconds


def demo_prompts(settings: DemoSettings, vocab_size: int) -> list[list[int]]:
    import random

    rng = random.Random(settings.seed)
    return [[rng.randrange(3, vocab_size) for _ in range(settings.prompt_len)]
            for _ in range(settings.prompts)]


def scored_rollouts(generation, prompts, settings: DemoSettings, reward):
    """One batch: every prompt ``group_size`` times, sampled; scored as they finish."""
    import torch
    from rollout_fleet.wiring.demo.trainer import Scored

    batch = [p for p in prompts for _ in range(settings.group_size)]
    data = {"input_ids": torch.tensor(batch, dtype=torch.long),
            "input_lengths": torch.full((len(batch),), settings.prompt_len, dtype=torch.long)}
    scored: list[Scored | None] = [None] * len(batch)
    bar = progress_bar(len(batch), desc="rollouts", shown=settings.progress, leave=False,
                       mininterval=0.5)

    async def collect():
        async for index, sample in generation.generate_async(data, greedy=False):
            n = int(sample["generation_lengths"][0])
            start = settings.prompt_len
            tokens = tuple(sample["output_ids"][0, start:start + n].tolist())
            logprobs = tuple(sample["logprobs"][0, start:start + n].tolist())
            versions = tuple(sample["weight_versions"][0, start:start + n].tolist())
            scored[index] = Scored(tuple(batch[index]), tokens, logprobs, reward(tokens), versions)
            bar.update(1)

    started = time.perf_counter()
    asyncio.run(collect())
    bar.close()
    return scored, time.perf_counter() - started


def _check_step(figures: dict[str, Any], step: int, settings: DemoSettings,
                first_version: int = 0) -> None:
    version = first_version + step
    if figures["weight_versions"] != [version] * settings.workers:
        raise DemoFailed(f"step {step}: the refit did not reach every worker "
                         f"(weight versions {figures['weight_versions']}, expected {version} each)")
    # Off-policy tokens differ from the trainer's weights by design: checked when synchronous.
    if not settings.asynchronous and figures["mismatch_max"] > settings.mismatch_bound:
        raise DemoFailed(f"step {step}: train/inference logprob mismatch "
                         f"{figures['mismatch_max']:.2e} exceeds {settings.mismatch_bound:.0e}")
