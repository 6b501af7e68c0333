"""Latency bookkeeping shared by the orchestrator, the SLO guard and the metrics exporter:
recent samples for percentiles plus cumulative histogram buckets for Prometheus.

Bad settings and bad measurements are treated as `kvtier_rs.checks` describes.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque

import numpy as np

from kvtier_rs.checks import check_count, usable_sample

# Seconds: from 50 us (a few small blocks from DRAM) to 10 s (a cold disk under load).
BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


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
