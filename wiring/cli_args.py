"""What several ``rollout-fleet`` commands share on their command lines."""

from __future__ import annotations

import argparse

# The fleet file's help where a command needs it: it reads the workers' controls from it.
FLEET_FILE_HELP = "the fleet file written by `serve` (control URLs and secret)"


def documented_command(commands: argparse._SubParsersAction, name: str, *, summary: str,
                       doc: str | None) -> argparse.ArgumentParser:
    """A command whose ``--help`` shows its module's docstring as written."""
    parser: argparse.ArgumentParser = commands.add_parser(
        name, help=summary, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser


def add_frontend_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="the frontend URL (default: the fleet file's)")


def add_required_fleet_file(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fleet-file", required=True, help=FLEET_FILE_HELP)
