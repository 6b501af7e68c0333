"""User-facing planner errors: the CLI prints them as one line, never as a traceback."""

from __future__ import annotations

from kvtier_rs._core import KvTierError


class PlanError(KvTierError):
    """A bad argument or input file; the message names the argument or file, line and field.
    A KvTierError like every kvtier error, so one `except KvTierError` catches the planner's too."""


class TraceError(PlanError):
    """A malformed trace record."""

    def __init__(self, path: str, where: str, field: str | None, reason: str) -> None:
        self.path, self.where, self.field, self.reason = path, where, field, reason
        loc = f"{path}:{where}" if where else path
        what = f"field {field!r}: " if field else ""
        super().__init__(f"{loc}: {what}{reason}")
