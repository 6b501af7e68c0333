"""The worker's async loads (``async_loads: "staged"``): a request answered ``load_kv_async``
waits outside the batch while the reads of its reservation (disk, remote) fill CPU slots; it is
reported from ``get_finished`` once they are in, and its blocks are copied to the device in the
step it comes back in, synchronously, like a CPU hit. Nothing is copied to the device while it
is parked: TensorRT-LLM frees a parked request's blocks at once when it fails or cancels it,
without telling the connector, and a copy in flight then would land in another request's blocks.

A staging's life: ``stage`` (in ``start_load_kv`` of the step that parked the request) ->
``announce`` (``started_loading_req_ids`` of that step's ``get_finished``) -> ``report`` (each
``get_finished``: reads over and announced).

The implementation is responsible for:
- reporting each request once, only after both its staging is over and its announcement
  (TensorRT-LLM raises ``KeyError`` on an id it did not announce);
- refusing an announced id with no staging waiting to be reported, named;
- stopping with an error that names the request when its staging fell short or is still in
  flight after ``timeout_s``: reporting it would run the request on missing KV, and
  withholding it would park the request for good.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from kvtier_rs._core import KvTierError
from kvtier_rs.checks import invalid_argument

#: Why a promised load can come back short, for the errors that name the request.
SHORT_LOAD_CAUSES = (
    "a disk or remote block that failed its check, a remote block evicted since the probe, a failed read "
    "or a copy error"
)


class AsyncLoads:
    """Bookkeeping of the stagings between the step that parks a request and its report."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        # request id -> (LoadSpec, monotonic time it was staged), reads still in flight
        self._staging: dict[int, tuple[Any, float]] = {}
        self._landed: set[int] = set()  # request ids whose blocks are all held in CPU slots
        self._short: dict[int, str] = {}  # request id -> why its staging fell short
        self._announced: set[int] = set()  # passed in started_loading_req_ids, not yet reported

    def stage(self, spec: Any) -> None:
        """`spec` (an asynchronous LoadSpec) names a reservation whose reads are filling CPU
        slots; the worker binds nothing for it."""
        self._landed.discard(spec.request_id)  # a request asked again starts over
        self._short.pop(spec.request_id, None)
        self._staging[spec.request_id] = (spec, time.monotonic())

    def announce(self, started: list[int]) -> None:
        """TensorRT-LLM names each request it parked for an async load once, in the
        get_finished call of the step that parked it; that step's start_load_kv staged it."""
        if not started:
            return
        waiting = set(self._staging) | self._landed | set(self._short)
        counts = Counter(started)
        unknown = [rid for rid in counts if rid not in waiting or rid in self._announced or counts[rid] > 1]
        if unknown:
            raise invalid_argument(
                "started_loading_req_ids",
                f"{unknown[:5]}: no async load of kvtier's is waiting to be reported for these requests "
                "(announced twice, or their load never reached start_load_kv)",
            )
        self._announced.update(started)

    def report(self, orchestrator: Any) -> list[int]:
        """Announced requests whose staging is over, each reported once (sorted). Raises
        KvTierError naming the first announced request whose staging fell short or is still in
        flight after `timeout_s` (TensorRT-LLM has no way to fail one loading request; the
        exception ends its executor loop). `orchestrator` must have been polled just before."""
        self._check(orchestrator)
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

    def _check(self, orchestrator: Any) -> None:
        """Sort the stagings whose reads are over into landed and short; time out the rest."""
        now = time.monotonic()
        for rid, (spec, since) in list(self._staging.items()):
            if not orchestrator.is_reserved(spec.reservation):
                # The scheduler gave the reservation back: the request finished while parked
                # (a cancel). Nothing is left to load; an engine that waits for the report
                # before it frees the blocks gets it.
                held = len(spec.keys)
            else:
                held = orchestrator.staged(spec.reservation)
            if held is None:
                if now - since > self.timeout_s:
                    del self._staging[rid]
                    self._short[rid] = f"not in place after {self.timeout_s} s (load_timeout_s)"
                continue
            del self._staging[rid]
            if held == len(spec.keys):
                self._landed.add(rid)
            else:
                self._short[rid] = (
                    f"{len(spec.keys) - held} of {len(spec.keys)} blocks could not be staged ({SHORT_LOAD_CAUSES})"
                )
