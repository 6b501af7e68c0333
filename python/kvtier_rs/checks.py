"""Checks of single values that several modules share, so that each kind of value is refused
(or accepted) the same way everywhere:

- `integer`: an id, offset or byte count, with operator.index semantics;
- `check_count` / `check_number`: a setting (a window, a threshold, a rate) refused at
  construction with `InvalidArgumentError` naming it;
- `usable_sample`: a measurement (seconds, bytes) that is a number but not finite and
  non-negative (NaN, inf, negative: a clock step or an engine's bug) is dropped and counted by
  the object that got it, never raised: those calls run on the engine thread, and one NaN folded
  into a sum, a window or a moving average stays there for the life of the process. A
  measurement that is not a number at all is the caller's bug and is refused;
- `show`: a bounded repr of a bad value for an error message;
- `invalid_argument`: the `InvalidArgumentError` for one bad argument, as the core raises it.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, SupportsIndex, cast

from kvtier_rs._core import InvalidArgumentError


def invalid_argument(arg: str, reason: str, *, message: str | None = None) -> InvalidArgumentError:
    """An InvalidArgumentError naming one argument, as the core raises it: the message
    "invalid argument `<arg>`: <reason>" (or `message`, for a layer that words it its own way)
    and the `.arg` and `.reason` attributes, so that a caller never takes the message apart."""
    e = InvalidArgumentError(f"invalid argument `{arg}`: {reason}" if message is None else message)
    e.arg, e.reason = arg, reason
    return e


def integer(value: object, name: str, what: str = "must be an integer") -> int:
    """`value` as a Python int, with operator.index semantics (ints, numpy/torch integer
    scalars), never a float, which int() would silently truncate (ids, offsets and byte counts
    feed address arithmetic), nor a bool, an int only by accident."""
    try:
        # Anything may come in: operator.index itself refuses what is not an integer (TypeError).
        out = None if isinstance(value, bool) else operator.index(cast(SupportsIndex, value))
    except TypeError:
        out = None
    if out is None:
        raise invalid_argument(name, f"{what}, got {type(value).__name__} {show(value)}")
    return out


def check_count(name: str, value: object, *, minimum: int = 1) -> int:
    """A setting that must be an int of at least `minimum`, by default a positive one (bools
    and integral floats such as 2.0 refused: a float here is almost always a unit mix-up)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise invalid_argument(name, f"must be {what}, got {show(value)}")
    return int(value)


def check_number(name: str, value: object, *, zero_ok: bool = False, inf_ok: bool = False) -> float:
    """A setting that must be a positive (or, with `zero_ok`, non-negative) real number, finite
    unless `inf_ok`. NaN is always refused: every comparison with it is False, so it would
    silently disable whatever rule it sets."""
    x = _as_float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan
    if math.isnan(x) or not (x >= 0 if zero_ok else x > 0) or (math.isinf(x) and not inf_ok):
        what = ("non-negative" if zero_ok else "positive") + (" number" if inf_ok else " finite number")
        raise invalid_argument(name, f"must be a {what}, got {show(value)}")
    return x


def usable_sample(value: object, name: str) -> bool:
    """Whether a measurement (seconds, bytes) is finite and non-negative. False for NaN, inf or
    a negative number (the caller drops and counts it); InvalidArgumentError naming `name` for
    something that is not a real number. Cheap: it runs once per completed job."""
    if type(value) is float:
        return 0.0 <= value < math.inf  # False for NaN too
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise invalid_argument(name, f"expected a number, got {show(value)}")
    return 0.0 <= _as_float(value) < math.inf


def _as_float(value: numbers.Real) -> float:
    try:
        return float(value)
    except OverflowError:  # an int or Fraction beyond a float's range
        return -math.inf if value < 0 else math.inf


def show(value: Any) -> str:
    """``repr`` for an error message: bounded (a 400-digit int is not echoed, and one of over
    4300 digits, which ``repr`` refuses, does not raise)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of about {int(abs(value).bit_length() * math.log10(2)) + 1} digits"
    try:
        r = repr(value)
    except Exception:  # noqa: BLE001 - a value whose repr fails is still reported
        return f"a {type(value).__name__}"
    return r if len(r) <= 100 else r[:97] + "..."
