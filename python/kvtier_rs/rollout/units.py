"""Durations as the rollback rule takes them (``500ms``, ``1.5s``), and their display."""

from __future__ import annotations

import math
import re

from kvtier_rs.rollout.errors import RolloutError

_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(us|µs|ms|s|sec|m|min)\s*$", re.IGNORECASE)
_SCALE = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0}


def parse_duration(text: str, arg: str) -> float:
    """Seconds in `text` (a number with a unit: us, ms, s, m). A bare number is refused: a budget
    of "500" could be milliseconds or seconds, and guessing wrong keeps or rolls back a tier for
    the wrong reason."""
    m = _DURATION.match(str(text))
    if not m:
        raise RolloutError(f"{arg}: cannot read {text!r} as a duration; expected e.g. 500ms, 1.5s or 250us")
    value = float(m.group(1)) * _SCALE[m.group(2).lower()]
    if not (value > 0 and math.isfinite(value)):
        raise RolloutError(f"{arg}: a budget must be a positive duration, got {text!r}")
    return value


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"
