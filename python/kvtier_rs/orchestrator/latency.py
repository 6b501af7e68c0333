"""Latency bookkeeping shared by the orchestrator, the SLO guard and the metrics exporter:
recent samples for percentiles plus cumulative histogram buckets for Prometheus.

Also the number checks that the recorder, the guard and the cost model share, so that all three
treat a bad measurement and a bad setting alike:

- a *setting* (a window, a threshold, a rate) that is not a number of the right range is refused
  at construction with `InvalidArgumentError` naming it;
- a *measurement* (seconds, bytes) that is a number but not finite and non-negative (NaN, inf,
  negative: a clock step or an engine's bug) is dropped and counted by the object that got it,
  never raised: these calls run on the engine thread, and one NaN folded into a sum, a window
  or a moving average stays there for the life of the process. A measurement that is not a
  number at all is the caller's bug and is refused.
"""

from __future__ import annotations

import bisect
import math
import numbers
import threading
from collections import deque

import numpy as np

from kvtier_rs._core import InvalidArgumentError

# Seconds: from 50 us (a few small blocks from DRAM) to 10 s (a cold disk under load).
BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def check_count(name: str, value: object) -> int:
    """A setting that must be a positive int (bools and integral floats such as 2.0 refused:
    a float here is almost always a unit mix-up)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InvalidArgumentError(f"invalid argument `{name}`: must be a positive int, got {value!r}")
    return int(value)


def check_number(name: str, value: object, *, zero_ok: bool = False, inf_ok: bool = False) -> float:
    """A setting that must be a positive (or, with `zero_ok`, non-negative) real number, finite
    unless `inf_ok`. NaN is always refused: every comparison with it is False, so it would
    silently disable whatever rule it sets."""
    x = _as_float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan
    if math.isnan(x) or not (x >= 0 if zero_ok else x > 0) or (math.isinf(x) and not inf_ok):
        what = ("non-negative" if zero_ok else "positive") + (" number" if inf_ok else " finite number")
        raise InvalidArgumentError(f"invalid argument `{name}`: must be a {what}, got {value!r}")
    return x


def usable_sample(value: object, name: str) -> bool:
    """Whether a measurement (seconds, bytes) is finite and non-negative. False for NaN, inf or
    a negative number (the caller drops and counts it); InvalidArgumentError naming `name` for
    something that is not a real number. Cheap: it runs once per completed job."""
    if type(value) is float:
        return 0.0 <= value < math.inf  # False for NaN too
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"invalid argument `{name}`: expected a number, got {value!r}")
    return 0.0 <= _as_float(value) < math.inf


def _as_float(value: numbers.Real) -> float:
    try:
        return float(value)
    except OverflowError:  # an int or Fraction beyond a float's range
        return -math.inf if value < 0 else math.inf


class LatencyRecorder:
    """Seconds per operation: the last `window` samples (for percentiles) and cumulative
    Prometheus buckets with count and sum over the process's life. Thread-safe: the engine
    thread observes while scrapes read. A sample that is not finite and non-negative is dropped
    and counted in `dropped` (see the module docstring): a NaN would turn the histogram's `_sum`
    into NaN for good, and a negative one would lower a sum Prometheus treats as a counter."""

    def __init__(self, window: int = 4096) -> None:
        self._recent: deque[float] = deque(maxlen=check_count("window", window))
        self._buckets = [0] * (len(BUCKETS) + 1)  # last = +Inf
        self.count = 0
        self.sum = 0.0
        self.dropped = 0  # samples refused as NaN, inf or negative
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        ok = usable_sample(seconds, "seconds")
        with self._lock:
            if not ok:
                self.dropped += 1
                return
            self._recent.append(seconds)
            self.count += 1
            self.sum += seconds
            # The first bound >= seconds: Prometheus buckets count observations <= `le`.
            self._buckets[bisect.bisect_left(BUCKETS, seconds)] += 1

    def percentiles(self) -> dict[str, float]:
        """p50/p95/p99 over the recent window (0.0 when nothing was observed)."""
        with self._lock:
            data = np.fromiter(self._recent, dtype=float, count=len(self._recent))
        if data.size == 0:
            return {"p50": 0.0, "p95": 0.0, "p99": 0.0}
        p50, p95, p99 = np.percentile(data, [50, 95, 99])
        return {"p50": float(p50), "p95": float(p95), "p99": float(p99)}

    def histogram(self) -> tuple[list[tuple[float, int]], int, float]:
        """Cumulative (upper bound, count) pairs ending with +Inf, total count and sum."""
        with self._lock:
            acc, out = 0, []
            for bound, n in zip((*BUCKETS, float("inf")), self._buckets, strict=True):
                acc += n
                out.append((bound, acc))
            return out, self.count, self.sum
