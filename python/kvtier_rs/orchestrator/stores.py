"""The store path: device blocks copied into the CPU tier, then written through to the disk and
remote tiers.

`offload` reserves CPU slots for the new blocks of a chain and submits one device -> host copy
job; when the job lands (`on_transfer`), the blocks become readable and are handed to each
staged tier's stager for write-through (by that tier's admission rule). Blocks a tier holds
already are renewed instead: the latest claim's priority and duration win.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier_rs._core import BlockIndex, ClosedError, IndexFailedError, NoSpaceError
from kvtier_rs.orchestrator.counters import DataPathCounters
from kvtier_rs.orchestrator.disk_stager import DiskStager
from kvtier_rs.orchestrator.latency import LatencyRecorder
from kvtier_rs.tiers.events import EventStream
from kvtier_rs.tiers.keys import Key
from kvtier_rs.transfer import TransferEngine, TransferResult


@dataclass
class OffloadTicket:
    job_id: int | None
    stored: list[Key]
    skipped: list[Key]
    refused: list[Key]
    evicted: list[Key]
    no_space: bool = False


@dataclass
class _Store:
    """A device -> host copy job in flight: its blocks and the hint (priority, duration) their
    write-through carries to the disk tier."""

    keys: list[Key]
    hint: dict[str, Any]


class StoreJobs:
    """Runs the offloads (see the module docstring).

    Dependencies: `index` (the CPU tier's: reserves and completes the slots), `engine` (the
    device -> host copies), `stagers` (write-through and the staged copies' renewal, by tier;
    empty without a disk or remote tier), `counts` (the store counters), `latency` (of the copies that landed),
    `events` (blocks stored in and evicted from the CPU tier; None publishes nothing).
    """

    def __init__(
        self,
        *,
        index: BlockIndex,
        engine: TransferEngine,
        stagers: Mapping[str, DiskStager],
        counts: DataPathCounters,
        latency: LatencyRecorder,
        events: EventStream | None,
    ) -> None:
        self.index = index
        self.engine = engine
        self.stagers = dict(stagers)
        self.counts = counts
        self.latency = latency
        self.events = events
        self._jobs: dict[int, _Store] = {}

    @property
    def in_flight(self) -> int:
        """Copy jobs submitted and not seen landing yet."""
        return len(self._jobs)

    def offload(
        self,
        keys: list[Key],
        gpu_ids: list[int],
        *,
        priority: int = 35,
        duration_s: float | None = None,
        after_stream: object = None,
    ) -> OffloadTicket:
        """Store the new blocks of `keys` from `gpu_ids` (one per key, both checked by the
        caller): `TierOrchestrator.offload`."""
        where = dict(zip(keys, gpu_ids, strict=True))
        # The blocks the tiers hold already take this offload's hint; the store gives it to the
        # rest (and the write-through to their disk copies).
        self.renew(keys, priority=priority, duration_s=duration_s)
        try:
            out = self.index.prepare_store(keys, priority=priority, duration_s=duration_s)
        except NoSpaceError:
            # The blocks it would have added: a chain's blocks the tier already holds (ready or
            # being written) were not refused, and counting them overstated the refusals.
            self.counts.cpu_store_no_space_blocks += sum(1 for k in dict.fromkeys(keys) if self.index.state(k) is None)
            return OffloadTicket(None, [], [], [], [], no_space=True)
        except IndexFailedError:
            # The CPU index disabled itself (an internal error): it stores nothing any more and
            # its lookups miss, so the engine keeps serving by recomputing.
            self.counts.cpu_store_index_failed_blocks += len(keys)
            return OffloadTicket(None, [], [], [], [])
        ticket = OffloadTicket(None, list(out.keys), list(out.skipped), list(out.refused), list(out.evicted))
        self.counts.cpu_store_refused += len(out.refused)
        if self.events is not None:
            self.events.publish("removed", "cpu", out.evicted, reason="evicted")
        if not out.keys:
            return ticket
        try:
            job = self.engine.store([where[k] for k in out.keys], out.slots, after_stream=after_stream)
        except BaseException:
            # The engine refused the copy: give the reserved slots back, never leave them writing.
            self.index.complete_store(out.keys, False)
            raise
        self._jobs[job] = _Store(list(out.keys), {"priority": priority, "duration_s": duration_s})
        ticket.job_id = job
        return ticket

    def finished(self, job_id: int | None) -> bool:
        """Whether an offload's copy job is over (`TierOrchestrator.store_finished`)."""
        return job_id is None or job_id not in self._jobs

    def renew(self, keys: list[Key], *, priority: int = 35, duration_s: float | None = None) -> None:
        """Give the blocks of `keys` a tier holds this priority and duration (`TierOrchestrator.renew`)."""
        self.index.renew(keys, priority=priority, duration_s=duration_s)
        for stager in self.stagers.values():
            with contextlib.suppress(ClosedError):  # a closed tier holds nothing to renew
                stager.disk.renew(keys, priority=priority, duration_s=duration_s)

    def on_transfer(self, r: TransferResult) -> None:
        """A device -> host copy job landed (or failed): complete its slots, write through."""
        store = self._jobs.pop(r.job_id, None)
        if store is None:
            return
        keys = store.keys
        self.index.complete_store(keys, r.success)
        if not r.success:
            self.counts.cpu_store_failed_blocks += len(keys)
            return
        if self.index.failure is not None:
            # The index failed while the copy ran: the blocks never became readable.
            self.counts.cpu_store_index_failed_blocks += len(keys)
            return
        self.counts.cpu_stored_blocks += len(keys)
        if self.events is not None:
            self.events.publish("stored", "cpu", keys)
        self.counts.d2h_bytes += r.bytes
        self.latency.observe(r.seconds)
        for stager in self.stagers.values():
            stager.write_through(keys, **store.hint)
