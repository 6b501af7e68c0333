"""The load gate: whether a tier's hits are loaded now or recomputed.

One decision for every adapter, in this order:

1. the SLO guards: the tier's own (``guard.SloGuard``, on the wait for its promotions) and the
   request-level rule (``request_guard.RequestGuard``, on requests' TTFT and ITL, which
   bypasses the newest tier first): while either bypasses the tier, its hits are recomputed
   and nothing waits on it;
2. back-pressure: at most ``max_in_flight[tier]`` promotions from the tier in flight, so a burst
   of hits beyond that is recomputed, never queued without bound;
3. the cost rule (``cost.CostModel``): load only when loading is estimated faster than
   recomputing, with a periodic probe load that re-measures a tier the rule turned away.

What a "promotion in flight" is (a request's load, one chunk's read) is the caller's: it passes
its own count to ``refusal``. The gate also owns the guard side of stalled promotions
(``stalled``): a tier whose promotions hang produces no completions, so the caller reports the
ones in flight and the gate turns those past the guard's threshold into samples.

Preconditions: one thread calls ``refusal``, ``record`` and ``stalled`` (the engine's scheduler
thread); ``state`` may be read from any thread (a metrics scrape).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from kvtier_rs.checks import check_count, invalid_argument, show
from kvtier_rs.orchestrator.cost import CostModel
from kvtier_rs.orchestrator.guard import GuardRule, SloGuard
from kvtier_rs.orchestrator.request_guard import RequestGuard

#: The tiers a gate can watch, in promotion order (the newest tier last).
TIERS = ("cpu", "disk")
#: Why a hit is recomputed instead of loaded.
REFUSAL_REASONS = ("cost", "backpressure", "guard")
#: Promotions in flight per tier unless the caller says otherwise.
DEFAULT_MAX_IN_FLIGHT = {"cpu": 64, "disk": 16, "remote": 16}


def check_guards(guards: Any, tiers: tuple[str, ...] = TIERS) -> dict[str, GuardRule]:
    """A ``tier -> GuardRule`` dict, checked here, naming the tier: a rule of any other type (its
    fields as a dict, a number) would fail only later, on the engine thread."""
    if guards is None:
        return {}
    if not isinstance(guards, Mapping):
        raise invalid_argument("guards", f"expected a dict of tier -> GuardRule, got {show(guards)}")
    unknown = set(guards) - set(tiers)
    if unknown:
        raise invalid_argument("guards", f"unknown tiers {sorted(map(str, unknown))}; expected {', '.join(tiers)}")
    for tier, rule in guards.items():
        if not isinstance(rule, GuardRule):
            raise invalid_argument(f"guards[{tier!r}]", f"expected a GuardRule, got {show(rule)}")
    return dict(guards)


def check_in_flight_limits(limits: Any, tiers: tuple[str, ...] = TIERS) -> dict[str, int]:
    """The back-pressure limits per tier: the defaults, overridden by ``limits``."""
    out = {t: DEFAULT_MAX_IN_FLIGHT[t] for t in tiers}
    if limits is None:
        return out
    if not isinstance(limits, dict):
        raise invalid_argument("max_promotions_in_flight", f"expected a dict of tier -> count, got {show(limits)}")
    unknown = sorted(map(str, set(limits) - set(tiers)))
    if unknown:
        raise invalid_argument("max_promotions_in_flight", f"unknown tiers {unknown}; expected {', '.join(tiers)}")
    for tier, n in limits.items():
        out[tier] = check_count(f"max_promotions_in_flight['{tier}']", n)
    return out


class LoadGate:
    """The load-or-recompute decision of every tier (see the module docstring).

    The implementation is responsible for:
    * refusing a tier's hits while its guard bypasses it, while its promotions in flight are at
      the cap, or while the cost rule finds recomputing cheaper (then probing it now and then);
    * logging each guard trip and each return to service, once, on ``log``;
    * turning stalled promotions into guard samples, each promotion once, and tripping a guard
      outright when every promotion the cap allows has stalled (a hung tier).
    """

    def __init__(
        self,
        *,
        guards: Mapping[str, GuardRule] | None = None,
        max_in_flight: Mapping[str, int] | None = None,
        cost: CostModel | None = None,
        tiers: tuple[str, ...] = TIERS,
        log: logging.Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str, bool, str], None] | None = None,
        request_guard: RequestGuard | None = None,
    ) -> None:
        if cost is not None and not isinstance(cost, CostModel):
            raise invalid_argument("cost", f"expected a CostModel or None, got {show(cost)}")
        self.tiers = tiers
        self.guards = {t: SloGuard(t, r, clock=clock) for t, r in check_guards(guards, tiers).items()}
        self.max_in_flight = check_in_flight_limits(max_in_flight, tiers)
        self.cost = cost
        if request_guard is not None and not isinstance(request_guard, RequestGuard):
            raise invalid_argument("request_guard", f"expected a RequestGuard or None, got {show(request_guard)}")
        #: The request-level rule; it logs and reports its own bypasses (``on_change``).
        self.request_guard = request_guard
        self._log = log or logging.getLogger(__name__)
        #: Called as on_change(tier, bypassed, why) at each trip (True) and recovery (False).
        self._on_change = on_change
        # Trips already logged, per tier, and whether the tier was bypassed at the last look.
        self._seen_trips = dict.fromkeys(self.guards, 0)
        self._was_bypassed = dict.fromkeys(self.guards, False)
        # Stalled promotions already given to a guard, per tier (kept only while in flight).
        self._stall_recorded: dict[str, set[Hashable]] = {t: set() for t in self.guards}
        #: Set at each trip or recovery `notice` saw; a metrics reporter clears it once reported.
        self.changed = False

    def refusal(self, tier: str, n: int, in_flight: int) -> str | None:
        """Why `n` hits of `tier` are recomputed rather than loaded, or None to load them.
        `in_flight`: the caller's promotions from `tier` in flight now."""
        if n == 0:
            return None
        rg = self.request_guard
        if rg is not None:
            self.notice()
            if not rg.allows(tier):
                return "guard"
        guard = self.guards.get(tier)
        if guard is not None:
            self.notice()
            if not guard.allows():
                return "guard"
        if in_flight >= self.max_in_flight[tier]:
            return "backpressure"
        if self.cost is not None:
            if self.cost.worth_loading(tier, n):
                self.cost.admitted(tier)
            elif not self.cost.take_probe(tier):
                return "cost"
        return None

    def record(self, tier: str, waited_s: float, *, started_s_ago: float | None = None) -> None:
        """A finished promotion's wait, for the tier's guard (none: ignored)."""
        guard = self.guards.get(tier)
        if guard is not None:
            guard.record(waited_s, started_s_ago=started_s_ago)
            self.notice()

    def stalled(self, tier: str, ages: Mapping[Hashable, float]) -> None:
        """The promotions of `tier` in flight now, by id, with how long the engine has waited on
        each: every one past the guard's threshold is a slow sample (once), and when they fill
        the tier's cap and have all stalled, the guard trips outright."""
        guard = self.guards.get(tier)
        if guard is None:
            return
        recorded = self._stall_recorded[tier]
        recorded.intersection_update(ages)
        slow = {i: age for i, age in ages.items() if age > guard.threshold_s}
        for i, age in slow.items():
            if i not in recorded:
                recorded.add(i)
                guard.record(age)
        self.trip_if_hung(tier, len(ages), list(slow.values()))
        self.notice()

    def trip_if_hung(self, tier: str, in_flight: int, stalled_waits: Sequence[float]) -> None:
        """Trip `tier`'s guard outright when its `in_flight` promotions fill the back-pressure cap
        and every one has stalled (`stalled_waits`: their waits past the guard's threshold): the
        cap can be below the samples a guard needs, and a hung tier gets no more promotions."""
        guard = self.guards.get(tier)
        if guard is None or not stalled_waits:
            return
        if in_flight >= self.max_in_flight[tier] and len(stalled_waits) == in_flight:
            guard.trip_hung(max(stalled_waits))

    def forget_stall(self, tier: str, promotion: Hashable) -> bool:
        """Whether `promotion` was already given to the guard as stalled (then its completion
        is no new sample); forgets it either way."""
        recorded = self._stall_recorded.get(tier)
        if recorded is None or promotion not in recorded:
            return False
        recorded.discard(promotion)
        return True

    def notice(self) -> None:
        """Log guard trips and recoveries that happened since the last look (cheap: no
        percentile is computed here)."""
        rg = self.request_guard
        if rg is not None:
            for tier in rg.tiers:
                rg.allows(tier)  # a cool-down that ended returns its tier to service (logged)
            if rg.changed:
                rg.changed = False
                self.changed = True
        for tier, guard in self.guards.items():
            bypassed = not guard.allows()
            if guard.trip_count > self._seen_trips[tier]:
                self._seen_trips[tier] = guard.trip_count
                self.changed = True
                tripped_ms = guard.trips[-1]["p99_ms"] if guard.trips else float("nan")
                why = f"p99 promotion wait {tripped_ms:.1f} ms over the {guard.rule.p99_ms:.1f} ms budget"
                self._log.warning(
                    "kvtier: SLO guard tripped: the %s tier is bypassed for %.0f s (%s); its hits are "
                    "recomputed meanwhile",
                    tier,
                    guard.rule.recover_s,
                    why,
                )
                if self._on_change is not None:
                    self._on_change(tier, True, why)
            elif self._was_bypassed[tier] and not bypassed:
                self.changed = True
                self._log.warning("kvtier: SLO guard: the %s tier is back in service, on probation", tier)
                if self._on_change is not None:
                    self._on_change(tier, False, "cool-down over")
            self._was_bypassed[tier] = bypassed

    def state(self) -> dict[str, dict[str, object]]:
        """Each guarded tier's state, by tier: its own guard's (``SloGuard.state``), with the
        request-level rule folded in: bypassed while either bypasses it, trips of both
        counted. A tier only the request rule covers reports ``p99_ms`` 0 (no promotion wait
        is watched there)."""
        out = {t: g.state() for t, g in self.guards.items()}
        if self.request_guard is not None:
            self.notice()  # a return to service found by state() is reported like any other
            for tier, rs in self.request_guard.state().items():
                st = out.setdefault(tier, {"tier": tier, "state": "active", "trips": 0, "p99_ms": 0.0})
                if rs["state"] == "bypassed":
                    st["state"] = "bypassed"
                st["trips"] = int(st["trips"]) + int(rs["trips"])  # type: ignore[call-overload]
                st["request_rule"] = rs
        return out
