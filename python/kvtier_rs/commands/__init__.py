"""Subcommands of `kvtier`: each module here defines `register(subparsers)`, which adds its
parser and sets `func` (called with the parsed arguments, returns an exit status)."""

COMMANDS = ["plan", "trace", "status", "vllm_config"]
