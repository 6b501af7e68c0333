"""User-facing planner errors: the CLI prints them as one line, never as a traceback."""

from __future__ import annotations


class PlanError(Exception):
    """A bad argument or input file; the message names the argument or file, line and field."""


class TraceError(PlanError):
    """A malformed trace record."""

    def __init__(self, path: str, where: str, field: str | None, reason: str) -> None:
        self.path, self.where, self.field, self.reason = path, where, field, reason
        loc = f"{path}:{where}" if where else path
        what = f"field {field!r}: " if field else ""
        super().__init__(f"{loc}: {what}{reason}")
