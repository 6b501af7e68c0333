"""The disk tier behind kvtier's CPU tier, driven from vLLM's scheduler thread.

* Write-through: a chunk that becomes ready in the CPU tier is queued for a disk write from its
  host slot, which stays pinned (so neither evicted nor rewritten) until the write is done.
* Promotion: a CPU miss that the disk tier holds gets a CPU slot in the "writing" state and a
  disk read into it; vLLM sees HIT_PENDING and asks again on a later step, when the read has
  been verified (HIT) or has failed (the slot is dropped, the chunk is a MISS and is recomputed).

Nothing here blocks: the disk tier's I/O runs on its own threads (io_uring or a thread pool),
with the GIL released, and completions are collected by ``poll`` once per scheduler step.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from vllm.v1.kv_offload.base import LookupResult, Medium, OffloadingEvent

from kvtier_rs._core import BlockIndex, DiskTier, HostPool, NoSpaceError
from kvtier_rs.integrations.vllm import metrics as m
from kvtier_rs.integrations.vllm.options import KvtierOptions

_PENDING = LookupResult.HIT_PENDING
_MISS = LookupResult.MISS


class _Reserved:
    """Promoted chunks held (pinned) for the request whose lookup promoted them.

    Without this, a small CPU tier can evict a promoted chunk before its request is scheduled
    (other promotions of the same request need slots too), and the request would promote the
    same chunks again and again. The pin is dropped when the request loads the chunk (its own
    load pin takes over) or finishes.
    """

    __slots__ = ("keys", "finished", "generation")

    def __init__(self, generation: int) -> None:
        self.keys: set[bytes] = set()
        self.finished = False
        self.generation = generation


def tier_dir(root: str, config: Any, chunk_bytes: int) -> Path:
    """A directory per model and KV geometry, stable across restarts: an engine reopening the
    same root with the same model finds its blocks, and a different model never reads them."""
    ident = {
        "model": config.model.name,
        "dtype": str(config.model.dtype),
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "groups": [[g.tokens_per_block, list(g.layer_names)] for g in config.groups],
        "chunk_bytes": chunk_bytes,
        "layout": config.kv_cache_layout,
    }
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", str(config.model.name).strip("/"))[-64:]
    return Path(root) / f"{name}_{digest}"


class DiskLayer:
    def __init__(
        self,
        disk: DiskTier,
        host: HostPool,
        cpu_index: BlockIndex,
        options: KvtierOptions,
        tokens_per_chunk: int,
    ) -> None:
        self.disk = disk
        self.host = host
        self.cpu = cpu_index
        self.options = options
        self.tokens_per_chunk = tokens_per_chunk
        self._contains = disk.contains
        # job id -> keys whose CPU slots the job reads (writes) or fills (reads)
        self._writes: dict[int, list[bytes]] = {}
        self._reads: dict[int, tuple[list[bytes], _Reserved]] = {}
        # Chunks promoted from disk and not yet loaded; the manager reads and updates it.
        self.promoted: set[bytes] = set()
        self.counters: m.ManagerCounters = m.ManagerCounters()
        self._events: list[OffloadingEvent] = []
        self.events_enabled = False
        # Bumped by a cache reset, which drops every pin: older reservations are void.
        self.generation = 0  # set by the manager from the engine's kv_events_config
        self._last_stats: dict[str, int] = {}

    @classmethod
    def open(
        cls,
        options: KvtierOptions,
        config: Any,
        *,
        host: HostPool,
        cpu_index: BlockIndex,
        tokens_per_chunk: int,
    ) -> DiskLayer:
        path = tier_dir(options.disk_root, config, host.slot_bytes)
        path.mkdir(parents=True, exist_ok=True)
        disk = DiskTier(
            str(path),
            options.disk_bytes,
            host.slot_bytes,
            policy=options.disk_policy,
            admission=options.disk_admission,
            engine=options.disk_io_engine,
            queue_depth=options.disk_queue_depth,
        )
        return cls(disk, host, cpu_index, options, tokens_per_chunk)

    # ---- called by the manager ------------------------------------------------------------------

    def write_through(self, keys: list[bytes]) -> None:
        # Pin the CPU slots for the write's duration: a pinned chunk is never evicted, so its
        # slot cannot be handed to another chunk while the disk reads from it.
        slots = self.cpu.pin_for_load(keys)
        try:
            ticket = self.disk.submit_write(keys, self.host, slots)
        except Exception:
            self.cpu.unpin(keys)
            raise
        written = ticket.keys
        if len(written) != len(keys):
            ws = set(written)
            self.cpu.unpin([k for k in keys if k not in ws])
        if written:
            self._writes[ticket.job_id] = written
        if ticket.evicted and self.events_enabled:
            self._events.append(OffloadingEvent(keys=list(ticket.evicted), medium=Medium.STORAGE, removed=True))

    def lookup_and_promote(self, key: bytes, req_context: Any) -> LookupResult:
        if not self._contains([key])[0]:
            return _MISS
        if not self.options.cost_model.load_beats_recompute(self.tokens_per_chunk, self.host.slot_bytes):
            self.counters.disk_skipped_by_cost += 1
            return _MISS
        try:
            out = self.cpu.prepare_store([key])
        except NoSpaceError:
            # Every CPU slot is pinned or being written: recompute rather than wait.
            return _MISS
        if not out.keys:
            return _MISS  # refused by the CPU tier's admission rule
        if out.evicted:
            self.promoted.difference_update(out.evicted)
        job = self.disk.submit_read(out.keys, self.host, out.slots)
        res = req_context.get_state(_Reserved)
        if res is None or res.generation != self.generation:
            res = _Reserved(self.generation)
            req_context.set_state(res)
        self._reads[job] = (out.keys, res)
        self.counters.promotions += 1
        return _PENDING

    def poll(self) -> None:
        if not (self._writes or self._reads):
            return
        for r in self.disk.poll():
            if r.kind == "write":
                keys = self._writes.pop(r.job_id, None)
                if keys is not None:
                    self.cpu.unpin(keys)
                    if r.ok_keys and self.events_enabled:
                        self._events.append(OffloadingEvent(keys=list(r.ok_keys), medium=Medium.STORAGE, removed=False))
            else:
                entry = self._reads.pop(r.job_id, None)
                if entry is None:
                    continue
                res = entry[1]
                if r.ok_keys:
                    self.cpu.complete_store(r.ok_keys, True)
                    self.promoted.update(r.ok_keys)
                    if not res.finished:
                        self.cpu.pin_for_load(r.ok_keys)
                        res.keys.update(r.ok_keys)
                if r.failed_keys:
                    # Checksum mismatch, short read, I/O error: never serve it. Drop the CPU slot;
                    # the next lookup is a MISS and the engine recomputes the chunk.
                    self.cpu.complete_store(r.failed_keys, False)
                    self.counters.promotion_failures += len(r.failed_keys)

    def release(self, keys: list[bytes] | None, req_context: Any) -> None:
        """Drop the request's reservation pins: on ``keys`` (it loads them now) or on all of them
        (``None``: the request finished)."""
        res = req_context.get_state(_Reserved)
        if res is None or res.generation != self.generation:
            return  # none, or pins already dropped by a cache reset
        if keys is None:
            res.finished = True
            held = list(res.keys)
            res.keys.clear()
        else:
            held = [k for k in keys if k in res.keys]
            res.keys.difference_update(held)
        if held:
            self.cpu.unpin(held)

    def has_pending_work(self) -> bool:
        return bool(self._writes or self._reads)

    def drain(self) -> None:
        self.disk.wait_idle()
        self.poll()

    def reset(self) -> None:
        """After a cache reset: every job is drained and the CPU tier drops all pins."""
        self.drain()
        self.generation += 1

    def take_events(self) -> list[OffloadingEvent]:
        ev, self._events = self._events, []
        return ev

    def stats(self) -> dict[str, Any]:
        return dict(self.disk.stats())

    def emit_stats(self, stats: Any) -> None:
        now = {k: v for k, v in self.disk.stats().items() if isinstance(v, int)}
        m.emit_index_stats(stats, "disk", now, self._last_stats)
        self._last_stats = now

    def shutdown(self) -> None:
        self.drain()
        self.disk.close()
