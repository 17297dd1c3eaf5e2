"""``rollout-fleet sleep`` / ``rollout-fleet wake``: put a running fleet's workers to sleep
(their engines give their device memory back, e.g. to a colocated trainer) and wake them.

Asleep, a worker refuses rollouts with a retryable 503 that says so. Level 1 frees the KV
cache and keeps the weights; level 2 frees the weights too, and a refit must load weights
before the worker serves again. A sleep while asleep, or a wake while awake, changes nothing
and says so. Every worker in the fleet file is asked; a worker that refuses (an engine with no
sleep mode, such as vLLM on the CPU) is named with its reason, and the command exits non-zero.
"""

from __future__ import annotations

import argparse
from typing import Any

from rollout_fleet.core.errors import WorkerFailures
from rollout_fleet.core.sleep_state import SLEEP_LEVELS, SLEEP_MODES, WAKE_TAGS, SleepState
from rollout_fleet.wiring.cli_args import add_required_fleet_file, documented_command


def add_parsers(commands: argparse._SubParsersAction) -> None:
    sleep = documented_command(commands, "sleep", doc=__doc__,
                               summary="put a running fleet's workers to sleep")
    _common(sleep)
    sleep.add_argument("--level", type=int, default=1, choices=SLEEP_LEVELS,
                       help="1: free the KV cache (default); 2: free the weights too")
    sleep.add_argument("--mode", default="wait", choices=SLEEP_MODES,
                       help="the rollouts in flight: wait for them (default), abort them, or "
                            "keep them frozen until the wake")
    sleep.set_defaults(run=run_sleep)
    wake = documented_command(commands, "wake", doc=__doc__,
                              summary="wake a running fleet's workers")
    _common(wake)
    wake.add_argument("--tags", default=None,
                      help=f"comma-separated, of {', '.join(WAKE_TAGS)} (default: both)")
    wake.set_defaults(run=run_wake)


def _common(parser: argparse.ArgumentParser) -> None:
    add_required_fleet_file(parser)
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds for each worker's answer (default 120)")


def run_sleep(args: argparse.Namespace) -> int:
    return _everywhere(args, "sleep", {"level": args.level, "mode": args.mode})


def run_wake(args: argparse.Namespace) -> int:
    tags = None if args.tags is None else [t.strip() for t in args.tags.split(",") if t.strip()]
    return _everywhere(args, "wake_up", {"tags": tags})


def _everywhere(args: argparse.Namespace, name: str, body: dict[str, Any]) -> int:
    from rollout_fleet.wiring.fleet import call_control
    from rollout_fleet.wiring.fleet_file import FleetFile, check_fleet_running

    fleet = FleetFile.read(args.fleet_file)
    check_fleet_running(fleet)
    answers: dict[str, dict[str, Any]] = {}
    failures: dict[str, BaseException] = {}
    for worker, url in sorted(fleet.control_urls.items()):
        try:
            answers[worker] = call_control(url, name, fleet.secret, body, timeout_s=args.timeout)
        except (OSError, ValueError) as error:
            failures[worker] = error
    for worker, answer in answers.items():
        print(f"{worker}: {_described(SleepState.from_wire(answer), answer.get('changed'))}")
    if failures:
        raise WorkerFailures(name, failures)
    return 0


def _described(state: SleepState, changed: Any) -> str:
    if state.sleeping:
        text = f"asleep (level {state.level}; freed: {', '.join(sorted(state.asleep))})"
    elif state.weights_lost:
        text = "awake, without weights (a level-2 sleep): serves after a refit"
    else:
        text = "awake, serving"
    return text + ("" if changed else " (unchanged)")
