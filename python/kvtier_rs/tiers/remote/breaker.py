"""A circuit breaker for the shared store: after `failures` operations in a row fail (a timeout, a
node down, a refused write), the tier stops calling the store for a cool-down, then lets one probe
through. A probe that fails opens it again for twice as long (up to `max_cooldown_s`); one that
succeeds closes it. While open, lookups are misses and writes are dropped: the engine recomputes,
and nothing waits on a store that is not answering.

Thread-safe: the store's worker threads report outcomes while the scheduler asks `allows`.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable

from kvtier_rs.checks import check_count, check_number


class BreakerState(enum.IntEnum):
    """As exported in ``kvtier_remote_breaker_state``: 0 closed, 1 open, 2 probing."""

    CLOSED = 0
    OPEN = 1
    PROBING = 2


class CircuitBreaker:
    def __init__(
        self,
        *,
        failures: int = 5,
        cooldown_s: float = 1.0,
        max_cooldown_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failures = check_count("remote_breaker_failures", failures)
        self.cooldown_s = check_number("remote_breaker_cooldown_s", cooldown_s)
        self.max_cooldown_s = max(check_number("remote_breaker_max_cooldown_s", max_cooldown_s), self.cooldown_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._in_a_row = 0
        self._cooldown = self.cooldown_s
        self._until = 0.0
        #: How many times it opened.
        self.trips = 0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            if self._state is BreakerState.OPEN and self._clock() >= self._until:
                return BreakerState.PROBING  # the next `allows` lets a probe through
            return self._state

    def allows(self) -> bool:
        """Whether an operation may go to the store now. Past an open period, the first caller
        gets the probe; the others wait for its outcome (answered False)."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN and self._clock() >= self._until:
                self._state = BreakerState.PROBING
                return True
            return False

    def succeeded(self) -> None:
        with self._lock:
            self._in_a_row = 0
            if self._state is not BreakerState.CLOSED:
                self._state = BreakerState.CLOSED
                self._cooldown = self.cooldown_s

    def failed(self) -> None:
        with self._lock:
            self._in_a_row += 1
            if self._state is BreakerState.PROBING:
                self._cooldown = min(self._cooldown * 2, self.max_cooldown_s)
                self._open()
            elif self._state is BreakerState.CLOSED and self._in_a_row >= self.failures:
                self._open()

    def _open(self) -> None:
        self._state = BreakerState.OPEN
        self._until = self._clock() + self._cooldown
        self.trips += 1
