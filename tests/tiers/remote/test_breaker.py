"""The remote tier's circuit breaker, on a fake clock: it opens after `failures` in a row, lets
exactly one probe through per cool-down, doubles the cool-down on a failed probe up to the
maximum, and closes (and forgets the doubling) on a success."""

from __future__ import annotations

import pytest

from kvtier_rs._core import InvalidArgumentError
from kvtier_rs.tiers.remote import BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breaker(clock: Clock, **kw: float) -> CircuitBreaker:
    kw = {"failures": 3, "cooldown_s": 1.0, "max_cooldown_s": 5.0} | kw
    return CircuitBreaker(clock=clock, **kw)  # type: ignore[arg-type]


def trip(b: CircuitBreaker) -> None:
    for _ in range(b.failures):
        assert b.allows()
        b.failed()


def test_it_opens_after_failures_in_a_row_and_refuses_while_open() -> None:
    clock = Clock()
    b = breaker(clock)
    b.failed()
    b.failed()
    assert b.state is BreakerState.CLOSED and b.allows()
    b.failed()
    assert b.state is BreakerState.OPEN and b.trips == 1
    clock.now += 0.999
    assert not b.allows()
    assert b.state is BreakerState.OPEN


def test_a_success_between_failures_resets_the_count() -> None:
    b = breaker(Clock())
    for _ in range(10):
        b.failed()
        b.failed()
        b.succeeded()
    assert b.state is BreakerState.CLOSED and b.trips == 0


def test_exactly_one_probe_is_let_through_after_the_cooldown() -> None:
    clock = Clock()
    b = breaker(clock)
    trip(b)
    clock.now += 1.0
    assert b.state is BreakerState.PROBING
    assert b.allows()  # the probe
    assert not b.allows()  # the others wait for its outcome
    assert not b.allows()
    assert b.state is BreakerState.PROBING


def test_a_failed_probe_doubles_the_cooldown_up_to_the_max() -> None:
    clock = Clock()
    b = breaker(clock, cooldown_s=1.0, max_cooldown_s=5.0)
    trip(b)
    waits = []
    for _ in range(5):
        # Find when the next probe is allowed, in 0.25 s steps of the fake clock.
        start = clock.now
        while not b.allows():
            clock.now += 0.25
        waits.append(clock.now - start)
        b.failed()
        assert b.state is BreakerState.OPEN
    assert waits == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert b.trips == 6


def test_a_successful_probe_closes_it_and_resets_the_cooldown() -> None:
    clock = Clock()
    b = breaker(clock)
    trip(b)
    clock.now += 1.0
    assert b.allows()
    b.failed()  # cool-down now 2 s
    clock.now += 2.0
    assert b.allows()
    b.succeeded()
    assert b.state is BreakerState.CLOSED
    assert all(b.allows() for _ in range(5))
    # Two failures are not enough again, and the next opening waits the base cool-down.
    b.failed()
    b.failed()
    assert b.state is BreakerState.CLOSED
    b.failed()
    assert b.state is BreakerState.OPEN
    clock.now += 1.0
    assert b.allows()


def test_failures_while_open_do_not_extend_the_open_period() -> None:
    clock = Clock()
    b = breaker(clock)
    trip(b)
    clock.now += 0.5
    b.failed()  # a late report from a job started before it opened
    clock.now += 0.5
    assert b.allows()
    assert b.trips == 1


def test_max_cooldown_below_cooldown_is_raised_to_it() -> None:
    b = CircuitBreaker(cooldown_s=3.0, max_cooldown_s=1.0)
    assert b.max_cooldown_s == 3.0


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        ({"failures": 0}, "remote_breaker_failures"),
        ({"failures": 2.0}, "remote_breaker_failures"),
        ({"failures": True}, "remote_breaker_failures"),
        ({"cooldown_s": 0.0}, "remote_breaker_cooldown_s"),
        ({"cooldown_s": -1.0}, "remote_breaker_cooldown_s"),
        ({"cooldown_s": float("nan")}, "remote_breaker_cooldown_s"),
        ({"max_cooldown_s": float("inf")}, "remote_breaker_max_cooldown_s"),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(kw: dict, name: str) -> None:
    with pytest.raises(InvalidArgumentError, match=name) as e:
        CircuitBreaker(**kw)
    assert e.value.arg == name
