"""User-facing rollout errors: the CLI prints them as one line naming the input, never a traceback."""

from __future__ import annotations

from kvtier_rs._core import KvTierError


class RolloutError(KvTierError):
    """A bad input (a budget, a trace, an endpoint, a model name, a step) or an engine that failed
    during a step. The message starts with the input it is about. A KvTierError, so the CLI's one
    `except KvTierError` prints it as one line."""
