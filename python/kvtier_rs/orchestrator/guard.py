"""The SLO guard: the rollback rule operators otherwise apply by hand.

Per tier: "if the p99 promotion latency over the last `window_s` seconds exceeds `p99_ms`
(with at least `min_samples` samples, at least two of them over the threshold), bypass the tier
for `recover_s` seconds". Two, because with fewer than 100 samples a p99 is the window's maximum:
one slow promotion (a page-fault storm, a GC pause) would trip the guard on its own
(`min_samples=1` asks for exactly that, and gets it). While bypassed
the tier serves no promotions, so it produces no new latency samples; after `recover_s` it is
put back on probation with an empty window, and trips again if it is still slow: it needs
`min_samples` fresh samples first. Samples of promotions that were already in flight when it
tripped say nothing about the tier on probation, so they are ignored whenever they land (while
bypassed, or later). The most recent trips (`SloGuard.MAX_TRIPS`) are kept with their time (the
guard's monotonic clock, and Unix time for people reading `state()`) and the p99 that caused
them, and counted in total.

What a sample is, is the caller's (`TierOrchestrator`): every promotion the engine waited for,
successful or not (a failed one still cost its wait), and a promotion still in flight once it has
waited longer than the threshold (a hung disk must trip the guard, not hide from it; the load's
completion, if it ever comes, is then not recorded again). When every promotion the tier may
have in flight (its back-pressure cap) has stalled, the caller trips the guard outright
(`trip_hung`): the cap can be below `min_samples`, and a hung tier produces nothing more.

While the tier is bypassed the window is empty, so `state()["p99_ms"]` shows the p99 that tripped
the guard instead of a window's: a dashboard should not read "0 ms" off a tier switched off for
being slow.

A latency that is NaN, inf or negative (a clock or engine glitch) is dropped and counted
(`dropped_samples` in `state()`): one NaN in the window makes its p99 NaN, and a NaN is never
over the threshold, so the guard would go blind while the tier is slow.

Thread-safe: the engine thread records completions and asks `allows()` while a metrics scrape
reads `state()` on the HTTP thread. One lock guards the window, the bypass and the trips;
`record()` does constant work under it unless the window holds enough samples over the
threshold for its p99 to be over it too.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvtier_rs.checks import check_count, check_number, invalid_argument, show, usable_sample


@dataclass(frozen=True)
class GuardRule:
    p99_ms: float
    window_s: float = 10.0
    recover_s: float = 30.0
    min_samples: int = 20

    def __post_init__(self) -> None:
        # Frozen: normalise through object.__setattr__ so every later comparison is on floats.
        for name in ("p99_ms", "window_s", "recover_s"):
            object.__setattr__(self, name, check_number(name, getattr(self, name)))
        object.__setattr__(self, "min_samples", check_count("min_samples", self.min_samples))


def _p99_ms(latencies_s: list[float]) -> float:
    return float(np.percentile(latencies_s, 99)) * 1e3 if latencies_s else 0.0


class SloGuard:
    #: Trips kept (with time and p99) for `state()`; older ones are only counted.
    MAX_TRIPS = 100
    #: Samples over the threshold a window needs before it can trip (see the module doc), or
    #: `min_samples` if that is lower.
    MIN_SLOW = 2

    def __init__(
        self,
        tier: str,
        rule: GuardRule,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if not isinstance(rule, GuardRule):  # else the first record() or state() raises AttributeError
            raise invalid_argument("rule", f"expected a GuardRule, got {show(rule)}")
        self.tier = tier
        self.rule = rule
        self._clock = clock
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, float]] = deque()  # (recorded at, latency s)
        self._over = 0  # samples in the window over the threshold
        self._tripped_at = -float("inf")  # the last trip; loads started before it are stale
        self.bypassed_until: float | None = None
        #: The most recent trips, oldest first: {"at": clock time, "at_unix": Unix time,
        #: "p99_ms": p99 that tripped}.
        self.trips: deque[dict[str, float]] = deque(maxlen=self.MAX_TRIPS)
        self.trip_count = 0
        self.dropped_samples = 0

    # ---- under the lock ---------------------------------------------------------------------
    def _slow(self, latency_s: float) -> bool:
        return latency_s * 1e3 > self.rule.p99_ms

    @property
    def threshold_s(self) -> float:
        """The p99 threshold in seconds: a promotion in flight longer than this is slow."""
        return self.rule.p99_ms / 1e3

    def _expire(self, now: float) -> None:
        cutoff = now - self.rule.window_s
        while self._samples and self._samples[0][0] < cutoff:
            if self._slow(self._samples.popleft()[1]):
                self._over -= 1

    def _bypassed(self, now: float) -> bool:
        if self.bypassed_until is None:
            return False
        if now >= self.bypassed_until:
            self.bypassed_until = None  # probation: serve again, measure afresh (window empty)
            return False
        return True

    def _cannot_trip(self) -> bool:
        """True when the window certainly does not trip, without sorting it: fewer than
        MIN_SLOW slow samples, or a p99 certainly within the threshold. numpy's p99
        interpolates between the sorted samples at floor(h) and floor(h) + 1, with
        h = 0.99 (n - 1), so it is within the threshold when both are, i.e. when the `over`
        samples above it all sit past index 0.99 (n - 1) + 1: 100 * over <= n - 101."""
        return self._over < min(self.MIN_SLOW, self.rule.min_samples) or 100 * self._over <= len(self._samples) - 101

    # ---- engine thread ----------------------------------------------------------------------
    def record(self, latency_s: float, started_s_ago: float | None = None) -> None:
        """One promotion's latency, when it completes. `started_s_ago`: how long before now the
        promotion started; by default `latency_s` (it ended just now). A caller that notices a
        completion later than it happened gives it: the latency alone would make a promotion in
        flight at a trip, noticed after probation began, look as if it started after the trip.
        Never raises for a bad number (dropped and counted); a non-number is the caller's bug
        (InvalidArgumentError)."""
        ok = usable_sample(latency_s, "latency_s")
        ago = latency_s  # a bad age (NaN, negative) falls back to this: the latency is still good
        if started_s_ago is not None and usable_sample(started_s_ago, "started_s_ago") and ok:
            ago = max(started_s_ago, latency_s)
        with self._lock:
            if not ok:
                self.dropped_samples += 1
                return
            now = self._clock()
            if self._bypassed(now) or now - ago < self._tripped_at:
                return  # in flight when the guard tripped: not a sample of the tier on probation
            self._samples.append((now, latency_s))
            if self._slow(latency_s):
                self._over += 1
            self._expire(now)
            if len(self._samples) < self.rule.min_samples or self._cannot_trip():
                return
            p99 = _p99_ms([s for _, s in self._samples])
            if p99 > self.rule.p99_ms:
                self._trip(now, p99)

    def trip_hung(self, waited_s: float) -> None:
        """Trip now, whatever the window holds: the caller saw every promotion the tier may have
        in flight stalled past the threshold (the longest for `waited_s`), so it serves nothing
        and cannot produce the samples a trip would otherwise need. No-op while bypassed."""
        with self._lock:
            now = self._clock()
            if not self._bypassed(now):
                self._trip(now, waited_s * 1e3)

    def _trip(self, now: float, p99_ms: float) -> None:
        self.bypassed_until = now + self.rule.recover_s
        self._tripped_at = now
        self.trip_count += 1
        self.trips.append({"at": now, "at_unix": self._wall_clock(), "p99_ms": p99_ms})
        self._samples.clear()
        self._over = 0

    def allows(self) -> bool:
        """Whether promotions may use the tier now."""
        with self._lock:
            return not self._bypassed(self._clock())

    # ---- any thread -------------------------------------------------------------------------
    def _window(self) -> tuple[float, list[float]]:
        """(now, the window's latencies), lock held; the percentile is computed after release."""
        now = self._clock()
        self._expire(now)
        return now, [s for _, s in self._samples]

    def current_p99_ms(self) -> float:
        with self._lock:
            _, window = self._window()
        return _p99_ms(window)

    def state(self) -> dict[str, object]:
        with self._lock:
            now, window = self._window()
            bypassed = self._bypassed(now)
            # Bypassed: the window was emptied at the trip and no promotion runs to refill it,
            # so the last measurement is the one that tripped it.
            tripped_p99 = float(self.trips[-1]["p99_ms"]) if bypassed and self.trips else None
            st: dict[str, object] = {
                "tier": self.tier,
                "state": "bypassed" if bypassed else "active",
                "trips": self.trip_count,
                "p99_ms": 0.0,
                "threshold_ms": self.rule.p99_ms,
                "bypassed_for_s": 0.0 if self.bypassed_until is None else self.bypassed_until - now,
                "recent_trips": [dict(t) for t in self.trips],
                "dropped_samples": self.dropped_samples,
                "samples": len(window),  # in the window now (0 while bypassed)
            }
        st["p99_ms"] = tripped_p99 if tripped_p99 is not None else _p99_ms(window)
        return st
