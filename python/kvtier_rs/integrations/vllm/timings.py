"""Requests' time to first token and inter-token latency, as vLLM's scheduler sees them, for the
request SLO rule (``orchestrator.request_guard``).

A request's TTFT runs from its arrival (``Request.arrival_time``, the wall-clock time the API
server stamped on it) to the first scheduler step that finds an output token on it: the step
after the one that produced it, so a sample is late by at most one step's scheduling, never
early. Its ITL is the mean time between its first and last tokens, taken when it finishes.
Pure Python over vLLM's ``Request`` attributes (no vLLM import), so it is testable without an
engine.

Preconditions: called on the engine's scheduler thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvtier_rs.orchestrator.request_guard import RequestGuard


class RequestTimings:
    """Feeds ``guard`` with each request's TTFT once and, if it produced two tokens or more, its
    mean ITL once (see the module docstring)."""

    def __init__(
        self,
        guard: RequestGuard,
        *,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.guard = guard
        self._wall = wall_clock
        self._clock = clock
        self._waiting: dict[str, Any] = {}  # request id -> Request, until its first token
        self._first_token: dict[str, float] = {}  # request id -> monotonic time it was seen

    def arrived(self, request: Any) -> None:
        """A request the scheduler considers (any number of times until it runs)."""
        rid = request.request_id
        if rid not in self._first_token:
            self._waiting.setdefault(rid, request)

    def step(self) -> None:
        """A scheduler step: requests whose first token has appeared since the last one."""
        if not self._waiting:
            return
        wall, now = self._wall(), self._clock()
        done = [rid for rid, r in self._waiting.items() if r.num_output_tokens >= 1]
        for rid in done:
            ttft = wall - self._waiting.pop(rid).arrival_time
            self._first_token[rid] = now
            self.guard.record("ttft", ttft, started_s_ago=ttft)

    def finished(self, request: Any) -> None:
        rid = request.request_id
        n = request.num_output_tokens
        if self._waiting.pop(rid, None) is not None and n >= 1:
            # First token and finish in one step (a one-token answer): its TTFT ends now.
            ttft = self._wall() - request.arrival_time
            self.guard.record("ttft", ttft, started_s_ago=ttft)
        first = self._first_token.pop(rid, None)
        if first is None or n < 2:
            return
        itl = (self._clock() - first) / (n - 1)
        self.guard.record("itl", itl, started_s_ago=self._wall() - request.arrival_time)
