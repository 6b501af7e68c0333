"""The orchestrator's parts on their own, without a host tier, an engine or a disk: the planner
over fake tiers, and the stall detector over hand-made loads on a fake clock. Every time is set
by the test, so nothing here depends on how fast this machine is."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import kvtier_rs as kv
from kvtier_rs._core import ClosedError
from kvtier_rs.orchestrator import GuardRule
from kvtier_rs.orchestrator.counters import DataPathCounters
from kvtier_rs.orchestrator.gate import LoadGate
from kvtier_rs.orchestrator.loads import InFlight, LoadJob, LoadResult, OrphanRead
from kvtier_rs.orchestrator.plans import LoadPlan, LoadPlanner
from kvtier_rs.orchestrator.stalls import StallDetector


class FakeTier:
    """A tier holding the blocks of `held`; `closed` makes lookups raise like a closed disk."""

    def __init__(self, held: set[bytes], closed: bool = False) -> None:
        self.held = held
        self.closed = closed
        self.asked: list[list[bytes]] = []

    def lookup_prefix(self, keys):
        if self.closed:
            raise ClosedError("closed")
        self.asked.append(list(keys))
        n = 0
        while n < len(keys) and keys[n] in self.held:
            n += 1
        return n


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


KEYS = [b"g0", b"c0", b"c1", b"d0", b"d1", b"m0"]


def planner(*, disk=True, in_flight=0, max_in_flight=None, closed=False):
    cpu = FakeTier({b"c0", b"c1"})
    stagers = {"disk": SimpleNamespace(disk=FakeTier({b"d0", b"d1"}, closed=closed))} if disk else {}
    gate = LoadGate(max_in_flight=max_in_flight)
    counts = DataPathCounters()
    return LoadPlanner(cpu, stagers, gate, lambda tier: in_flight, counts), cpu, counts


# ---- the planner -------------------------------------------------------------------------------
def test_planner_splits_a_chain_by_tier_after_the_gpu_hits():
    p, cpu, counts = planner()
    plan = p.plan(KEYS, gpu_hit_blocks=1)
    assert plan == LoadPlan(6, 1, 2, 2, 2, 2, {})
    assert (plan.misses, plan.loaded) == (1, 4)
    assert cpu.asked == [KEYS[1:]], "the CPU tier is asked only past the GPU hits"
    assert p.stagers["disk"].disk.asked == [KEYS[3:]], "the disk only past the CPU hits"
    assert (counts.lookups, counts.cpu.hit_blocks, counts.disk.hit_blocks, counts.miss_blocks) == (1, 2, 2, 1)
    assert (counts.gpu.lookup_blocks, counts.cpu.lookup_blocks, counts.disk.lookup_blocks) == (6, 5, 3)


def test_planner_refusal_of_the_cpu_part_cuts_the_disk_part_for_the_same_reason():
    p, _, counts = planner(in_flight=64, max_in_flight={"cpu": 64})
    plan = p.plan(KEYS, 1)
    assert (plan.cpu_hits, plan.disk_hits, plan.loaded) == (2, 2, 0)
    assert plan.refused == {"cpu": {"backpressure": 2}, "disk": {"backpressure": 2}}
    assert counts.cpu.refused["backpressure"] == 2 and counts.disk.refused["backpressure"] == 2


def test_planner_without_a_disk_or_with_a_closed_one_finds_no_disk_hits():
    p, _, counts = planner(disk=False)
    assert p.plan(KEYS, 1).disk_hits == 0
    assert counts.disk.lookup_blocks == 0, "no disk tier: nothing was asked of one"
    p, _, counts = planner(closed=True)
    assert p.plan(KEYS, 1).disk_hits == 0
    assert counts.disk.lookup_blocks == 3, "a closed disk tier is still a tier that missed"


def test_planner_counts_only_when_asked_and_checks_a_given_plan():
    p, _, counts = planner()
    made, to_count = p.plan_for(KEYS, 1, None)
    assert to_count and counts.lookups == 0, "a plan made for a load is counted by the load"
    p.count(made)
    assert counts.lookups == 1
    assert p.plan_for(KEYS, 1, made) == (made, False)
    with pytest.raises(kv.InvalidArgumentError, match="made for 6 keys with 1 GPU hits"):
        p.plan_for(KEYS, 2, made)
    with pytest.raises(kv.InvalidArgumentError, match="expected a LoadPlan"):
        p.plan_for(KEYS, 1, {"total": 6})
    with pytest.raises(kv.InvalidArgumentError, match="gpu_hit_blocks"):
        p.plan(KEYS, 7)
    assert counts.lookups == 1


# ---- the stall detector ------------------------------------------------------------------------
PLAN = LoadPlan(2, 0, 1, 1, 1, 1, {})


def load(request_id, *, reserved_at, bound_at=None, cpu_job=False, disk_read=False):
    """A load as the loads part leaves it: reserved at `reserved_at`, bound at `bound_at`, with
    a CPU copy job and a disk read in flight as asked."""
    ld = LoadJob(LoadResult(request_id, PLAN), [b"a", b"b"], reserved_at)
    if cpu_job:
        ld.cpu.keys, ld.cpu.jobs = [b"a"], {7: 0}
    if disk_read:
        part = ld.staged["disk"]
        part.copies.keys, part.read, part.read_started = [b"b"], 8, reserved_at
    if bound_at is not None:
        ld.gpu_ids, ld.bound_at = [0, 1], bound_at
    return ld


def detector(clock, *, guards, max_in_flight=None, timeout_s=10.0):
    in_flight = InFlight()
    gate = LoadGate(guards=guards, max_in_flight=max_in_flight, clock=clock)
    given_up: list[LoadJob] = []

    def give_up(ld: LoadJob, tier: str) -> None:
        assert tier == "disk"
        given_up.append(ld)

    stalls = StallDetector(in_flight, gate, give_up=give_up, disk_read_timeout_s=timeout_s, clock=clock)
    return stalls, in_flight, gate, given_up


def test_a_bound_load_past_the_threshold_is_one_guard_sample():
    clock = FakeClock()
    stalls, in_flight, gate, _ = detector(clock, guards={"cpu": GuardRule(p99_ms=50, min_samples=100)})
    ld = in_flight.loads["r"] = load("r", reserved_at=clock.t, bound_at=clock.t, cpu_job=True)
    clock.t += 0.04
    stalls.check()
    assert gate.guards["cpu"].state()["samples"] == 0 and not ld.cpu.stall_recorded, "within the threshold"
    clock.t += 0.02
    stalls.check()
    stalls.check()
    assert gate.guards["cpu"].state()["samples"] == 1, "one sample per stalled promotion, however long it stalls"
    assert ld.cpu.stall_recorded, "its completion is then no new sample"


def test_an_unbound_load_is_no_sample_but_counts_towards_a_hung_tier():
    clock = FakeClock()
    stalls, in_flight, gate, _ = detector(
        clock, guards={"disk": GuardRule(p99_ms=50, min_samples=100)}, max_in_flight={"disk": 2}
    )
    in_flight.loads["r"] = load("r", reserved_at=clock.t, disk_read=True)  # nobody waits on it
    clock.t += 1.0
    stalls.check()
    guard = gate.guards["disk"]
    assert (guard.state()["samples"], guard.trip_count) == (0, 0), "one promotion in flight, the cap is two"
    in_flight.orphan_reads[("disk", (b"x",))] = OrphanRead(job=9, started=clock.t - 2.0)
    stalls.check()
    assert guard.trip_count == 1 and not guard.allows(), "the cap is full and all of it has stalled"
    assert guard.trips[-1]["p99_ms"] == pytest.approx(2000.0), "tripped with the longest wait"


def test_a_hung_tier_needs_every_promotion_in_flight_stalled():
    clock = FakeClock()
    stalls, in_flight, gate, _ = detector(
        clock, guards={"disk": GuardRule(p99_ms=50, min_samples=100)}, max_in_flight={"disk": 2}
    )
    in_flight.orphan_reads[("disk", (b"x",))] = OrphanRead(job=9, started=clock.t - 2.0)
    in_flight.orphan_reads[("disk", (b"y",))] = OrphanRead(job=10, started=clock.t - 0.01)
    stalls.check()
    assert gate.guards["disk"].trip_count == 0, "one of the two is still within the threshold"
    clock.t += 0.1
    stalls.check()
    assert gate.guards["disk"].trip_count == 1


def test_a_bound_loads_overdue_disk_read_is_given_up_and_an_unbound_ones_is_not():
    clock = FakeClock()
    stalls, in_flight, _, given_up = detector(clock, guards={}, timeout_s=5.0)
    bound = in_flight.loads["b"] = load("b", reserved_at=clock.t, bound_at=clock.t + 1.0, disk_read=True)
    in_flight.loads["u"] = load("u", reserved_at=clock.t, disk_read=True)
    clock.t += 5.5  # 5.5 s since reserve, 4.5 s since bind
    stalls.check()
    assert given_up == [], "the timeout runs from bind"
    clock.t += 1.0
    stalls.check()
    assert given_up == [bound], "the unbound one waits for its bind, or its release"
    stalls.disk_read_timeout_s = float("inf")
    clock.t += 1000.0
    stalls.check()
    assert given_up == [bound], "an infinite timeout never gives up"
