"""The request-level rollback rule: bypass the newest tier while requests miss their budget.

The per-tier guard (``guard.SloGuard``) watches how long requests waited on one tier's
promotions. This rule watches what users see, each request's time to first token (TTFT) and
inter-token latency (ITL), against the operator's budget, as the rollout practice states it:
"disable the newest tier when p99 TTFT or ITL exceeds the budget over a sustained window".

* A trip is the per-tier guard's rule applied to TTFT (or ITL) samples: at least
  ``min_samples`` in the last ``window_s`` seconds and their p99 over the budget. Requests that
  began before a trip are not samples of what follows it.
* A trip bypasses the newest tier still in service, in promotion order (CPU, then disk, then
  later tiers): its hits are recomputed and nothing waits on it. If requests still miss the
  budget, the next trip bypasses the tier before it, and so on.
* After its cool-down a bypassed tier is re-probed (served again). A tier that trips again
  within ``recover_s`` of coming back stays out twice as long as the time before, up to
  ``MAX_BACKOFF`` times ``recover_s``: a tier that keeps hurting does not flap in and out.
  Once it has served ``recover_s`` without a trip its cool-down is back to ``recover_s``.

What a sample is, is the engine adapter's: vLLM's ``KvtierConnector`` measures a request's TTFT
from its arrival to the step that sees its first token, and its mean ITL when it finishes.

Preconditions: one thread records samples and asks ``allows`` (the engine's scheduler thread);
``state`` may be read from any thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier_rs.checks import check_count, check_number, invalid_argument, show
from kvtier_rs.orchestrator.guard import GuardRule, SloGuard

#: Signals of the rule, as every adapter spells them.
SIGNALS = ("ttft", "itl")
#: How long a trip detector ignores samples after a trip (the guard's recover_s must be
#: positive); samples of requests that began before the trip are ignored anyway.
_PAUSE_S = 1e-3


@dataclass(frozen=True)
class RequestRule:
    """Budgets for the p99 of requests' TTFT and ITL (either may be None: not watched) over a
    sustained window; a trip bypasses the newest tier in service for ``recover_s``."""

    ttft_p99_ms: float | None = None
    itl_p99_ms: float | None = None
    window_s: float = GuardRule.window_s
    recover_s: float = GuardRule.recover_s
    min_samples: int = GuardRule.min_samples

    def __post_init__(self) -> None:
        if self.ttft_p99_ms is None and self.itl_p99_ms is None:
            raise invalid_argument("ttft_p99_ms", "a request rule needs ttft_p99_ms, itl_p99_ms or both")
        for name in ("ttft_p99_ms", "itl_p99_ms"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_number(name, getattr(self, name)))
        for name in ("window_s", "recover_s"):
            object.__setattr__(self, name, check_number(name, getattr(self, name)))
        object.__setattr__(self, "min_samples", check_count("min_samples", self.min_samples))

    def budget_ms(self, signal: str) -> float | None:
        return self.ttft_p99_ms if signal == "ttft" else self.itl_p99_ms


class RequestGuard:
    """The request-level rule over `tiers` (promotion order, newest last); see the module doc.

    The implementation is responsible for:
    * bypassing the newest tier in service at each trip, and the one before it at the next trip
      while that one is still out;
    * re-probing a tier after its cool-down, doubling the cool-down of a tier that trips again
      soon after coming back;
    * reporting each bypass and each return to service once, through ``on_change``.
    """

    #: The longest cool-down, in multiples of ``recover_s``.
    MAX_BACKOFF = 8

    def __init__(
        self,
        rule: RequestRule,
        tiers: tuple[str, ...],
        *,
        clock: Callable[[], float] = time.monotonic,
        log: logging.Logger | None = None,
        on_change: Callable[[str, bool, str], None] | None = None,
    ) -> None:
        if not isinstance(rule, RequestRule):
            raise invalid_argument("rule", f"expected a RequestRule, got {show(rule)}")
        if not tiers:
            raise invalid_argument("tiers", "a request rule needs at least one tier to bypass")
        self.rule = rule
        self.tiers = tiers
        self._clock = clock
        self._log = log or logging.getLogger(__name__)
        self._on_change = on_change
        # One trip detector per watched signal: the per-tier guard's window and p99 rule with
        # next to no bypass of its own (it only restarts its window at a trip); this class
        # decides what a trip bypasses.
        self._detectors = {
            s: SloGuard(
                s,
                GuardRule(p99_ms=budget, window_s=rule.window_s, recover_s=_PAUSE_S, min_samples=rule.min_samples),
                clock=clock,
            )
            for s in SIGNALS
            if (budget := rule.budget_ms(s)) is not None
        }
        self._lock = threading.Lock()
        self._out_until: dict[str, float] = {}  # tier -> end of its cool-down
        self._back_at: dict[str, float] = {}  # tier -> when it last came back
        self._cooldown_s = dict.fromkeys(tiers, rule.recover_s)
        self.trips = dict.fromkeys(tiers, 0)
        #: Set at each bypass or return; a metrics reporter clears it once reported.
        self.changed = False

    # ---- engine thread ----------------------------------------------------------------------
    def record(self, signal: str, seconds: float, *, started_s_ago: float | None = None) -> None:
        """One request's TTFT or ITL (``signal``), in seconds. `started_s_ago`: how long ago
        the request arrived (a TTFT sample's default is its own value)."""
        detector = self._detectors.get(signal)
        if detector is None:
            if signal not in SIGNALS:
                raise invalid_argument("signal", f"expected one of {', '.join(SIGNALS)}, got {show(signal)}")
            return  # not watched
        before = detector.trip_count
        detector.record(seconds, started_s_ago=started_s_ago)
        if detector.trip_count > before:
            p99_ms = detector.trips[-1]["p99_ms"]
            self._trip(f"p99 {signal.upper()} {p99_ms:.1f} ms over the {detector.rule.p99_ms:.1f} ms budget")

    def _trip(self, why: str) -> None:
        now = self._clock()
        with self._lock:
            self._restore_due(now)
            serving = [t for t in self.tiers if t not in self._out_until]
            if not serving:
                return  # every tier is out already: nothing left to bypass
            tier = serving[-1]
            back = self._back_at.get(tier)
            if back is not None and now - back < self.rule.recover_s:
                cap = self.MAX_BACKOFF * self.rule.recover_s
                self._cooldown_s[tier] = min(2 * self._cooldown_s[tier], cap)
            else:
                self._cooldown_s[tier] = self.rule.recover_s
            self._out_until[tier] = now + self._cooldown_s[tier]
            self.trips[tier] += 1
            self.changed = True
            cooldown = self._cooldown_s[tier]
        self._log.warning(
            "kvtier: request SLO rule tripped (%s): the %s tier is bypassed for %.0f s; its hits are recomputed",
            why,
            tier,
            cooldown,
        )
        if self._on_change is not None:
            self._on_change(tier, True, why)

    def _restore_due(self, now: float) -> list[str]:
        """Tiers whose cool-down is over, back in service (lock held)."""
        back = [t for t, until in self._out_until.items() if now >= until]
        for t in back:
            del self._out_until[t]
            self._back_at[t] = now
            self.changed = True
        return back

    def allows(self, tier: str) -> bool:
        """Whether promotions may use `tier` now (a tier the rule does not cover: always)."""
        if not self._out_until:
            return True
        with self._lock:
            back = self._restore_due(self._clock())
            out = tier in self._out_until
        for t in back:
            self._log.warning("kvtier: request SLO rule: the %s tier is back in service, on probation", t)
            if self._on_change is not None:
                self._on_change(t, False, "cool-down over")
        return not out

    # ---- any thread -------------------------------------------------------------------------
    def state(self) -> dict[str, dict[str, object]]:
        """Per tier: whether the rule bypasses it, for how much longer, and its trips; and the
        p99 of each watched signal over the window now."""
        with self._lock:
            now = self._clock()
            out = dict(self._out_until)
            trips = dict(self.trips)
        p99 = {s: d.current_p99_ms() for s, d in self._detectors.items()}
        return {
            t: {
                "tier": t,
                "state": "bypassed" if out.get(t, -1.0) > now else "active",
                "trips": trips[t],
                "bypassed_for_s": max(0.0, out.get(t, now) - now),
                **{f"{s}_p99_ms": v for s, v in p99.items()},
            }
            for t in self.tiers
        }
