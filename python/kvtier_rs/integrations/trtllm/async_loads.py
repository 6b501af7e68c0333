"""The worker's async loads (``async_loads: "staged"``): their requests wait outside the batch,
so no layer waits for them; each is reported from ``get_finished`` once it has landed and
TensorRT-LLM has announced it.

A load's life: ``bind`` (in ``start_load_kv``) -> ``take`` its result (whenever the worker polls
the orchestrator) -> ``announce`` (``started_loading_req_ids`` of the step that parked it) ->
``report`` (``get_finished``), in any order between ``take`` and ``announce``.

The implementation is responsible for:
- reporting each request once, only after both its landing and its announcement (TensorRT-LLM
  raises ``KeyError`` on an id it did not announce);
- refusing an announced id with no load waiting to be reported, named;
- stopping with an error that names the request when a load fell short or is still in flight
  after ``timeout_s``: reporting it would run the request on missing KV, and withholding it would
  park the request for good.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from kvtier_rs._core import KvTierError
from kvtier_rs.checks import invalid_argument


class AsyncLoads:
    """Bookkeeping of the async loads between their bind and their report."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        # orchestrator request id -> (LoadSpec, monotonic bind time), still copying
        self._in_flight: dict[Any, tuple[Any, float]] = {}
        self._landed: set[int] = set()  # TensorRT-LLM request ids whose load is complete
        self._short: dict[int, str] = {}  # request id -> why its load fell short
        self._announced: set[int] = set()  # passed in started_loading_req_ids, not yet reported

    def bind(self, orchestrator_request_id: Any, spec: Any) -> None:
        """`spec`'s load was bound under `orchestrator_request_id` and is copying."""
        self._in_flight[orchestrator_request_id] = (spec, time.monotonic())

    def take(self, res: Any) -> Any | None:
        """Take the orchestrator's result `res` if it belongs to an async load: returns its
        LoadSpec (None: not one). A short one is kept for `report` to raise about, not raised
        here: this also runs inside other requests' layer waits, whose step it does not concern."""
        entry = self._in_flight.pop(res.request_id, None)
        if entry is None:
            return None
        spec = entry[0]
        if res.loaded != len(spec.keys):
            self._short[spec.request_id] = (
                f"{len(spec.keys) - res.loaded} of {len(spec.keys)} blocks failed to load (a disk or remote block "
                "that failed its check, a remote block evicted since the probe, a read given up, or a copy error)"
            )
        else:
            self._landed.add(spec.request_id)
        return spec

    def announce(self, started: list[int]) -> None:
        """TensorRT-LLM names each request it parked for an async load once, in the
        get_finished call of the step that parked it; that step's start_load_kv bound its load."""
        if not started:
            return
        waiting = {spec.request_id for spec, _ in self._in_flight.values()} | self._landed | set(self._short)
        counts = Counter(started)
        unknown = [rid for rid in counts if rid not in waiting or rid in self._announced or counts[rid] > 1]
        if unknown:
            raise invalid_argument(
                "started_loading_req_ids",
                f"{unknown[:5]}: no async load of kvtier's is waiting to be reported for these requests "
                "(announced twice, or their load never reached start_load_kv)",
            )
        self._announced.update(started)

    def report(self) -> list[int]:
        """Announced async loads that have landed, each reported once (sorted). Raises
        KvTierError naming the first announced request whose load fell short or is still in
        flight after `timeout_s` (TensorRT-LLM has no way to fail one loading request; the
        exception ends its executor loop)."""
        now = time.monotonic()
        for spec, bound_at in self._in_flight.values():
            if now - bound_at > self.timeout_s:
                self._short.setdefault(spec.request_id, f"not in place after {self.timeout_s} s (load_timeout_s)")
        short = sorted(rid for rid in self._short if rid in self._announced)
        if short:
            raise KvTierError(
                f"kvtier: async load of request {short[0]}: {self._short[short[0]]}; TensorRT-LLM cannot be "
                "told that a promised load fell short (set async_loads to off to fail only the step instead)"
            )
        done = sorted(self._landed & self._announced)
        self._landed.difference_update(done)
        self._announced.difference_update(done)
        return done
