"""The disk tier behind the CPU tier, staged through host slots: write-through of blocks that
became ready in the CPU tier, and promotion of disk blocks into CPU slots.

Engine-agnostic and non-blocking: every call submits I/O and returns; `poll` collects what
finished. Both directions keep host slots safe while the disk touches them:
- a write-through pins the block's CPU slot until the disk has read it (a pinned block is never
  evicted, so its slot cannot be reused under the write);
- a promotion reserves CPU slots in the "writing" state (unreadable, unevictable) until the read
  is verified; a failed or corrupt read drops the slot, so the block is a miss, never wrong data.
A slow disk cannot pin CPU slots without bound: write-throughs beyond `max_write_backlog` blocks
in flight are dropped and counted.

With `seals` (the seal table of a host region shared with the engine's workers), a slot is
written to disk only while it is sealed for the block being written, and a promoted slot is
sealed once its read verified: bytes no worker stored for that block are never persisted.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtier_rs import defaults as D
from kvtier_rs._core import (
    BlockIndex,
    ClosedError,
    DiskIoError,
    HostPool,
    IndexFailedError,
    InvalidArgumentError,
    KvTierError,
    NoSpaceError,
    NotReadyError,
)
from kvtier_rs.orchestrator.completions import handle_each
from kvtier_rs.orchestrator.disk_contract import StagingDisk
from kvtier_rs.orchestrator.latency import LatencyRecorder
from kvtier_rs.tiers.events import EventStream
from kvtier_rs.tiers.keys import Key, key_list
from kvtier_rs.tiers.shared_region import SlotSeals, seals_of

_log = logging.getLogger(__name__)
_PAGE = 4096  # the disk tier's I/O unit (and the size of a slot's header page)


@dataclass
class PromotionDone:
    job_id: int
    keys: list[Key]  # requested, in chain order
    ok_prefix: int  # leading keys now ready in the CPU tier
    seconds: float
    bytes: int


@dataclass
class StagerCounters:
    writes_submitted: int = 0
    writes_completed: int = 0
    writes_failed: int = 0
    writes_refused: int = 0  # disk admission, disk full, or no disk slot free or evictable
    writes_no_space: int = 0  # of those, refused for no disk slot free or evictable
    writes_dropped_backlog: int = 0
    writes_dropped_evicted: int = 0
    writes_dropped_index_failed: int = 0  # the disk tier's index disabled itself (internal error)
    writes_not_started: int = 0  # the disk tier was closed, or refused the submission (I/O error)
    writes_dropped_unsealed: int = 0  # the host slot was not sealed for the block (see `seals`)
    promotions_submitted: int = 0
    promotion_blocks_ok: int = 0
    promotion_blocks_failed: int = 0  # checksum/key mismatch, short read, I/O error
    promotions_no_cpu_space: int = 0
    promotions_not_started: int = 0  # the disk tier refused the read (closed, failed)
    write_latency: LatencyRecorder = field(default_factory=LatencyRecorder)
    read_latency: LatencyRecorder = field(default_factory=LatencyRecorder)


class StagingHost(Protocol):
    """The CPU tier as the stager uses it: a ``HostTier``, or an index and pool owned by an
    engine's own manager (vLLM's)."""

    @property
    def index(self) -> BlockIndex: ...
    @property
    def pool(self) -> HostPool: ...
    @property
    def block_bytes(self) -> int: ...


class DiskStager:
    def __init__(
        self,
        host: StagingHost,
        disk: StagingDisk,
        *,
        max_write_backlog: int = D.DISK_MAX_WRITE_BACKLOG,
        events: EventStream | None = None,
        seals: SlotSeals | None = None,
        tier: str = "disk",
    ) -> None:
        """`disk`: the staged tier (the disk tier, or the remote tier, which keeps the same
        contract); `tier` names it in the events."""
        if disk.block_bytes < host.block_bytes:
            raise InvalidArgumentError(
                f"{tier}: its blocks ({disk.block_bytes} B) are smaller than the host tier's ({host.block_bytes} B)"
            )
        # The disk tier moves whole 4 KiB pages between a host slot and the disk: a block takes
        # its payload rounded up to 4 KiB (its slot stride less the header page) of a host slot.
        # Checked here, or every write-through would raise from poll(). (Host pools are always
        # page-aligned with 4 KiB-multiple slots, which the disk tier also needs.)
        pool, need = host.pool, disk.slot_stride - _PAGE
        if pool.slot_bytes < need:
            raise InvalidArgumentError(
                f"{tier}: its blocks need host slots of {need} B (block_bytes={disk.block_bytes} rounded up to "
                f"4 KiB); the host pool's slots are {pool.slot_bytes} B"
            )
        self.host = host
        self.disk = disk
        self.tier = tier
        self.max_write_backlog = max_write_backlog
        self.counters = StagerCounters()
        self.events = events
        self.seals = seals
        self._writes: dict[int, list[Key]] = {}
        self._reads: dict[int, tuple[list[Key], list[int]]] = {}
        # Promotions handled by a poll that then raised (an internal error in another job's
        # handling): returned by the next poll, never lost.
        self._carried: list[PromotionDone] = []
        self._write_backlog = 0

    @property
    def write_backlog(self) -> int:
        return self._write_backlog

    @property
    def reads_in_flight(self) -> int:
        return len(self._reads)

    def write_through(self, keys: Sequence[Key], *, priority: int = 35, duration_s: float | None = None) -> int:
        """Offer ready CPU blocks to the disk tier. Returns how many were submitted."""
        # Each key once: pin_for_load pins a repeated key once per listing, but the disk writes
        # it once and poll() unpins it once, which would leave a pin on it for good.
        keys = list(dict.fromkeys(key_list(keys)))
        if not keys:
            return 0
        if self._write_backlog + len(keys) > self.max_write_backlog:
            self.counters.writes_dropped_backlog += len(keys)
            return 0
        try:
            slots = self.host.index.pin_for_load(keys)
        except (NotReadyError, IndexFailedError):
            # Evicted from the CPU tier before we got to it (or its index failed): nothing to
            # copy from.
            self.counters.writes_dropped_evicted += len(keys)
            return 0
        if self.seals is not None:
            keys, slots = self._sealed_only(keys, list(slots))
            if not keys:
                return 0
        try:
            ticket = self.disk.submit_write(keys, self.host.pool, slots, priority=priority, duration_s=duration_s)
        except IndexFailedError:
            # The disk tier stores nothing any more (its lookups miss): the CPU tier serves on.
            self.host.index.unpin(keys)
            self.counters.writes_dropped_index_failed += len(keys)
            return 0
        except NoSpaceError:
            # More blocks than the disk tier has slots free or evictable (all being written, or
            # a batch larger than the tier): a write-through is best effort, so it is refused
            # like one to a full disk, never raised into the engine's completion path.
            self.host.index.unpin(keys)
            self.counters.writes_refused += len(keys)
            self.counters.writes_no_space += len(keys)
            return 0
        except (ClosedError, DiskIoError):
            # Closed, or an I/O error submitting: the write-through is best effort, and the
            # completion path that calls it must go on (other completions wait behind it).
            self.host.index.unpin(keys)
            self.counters.writes_not_started += len(keys)
            return 0
        except Exception:
            self.host.index.unpin(keys)
            raise
        written = list(ticket.keys)
        not_written = [k for k in keys if k not in set(written)]
        if not_written:
            self.host.index.unpin(not_written)
        self.counters.writes_refused += len(ticket.refused)
        if self.events is not None:
            self.events.publish("removed", self.tier, ticket.evicted, reason="evicted")
        if written:
            self._writes[ticket.job_id] = written
            self._write_backlog += len(written)
            self.counters.writes_submitted += len(written)
        else:
            # Nothing to write (all refused or present): the tier finished the job at once.
            # Taken here, since no poll would come for it while nothing else is tracked, and
            # a full disk would pile up one finished job per offload.
            self.disk.try_take(ticket.job_id)
        return len(written)

    def _sealed_only(self, keys: list[Key], slots: list[int]) -> tuple[list[Key], list[int]]:
        """The pinned blocks whose slots are sealed for them; the others are unpinned and
        counted. A slot that is not means that the bytes in this process's view of it were not
        stored for that block: writing them would persist another block's KV, or zeros."""
        assert self.seals is not None
        ok = self.seals.matches(slots, seals_of(keys))
        if ok.all():
            return keys, slots
        bad = [k for k, good in zip(keys, ok, strict=True) if not good]
        self.host.index.unpin(bad)
        self.counters.writes_dropped_unsealed += len(bad)
        if self.counters.writes_dropped_unsealed == len(bad):
            _log.error(
                "kvtier: %d block(s) not written to disk: their host slots are not sealed for them (the "
                "workers' host memory is not this process's?); counted in writes_dropped_unsealed",
                len(bad),
            )
        keep = [i for i, good in enumerate(ok) if good]
        return [keys[i] for i in keep], [slots[i] for i in keep]

    def promote(self, keys: Sequence[Key]) -> int | None:
        """Start reading `keys` (a chain held by the disk tier) into new CPU slots. Returns the
        read job id, or None when the CPU tier has no room (the caller recomputes)."""
        keys = key_list(keys)
        try:
            # A disk hit on its way to the device: the disk tier's rule admitted it, and the CPU
            # tier's (a priority threshold, K uses counted since a restart) must not turn the
            # hit into a miss.
            out = self.host.index.prepare_store(keys, admitted=True)
        except (NoSpaceError, IndexFailedError):
            self.counters.promotions_no_cpu_space += 1
            return None
        if self.events is not None:
            self.events.publish("removed", "cpu", out.evicted, reason="evicted")
        if list(out.keys) != keys:
            # Some keys are already in the CPU tier or refused by its admission: this chain is
            # not a clean disk-only run. Give the reserved slots back and let the caller re-plan.
            self.host.index.complete_store(out.keys, False)
            return None
        if self.seals is not None:
            self.seals.clear(out.slots)  # sealed again once the read has verified
        try:
            job = self.disk.submit_read(keys, self.host.pool, out.slots)
        except KvTierError:
            # The disk tier is closed or failed: give the reserved slots back; the caller
            # recomputes, as for any other promotion that cannot start.
            self.host.index.complete_store(out.keys, False)
            self.counters.promotions_not_started += 1
            return None
        self._reads[job] = (keys, list(out.slots))
        self.counters.promotions_submitted += 1
        return job

    def poll(self) -> list[PromotionDone]:
        """Collect finished disk jobs: unpin written blocks, publish or drop promoted ones.
        Every finished job is handled even if one of them raises (an internal error): the
        error is raised once the batch is done, and its promotions come with the next call."""
        done, self._carried = self._carried, []
        if not (self._writes or self._reads):
            return done
        error = handle_each(self.disk.poll(), lambda r: self._finish(r, done))
        if error is not None:
            self._carried = done
            raise error
        return done

    def _finish(self, r: Any, done: list[PromotionDone]) -> None:
        """One finished disk job; a promotion is appended to `done`."""
        if r.kind == "write":
            keys = self._writes.pop(r.job_id, None)
            if keys is None:
                return
            self._write_backlog -= len(keys)
            self.host.index.unpin(keys)
            self.counters.writes_completed += len(r.ok_keys)
            self.counters.writes_failed += len(r.failed_keys)
            self.counters.write_latency.observe(r.seconds)
            if self.events is not None:
                self.events.publish("stored", self.tier, r.ok_keys)
            return
        read = self._reads.pop(r.job_id, None)
        if read is None:
            return
        keys, slots = read
        # Whatever happens below, the promotion is reported (a load waits on it); if the CPU
        # index's bookkeeping raised midway, as one that made nothing readable.
        usable = 0
        try:
            usable = self._publish_read(r, keys, slots)
        finally:
            done.append(PromotionDone(r.job_id, keys, usable, r.seconds, r.bytes))

    def _publish_read(self, r: Any, keys: list[Key], slots: list[int]) -> int:
        """Make a promotion's verified prefix readable in the CPU tier and drop the rest; returns
        the prefix."""
        ok = set(r.ok_keys)
        prefix = 0
        while prefix < len(keys) and keys[prefix] in ok:
            prefix += 1
        # Only the verified prefix becomes readable; everything after the first bad block is
        # dropped too (a chain with a hole cannot be used past the hole).
        if prefix:
            if self.seals is not None:
                # A disk block is a whole row (every rank's part), verified against its checksum.
                self.seals.seal(slots[:prefix], seals_of(keys[:prefix]))
            self.host.index.complete_store(keys[:prefix], True)
            if self.host.index.failure is not None:
                prefix = 0  # the CPU index failed meanwhile: nothing became readable
        if prefix < len(keys):
            self.host.index.complete_store(keys[prefix:], False)
        self.counters.promotion_blocks_ok += prefix
        self.counters.promotion_blocks_failed += len(r.failed_keys)
        self.counters.read_latency.observe(r.seconds)
        if self.events is not None:
            self.events.publish("stored", "cpu", keys[:prefix])
            if r.failed_keys:
                # A read that did not verify (checksum, short read, I/O error) makes the disk
                # drop the block. Keys are pinned on disk from submission, so one the disk no
                # longer holds was dropped by this read, not evicted.
                try:
                    held = self.disk.contains(list(r.failed_keys))
                except KvTierError:
                    held = [False] * len(r.failed_keys)  # closed, or its index failed: holds nothing
                gone = [k for k, h in zip(r.failed_keys, held, strict=True) if not h]
                self.events.publish("removed", self.tier, gone, reason="failed_read")
        return prefix

    def drain(self, timeout: float | None = None) -> list[PromotionDone]:
        self.disk.wait_idle(timeout)
        return self.poll()
