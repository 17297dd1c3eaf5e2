"""The ``rollout-fleet`` command."""

from __future__ import annotations

import argparse
import asyncio
import sys

import attrs

from rollout_fleet.core.errors import RolloutFleetError


def _demo(args: argparse.Namespace) -> int:
    if args.then_async and (args.asynchronous or args.colocated or args.in_memory):
        raise RolloutFleetError("demo: --then-async follows the synchronous loop of the fleet "
                                "demo; it does not combine with --async, --colocated or --in-memory")
    if not args.colocated:
        _refuse_colocated_options(args)
    if args.in_memory:
        from rollout_fleet.wiring.memory_demo import run_memory_demo

        from pathlib import Path

        from rollout_fleet.wiring.demo.report import write_json

        figures = asyncio.run(run_memory_demo(num_workers=args.workers))
        print(f"figures: {write_json(figures, Path(args.out))}")
        if set(figures["weight_versions"].values()) != {1}:
            raise RolloutFleetError(f"the refit did not reach every worker: {figures['weight_versions']}")
        return 0
    from rollout_fleet.wiring.demo.run import DemoSettings, run_demo
    settings = DemoSettings(workers=args.workers, out_dir=args.out,
                            progress=not args.quiet and sys.stderr.isatty(),  # quiet in CI logs
                            asynchronous=args.asynchronous, then_async=args.then_async)
    if args.ci:
        settings = attrs.evolve(settings, steps=2, prompts=4, group_size=4)
    if args.steps is not None:
        settings = attrs.evolve(settings, steps=args.steps)
    if args.colocated:
        from rollout_fleet.wiring.demo.colocated import run_colocated_demo

        run_colocated_demo(_colocated_settings(args, settings), device=args.device)
        return 0
    run_demo(settings)
    return 0


# The colocated demo's own options, each named as its DemoSettings field.
_COLOCATED_OPTIONS = ("model", "dtype", "sleep_level", "in_place", "buffer_mib", "learning_rate",
                      "mismatch_bound")


def _add_colocated_options(demo: argparse.ArgumentParser) -> None:
    group = demo.add_argument_group("with --colocated")
    group.add_argument("--model", default=None,
                       help='a model folder (default "tiny": the tiny model, built)')
    group.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                       help="the trainer's and the engine's dtype (default float32; the "
                            "model folder's weights are loaded in it)")
    group.add_argument("--sleep-level", type=int, choices=(1, 2), default=None,
                       help="1: the sleep frees the KV cache (weights kept in host memory); "
                            "2: the weights too, and each refit loads them all (GPU; default 1)")
    group.add_argument("--in-place", action="store_true", default=None,
                       help="the trainer's parameters live in the sender's buffers: a refit is "
                            "the engine's one copy out of them")
    group.add_argument("--buffer-mib", type=float, default=None,
                       help="each of the sender's two buffers, MiB (default 1)")
    group.add_argument("--learning-rate", type=float, default=None, help="default 1e-2")
    group.add_argument("--mismatch-bound", type=float, default=None,
                       help="the largest train/inference logprob difference a step may show "
                            "(default 1e-3: float32 noise; bf16 needs more)")


def _colocated_settings(args: argparse.Namespace, settings):
    given = {option: getattr(args, option) for option in _COLOCATED_OPTIONS
             if getattr(args, option) is not None}
    return attrs.evolve(settings, workers=1, **given)


def _refuse_colocated_options(args: argparse.Namespace) -> None:
    given = [f"--{option.replace('_', '-')}" for option in _COLOCATED_OPTIONS
             if getattr(args, option) is not None]
    if given:
        raise RolloutFleetError(f"demo: {', '.join(given)} go with --colocated")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout-fleet", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="rollouts and a refit on an embedded fleet",
                               description="A short GRPO loop on an embedded fleet (the tiny model, 2 vLLM workers on "
                               "Ray, Dynamo frontend): rollouts, a policy-gradient step, a refit of "
                               "every worker, per step; writes demo.json and demo.png.")
    demo.add_argument("--workers", type=int, default=2, help="number of workers (default 2)")
    demo.add_argument("--steps", type=int, default=None, help="training steps (default 6)")
    demo.add_argument("--out", default="out/demo", help="folder for demo.json (and demo.png)")
    demo.add_argument("--ci", action="store_true", help="the short form CI runs (2 steps)")
    demo.add_argument("--quiet", action="store_true", help="no progress bars (they show only on a terminal)")
    demo.add_argument("--async", dest="asynchronous", action="store_true",
                      help="one-step off-policy GRPO: the fleet generates the next batch while "
                           "the trainer trains, and refits swap weights under rollouts in flight")
    demo.add_argument("--then-async", action="store_true",
                      help="after the synchronous loop, as many steps one step off-policy on "
                           "the same fleet, continuing from its weights (figures in OUT/async)")
    demo.add_argument("--colocated", action="store_true",
                      help="the trainer and one vLLM worker on one device, taking turns: the "
                           "engine sleeps while the trainer trains (GPUs), refits come from the "
                           "trainer's own buffers (CUDA IPC on a GPU, shared memory on the CPU)")
    demo.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                      help="with --colocated: where the trainer and the worker run (default cpu)")
    demo.add_argument("--in-memory", action="store_true",
                      help="the in-memory demo: core services only, no Ray, Dynamo or vLLM")
    _add_colocated_options(demo)
    demo.set_defaults(run=_demo)
    from rollout_fleet.wiring import cli_generate, cli_refit, cli_serve, cli_sleep

    cli_serve.add_parser(commands)
    cli_generate.add_parser(commands)
    cli_refit.add_parser(commands)
    cli_sleep.add_parsers(commands)
    tiny = commands.add_parser("build-tiny-model", help="write the tiny model folder",
                               description="Write the tiny Llama-style model (config, safetensors "
                                           "weights, tokenizer) built locally from a seed.")
    tiny.add_argument("directory", help="folder to write (created if missing)")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    tiny.set_defaults(run=_build_tiny_model)
    return parser


def _build_tiny_model(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rollout_fleet.adapters.tiny_model import build_tiny_model

    print(build_tiny_model(args.directory, seed=args.seed))
    return 0


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 1000 else text[:997] + "..."


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except RolloutFleetError as exc:
        print(f"rollout-fleet {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:  # files and sockets the command touches
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"rollout-fleet {args.command}: error: {exc.strerror or _one_line(exc)}{where}",
              file=sys.stderr)
        return 1
    except ValueError as exc:  # a value read from a file the command was given
        print(f"rollout-fleet {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"rollout-fleet {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
