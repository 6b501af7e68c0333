"""AsyncLoads, the worker's bookkeeping of async loads, against a fake clock: each request is
reported once, only after both its landing and its announcement, in either order; a short or
overdue load stops naming its request once announced; bad announcements are refused."""

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


def spec(request_id: int, blocks: int = 3):
    return SimpleNamespace(request_id=request_id, keys=[b"k%d" % i for i in range(blocks)])


def result(orch_id: str, loaded: int):
    return SimpleNamespace(request_id=orch_id, loaded=loaded)


def test_reported_once_after_landing_and_announcement_in_either_order(clock):
    loads = AsyncLoads(timeout_s=5.0)
    loads.bind("o1", spec(1))
    loads.bind("o2", spec(2))
    loads.announce([1])
    assert loads.report() == [], "announced, not landed"
    assert loads.take(result("o2", 3)).request_id == 2
    assert loads.report() == [], "landed, not announced"
    assert loads.take(result("o1", 3)).request_id == 1
    assert loads.report() == [1]
    loads.announce([2])
    assert loads.report() == [2]
    assert loads.report() == []


def test_a_result_of_another_load_is_not_taken(clock):
    loads = AsyncLoads(timeout_s=5.0)
    loads.bind("o1", spec(1))
    assert loads.take(result("sync", 3)) is None
    assert loads.take(result("o1", 3)) is not None
    assert loads.take(result("o1", 3)) is None, "taken once"


def test_a_short_load_stops_only_once_announced(clock):
    loads = AsyncLoads(timeout_s=5.0)
    loads.bind("o1", spec(1))
    loads.take(result("o1", 1))
    assert loads.report() == [], "not announced yet: another step's business"
    loads.announce([1])
    with pytest.raises(KvTierError, match=r"async load of request 1: 2 of 3 blocks failed to load"):
        loads.report()


def test_a_load_in_flight_past_the_timeout_stops_naming_the_request(clock):
    loads = AsyncLoads(timeout_s=5.0)
    loads.bind("o7", spec(7))
    loads.announce([7])
    clock.t += 5.0
    assert loads.report() == [], "at the limit, not past it"
    clock.t += 0.001
    with pytest.raises(KvTierError, match=r"async load of request 7: not in place after 5.0 s"):
        loads.report()


@pytest.mark.parametrize(
    "started",
    [[9], [1, 1]],
    ids=["never bound", "twice in one call"],
)
def test_bad_announcements_are_refused_by_name(clock, started):
    loads = AsyncLoads(timeout_s=5.0)
    loads.bind("o1", spec(1))
    with pytest.raises(InvalidArgumentError, match=r"started_loading_req_ids") as e:
        loads.announce(started)
    assert e.value.arg == "started_loading_req_ids"


def test_an_announcement_is_refused_once_reported_or_announced(clock):
    loads = AsyncLoads(timeout_s=5.0)
    loads.bind("o1", spec(1))
    loads.announce([1])
    with pytest.raises(InvalidArgumentError, match=r"\[1\]"):
        loads.announce([1])
    loads.take(result("o1", 3))
    assert loads.report() == [1]
    with pytest.raises(InvalidArgumentError, match=r"\[1\]"):
        loads.announce([1])
    loads.announce([])  # nothing to announce is fine
