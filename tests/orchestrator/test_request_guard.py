"""The request-level rollback rule (TTFT / ITL budgets): newest tier first, re-probed after a
cool-down that grows for a tier that keeps hurting; on a fake clock."""

from __future__ import annotations

import pytest

from kvtier_rs._core import InvalidArgumentError
from kvtier_rs.orchestrator.gate import LoadGate
from kvtier_rs.orchestrator.request_guard import RequestGuard, RequestRule


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(clock: Clock, *, tiers=("cpu", "disk"), **rule) -> tuple[RequestGuard, list[tuple[str, bool]]]:
    changes: list[tuple[str, bool]] = []
    kw = {"ttft_p99_ms": 100.0, "window_s": 10.0, "recover_s": 30.0, "min_samples": 5, **rule}
    g = RequestGuard(RequestRule(**kw), tiers, clock=clock, on_change=lambda t, out, why: changes.append((t, out)))
    return g, changes


def feed(g: RequestGuard, clock: Clock, seconds: float, n: int = 5, signal: str = "ttft") -> None:
    """`n` requests that arrive after now and take `seconds` each."""
    clock.t += seconds
    for _ in range(n):
        clock.t += 0.01
        g.record(signal, seconds)


def test_a_rule_needs_a_budget_and_sane_numbers():
    with pytest.raises(InvalidArgumentError, match="ttft_p99_ms, itl_p99_ms or both") as e:
        RequestRule()
    assert e.value.arg == "ttft_p99_ms"
    with pytest.raises(InvalidArgumentError) as e:
        RequestRule(itl_p99_ms=-1)
    assert e.value.arg == "itl_p99_ms"
    with pytest.raises(InvalidArgumentError) as e:
        RequestRule(ttft_p99_ms=10, min_samples=0)
    assert e.value.arg == "min_samples"
    with pytest.raises(InvalidArgumentError) as e:
        RequestGuard(RequestRule(ttft_p99_ms=10), ())
    assert e.value.arg == "tiers"


def test_fast_requests_never_trip():
    clock = Clock()
    g, changes = make(clock)
    feed(g, clock, 0.05, n=200)
    assert g.allows("cpu") and g.allows("disk") and changes == [] and g.trips == {"cpu": 0, "disk": 0}


def test_the_newest_tier_goes_first_then_the_one_before_it():
    clock = Clock()
    g, changes = make(clock)
    feed(g, clock, 0.5)
    assert (g.allows("disk"), g.allows("cpu")) == (False, True)
    assert changes == [("disk", True)]
    # Still over budget with the disk tier out: the CPU tier goes too.
    feed(g, clock, 0.5)
    assert (g.allows("disk"), g.allows("cpu")) == (False, False)
    assert changes == [("disk", True), ("cpu", True)]
    # Nothing left to bypass: more slow requests change nothing.
    feed(g, clock, 0.5)
    assert changes == [("disk", True), ("cpu", True)] and g.trips == {"cpu": 1, "disk": 1}
    st = g.state()
    assert st["disk"]["state"] == "bypassed" and st["cpu"]["state"] == "bypassed"
    assert 25.0 < st["disk"]["bypassed_for_s"] <= 30.0
    clock.t += 30.0
    assert g.allows("disk") and g.allows("cpu")
    assert sorted(changes[2:]) == [("cpu", False), ("disk", False)]


def test_requests_that_began_before_a_trip_are_not_samples_of_what_follows():
    clock = Clock()
    g, changes = make(clock)
    feed(g, clock, 0.5)
    assert changes == [("disk", True)]
    # Slow requests that arrived before the trip finish now: they say nothing of the CPU tier.
    for _ in range(10):
        clock.t += 0.01
        g.record("ttft", 0.5, started_s_ago=5.0)
    assert g.allows("cpu") and changes == [("disk", True)]


def test_a_tier_that_trips_again_soon_after_returning_stays_out_longer():
    clock = Clock()
    g, changes = make(clock, tiers=("disk",))
    feed(g, clock, 0.5)
    clock.t += 30.0
    assert g.allows("disk")  # back, on probation
    feed(g, clock, 0.5)  # trips again within recover_s of returning
    assert not g.allows("disk")
    clock.t += 30.0
    assert not g.allows("disk")  # twice the cool-down this time
    clock.t += 30.0
    assert g.allows("disk")
    feed(g, clock, 0.5)
    clock.t += 60.0
    assert not g.allows("disk")  # four times
    clock.t += 60.0
    assert g.allows("disk")
    # Serving a whole recover_s without a trip: the next cool-down is recover_s again.
    clock.t += 31.0
    feed(g, clock, 0.5)
    clock.t += 30.0
    assert g.allows("disk")
    assert g.trips == {"disk": 4} and [c for c in changes if c[1]] == [("disk", True)] * 4


def test_the_cool_down_stops_growing_at_its_cap():
    clock = Clock()
    g, _ = make(clock, tiers=("disk",), recover_s=1.0, window_s=100.0)
    for _ in range(10):
        feed(g, clock, 0.5)
        while not g.allows("disk"):
            clock.t += 0.5
    feed(g, clock, 0.5)
    assert 7.9 < g.state()["disk"]["bypassed_for_s"] <= RequestGuard.MAX_BACKOFF * 1.0


def test_an_itl_budget_alone_watches_itl_only():
    clock = Clock()
    g, changes = make(clock, ttft_p99_ms=None, itl_p99_ms=20.0)
    feed(g, clock, 5.0, signal="ttft")  # not watched
    assert changes == []
    feed(g, clock, 0.05, signal="itl")
    assert changes == [("disk", True)]
    with pytest.raises(InvalidArgumentError, match="ttft, itl"):
        g.record("tpot", 0.1)


def test_the_load_gate_refuses_a_tier_the_rule_bypasses_and_reports_it():
    clock = Clock()
    g, _ = make(clock)
    gate = LoadGate(tiers=("disk",), max_in_flight={"disk": 4}, request_guard=g, clock=clock)
    assert gate.refusal("disk", 1, 0) is None
    feed(g, clock, 0.5)
    assert gate.refusal("disk", 1, 0) == "guard"
    assert gate.changed
    st = gate.state()
    assert (st["disk"]["state"], st["disk"]["trips"], st["cpu"]["state"]) == ("bypassed", 1, "active")
    gate.changed = False
    clock.t += 30.0
    assert gate.refusal("disk", 1, 0) is None and gate.changed
    assert gate.state()["disk"]["state"] == "active"
    with pytest.raises(InvalidArgumentError) as e:
        LoadGate(request_guard=object())  # type: ignore[arg-type]
    assert e.value.arg == "request_guard"
