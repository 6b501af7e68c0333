"""The SLO guard: the rollback rule operators otherwise apply by hand.

Per tier: "if the p99 promotion latency over the last `window_s` seconds exceeds `p99_ms`
(with at least `min_samples` samples), bypass the tier for `recover_s` seconds". While bypassed
the tier serves no promotions, so it produces no new latency samples; after `recover_s` it is
put back on probation with an empty window, and trips again if it is still slow. Every trip is
recorded with its time and the p99 that caused it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvtier_rs._core import InvalidArgumentError


@dataclass(frozen=True)
class GuardRule:
    p99_ms: float
    window_s: float = 10.0
    recover_s: float = 30.0
    min_samples: int = 20

    def __post_init__(self) -> None:
        for name in ("p99_ms", "window_s", "recover_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgumentError(f"invalid argument `{name}`: must be positive, got {getattr(self, name)!r}")
        if self.min_samples < 1:
            raise InvalidArgumentError(f"invalid argument `min_samples`: must be >= 1, got {self.min_samples!r}")


class SloGuard:
    def __init__(self, tier: str, rule: GuardRule, clock: Callable[[], float] = time.monotonic) -> None:
        self.tier = tier
        self.rule = rule
        self._clock = clock
        self._samples: deque[tuple[float, float]] = deque()
        self.bypassed_until: float | None = None
        self.trips: list[dict[str, float]] = []

    def _expire(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self.rule.window_s:
            self._samples.popleft()

    def current_p99_ms(self) -> float:
        self._expire(self._clock())
        if not self._samples:
            return 0.0
        return float(np.percentile([s for _, s in self._samples], 99)) * 1e3

    def record(self, latency_s: float) -> None:
        now = self._clock()
        self._samples.append((now, latency_s))
        self._expire(now)
        if self.bypassed_until is not None or len(self._samples) < self.rule.min_samples:
            return
        p99 = self.current_p99_ms()
        if p99 > self.rule.p99_ms:
            self.bypassed_until = now + self.rule.recover_s
            self.trips.append({"at": now, "p99_ms": p99})
            self._samples.clear()

    def allows(self) -> bool:
        """Whether promotions may use the tier now."""
        if self.bypassed_until is None:
            return True
        if self._clock() >= self.bypassed_until:
            self.bypassed_until = None  # probation: serve again, measure afresh
            return True
        return False

    def state(self) -> dict[str, object]:
        bypassed = not self.allows()
        return {
            "tier": self.tier,
            "state": "bypassed" if bypassed else "active",
            "trips": len(self.trips),
            "p99_ms": self.current_p99_ms(),
            "threshold_ms": self.rule.p99_ms,
            "bypassed_for_s": max(0.0, (self.bypassed_until or 0.0) - self._clock()) if bypassed else 0.0,
        }
