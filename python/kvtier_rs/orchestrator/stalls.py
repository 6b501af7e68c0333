"""Stall and hang detection: promotions still in flight that the engine has waited on too long.

A tier whose loads hang produces no completions, so a guard fed only by completions would
never see it: back-pressure alone would stop new loads, with the guard reporting the tier
healthy. Once per poll, `StallDetector.check` ages every promotion in flight and

* gives each guard a slow sample for every bound promotion of its tier past the threshold, once
  (`Copies.stall_recorded`: its completion, if it ever comes, is then no new sample);
* trips a guard outright when its tier's promotions in flight have reached the back-pressure
  cap and have all stalled: the cap (16 from disk by default) can be below the samples a guard
  needs (20 by default), and a hung tier fills the cap and gets no more (`LoadGate.trip_if_hung`,
  the rule the vLLM disk layer's reads go through too);
* gives up a staged part (disk or remote) of a bound load whose read is still in flight
  `disk_read_timeout_s` after bind, so the engine recomputes those blocks instead of waiting
  for good.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvtier_rs.checks import check_number
from kvtier_rs.orchestrator.gate import TIERS, LoadGate
from kvtier_rs.orchestrator.loads import STAGED_TIERS, InFlight, LoadJob


def _perf_counter() -> float:
    # Looked up at each call, not bound once: loads are stamped with time.perf_counter (see
    # loads.LoadJob), and the ages here must be read off the same clock, even one a test put in.
    return time.perf_counter()


class StallDetector:
    """Ages the promotions of `in_flight` (see the module docstring).

    `gate` holds the guards, the back-pressure caps and the trip log; `give_up(load, tier)`
    drops a load's staged part (`loads.LoadJobs.give_up_read`); `clock` is the one the loads
    were stamped with.
    """

    def __init__(
        self,
        in_flight: InFlight,
        gate: LoadGate,
        *,
        give_up: Callable[[LoadJob, str], None],
        disk_read_timeout_s: float = 10.0,
        clock: Callable[[], float] = _perf_counter,
    ) -> None:
        self.in_flight = in_flight
        self.gate = gate
        self.give_up = give_up
        #: A bound load whose staged read is still in flight this long after bind gives up that
        #: part (recomputed; the read lands in the CPU tier, owned by no load).
        self.disk_read_timeout_s = check_number("disk_read_timeout_s", disk_read_timeout_s, inf_ok=True)
        self.clock = clock

    def check(self) -> None:
        """Sample stalled promotions, trip the guards of hung tiers, give up overdue reads."""
        now = self.clock()
        # Per tier: the promotions in flight, and the waits of those past the guard's threshold.
        tiers = (*TIERS, *STAGED_TIERS)
        in_flight: dict[str, int] = dict.fromkeys(tiers, 0)
        stalled: dict[str, list[float]] = {tier: [] for tier in tiers}
        # Orphans first: a read given up on below is counted as its load's, not twice.
        self._age_orphan_reads(now, in_flight, stalled)
        self._age_loads(now, in_flight, stalled)
        for tier in self.gate.guards:
            self.gate.trip_if_hung(tier, in_flight[tier], stalled[tier])
        self.gate.notice()  # log (and publish) a trip the samples above caused

    def _age_orphan_reads(self, now: float, in_flight: dict[str, int], stalled: dict[str, list[float]]) -> None:
        """Reads no load waits for any more are no samples (nobody waited on them), but they
        are promotions in flight: on a hung disk at a modest request rate, the reads given up
        on are what fill the cap (one load at a time never would)."""
        for orphan in list(self.in_flight.orphan_reads.values()):
            in_flight[orphan.tier] += 1
            guard = self.gate.guards.get(orphan.tier)
            if guard is not None and now - orphan.started > guard.threshold_s:
                stalled[orphan.tier].append(now - orphan.started)

    def _age_loads(self, now: float, in_flight: dict[str, int], stalled: dict[str, list[float]]) -> None:
        """Each load's busy parts, aged from bind (or from reserve, for one not bound yet: it
        counts towards a hung tier, but nobody waits on it, so it is no sample)."""
        for ld in list(self.in_flight.loads.values()):
            waited = now - (ld.bound_at if ld.bound else ld.started)
            parts = [("cpu", ld.cpu, bool(ld.cpu.jobs))]
            parts += [(t, p.copies, p.busy) for t, p in ld.staged.items()]
            for tier, part, busy in parts:
                if not busy:
                    continue
                in_flight[tier] += 1
                guard = self.gate.guards.get(tier)
                if guard is None or waited <= guard.threshold_s:
                    continue
                stalled[tier].append(waited)
                if ld.bound and not part.stall_recorded:
                    guard.record(waited)
                    part.stall_recorded = True
            for tier, staged in ld.staged.items():
                if ld.bound and staged.read is not None and waited > self.disk_read_timeout_s:
                    self.give_up(ld, tier)
