"""AsyncLoads, the worker's bookkeeping of async loads, against a fake clock and a stand-in for
the orchestrator's reservation queries (the connector tests run it on the real one): each
request is reported once, only after both its staging is over and its announcement, in either
order; a short or overdue staging stops naming its request once announced; bad announcements
are refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtier_rs._core import InvalidArgumentError, KvTierError
from kvtier_rs.integrations.trtllm import async_loads
from kvtier_rs.integrations.trtllm.async_loads import AsyncLoads


@pytest.fixture
def clock(monkeypatch):
    now = SimpleNamespace(t=100.0)
    monkeypatch.setattr(async_loads.time, "monotonic", lambda: now.t)
    return now


class Reservations:
    """What AsyncLoads asks the orchestrator: `held[reservation]` is None while its reads are
    in flight, then the blocks held; a reservation missing from it was given back."""

    def __init__(self) -> None:
        self.held: dict[tuple, int | None] = {}

    def is_reserved(self, reservation) -> bool:
        return reservation in self.held

    def staged(self, reservation) -> int | None:
        return self.held[reservation]


def spec(request_id: int, blocks: int = 3):
    return SimpleNamespace(
        request_id=request_id, keys=[b"k%d" % i for i in range(blocks)], reservation=("trtllm", request_id, 0)
    )


def staged(loads: AsyncLoads, orch: Reservations, request_id: int):
    s = spec(request_id)
    orch.held[s.reservation] = None
    loads.stage(s)
    return s


def test_reported_once_after_staging_and_announcement_in_either_order(clock):
    loads, orch = AsyncLoads(timeout_s=5.0), Reservations()
    one, two = staged(loads, orch, 1), staged(loads, orch, 2)
    loads.announce([1])
    assert loads.report(orch) == [], "announced, reads in flight"
    orch.held[two.reservation] = 3
    assert loads.report(orch) == [], "staged, not announced"
    orch.held[one.reservation] = 3
    assert loads.report(orch) == [1]
    loads.announce([2])
    assert loads.report(orch) == [2]
    assert loads.report(orch) == []


def test_a_short_staging_stops_only_once_announced(clock):
    loads, orch = AsyncLoads(timeout_s=5.0), Reservations()
    s = staged(loads, orch, 1)
    orch.held[s.reservation] = 1
    assert loads.report(orch) == [], "not announced yet: another step's business"
    loads.announce([1])
    with pytest.raises(KvTierError, match=r"async load of request 1: 2 of 3 blocks could not be staged"):
        loads.report(orch)


def test_a_reservation_given_back_is_reported_with_nothing_to_load(clock):
    # The scheduler releases the reservation when the parked request finishes (a cancel).
    loads, orch = AsyncLoads(timeout_s=5.0), Reservations()
    s = staged(loads, orch, 4)
    loads.announce([4])
    del orch.held[s.reservation]
    assert loads.report(orch) == [4]


def test_a_staging_in_flight_past_the_timeout_stops_naming_the_request(clock):
    loads, orch = AsyncLoads(timeout_s=5.0), Reservations()
    staged(loads, orch, 7)
    loads.announce([7])
    clock.t += 5.0
    assert loads.report(orch) == [], "at the limit, not past it"
    clock.t += 0.001
    with pytest.raises(KvTierError, match=r"async load of request 7: not in place after 5.0 s"):
        loads.report(orch)


@pytest.mark.parametrize("started", [[9], [1, 1]], ids=["never staged", "twice in one call"])
def test_bad_announcements_are_refused_by_name(clock, started):
    loads, orch = AsyncLoads(timeout_s=5.0), Reservations()
    staged(loads, orch, 1)
    with pytest.raises(InvalidArgumentError, match=r"started_loading_req_ids") as e:
        loads.announce(started)
    assert e.value.arg == "started_loading_req_ids"


def test_an_announcement_is_refused_once_reported_or_announced(clock):
    loads, orch = AsyncLoads(timeout_s=5.0), Reservations()
    s = staged(loads, orch, 1)
    loads.announce([1])
    with pytest.raises(InvalidArgumentError, match=r"\[1\]"):
        loads.announce([1])
    orch.held[s.reservation] = 3
    assert loads.report(orch) == [1]
    with pytest.raises(InvalidArgumentError, match=r"\[1\]"):
        loads.announce([1])
    loads.announce([])  # nothing to announce is fine


def test_a_request_staged_again_starts_over(clock):
    # Asked again (a reset): its earlier staging's outcome must not be reported for the new one.
    loads, orch = AsyncLoads(timeout_s=5.0), Reservations()
    s = staged(loads, orch, 1)
    orch.held[s.reservation] = 1
    loads.report(orch)  # short, not announced: kept
    staged(loads, orch, 1)
    loads.announce([1])
    assert loads.report(orch) == [], "the new staging's reads are in flight"
    orch.held[s.reservation] = 3
    assert loads.report(orch) == [1]
