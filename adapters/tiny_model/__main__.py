"""``python -m rollout_fleet.adapters.tiny_model DIR [--seed N]``: write a tiny model folder."""

from __future__ import annotations

import argparse
import os

from rollout_fleet.adapters.tiny_model.build import build_tiny_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollout_fleet.adapters.tiny_model",
                                     description=__doc__)
    parser.add_argument("directory", help="folder to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(build_tiny_model(args.directory, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
