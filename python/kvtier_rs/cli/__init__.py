"""The `kvtier` command. Each subcommand lives in its own module in this package and defines
`register(subparsers)`, which adds its parser and sets `func` (called with the parsed arguments,
returns an exit status); adding one is a new module plus one line in `COMMANDS`.

User errors (bad arguments, malformed traces) print one line and exit with status 2; they never
show a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ["plan", "trace", "status", "vllm_config", "rollout"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description="KV-cache tier manager: planner and tools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"kvtier_rs.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from kvtier_rs._core import KvTierError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KvTierError as e:  # the planner's PlanError too
        print(f"kvtier {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvtier: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
