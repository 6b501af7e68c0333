"""kvtier's vLLM OffloadingManager against vLLM 0.32's documented contract (no engine)."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from support.vllm import engine as E

E.require_vllm()

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # noqa: E402
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import LookupResult, Medium, ReqContext  # noqa: E402

from kvtier_rs import BlockIndex, InvalidArgumentError, NotReadyError  # noqa: E402
from kvtier_rs.integrations.vllm import metrics as m  # noqa: E402
from kvtier_rs.integrations.vllm.manager import KvtierOffloadingManager  # noqa: E402
from kvtier_rs.integrations.vllm.options import parse_options  # noqa: E402

_offloading_config = E.spec_config

# How long a test waits for disk work that must finish: far beyond any stall of a loaded
# machine, and only spent when the product is broken.
WAIT_S = 60.0


def key(i: int, group: int = 0) -> bytes:
    """A vLLM-shaped OffloadKey: a 32-byte sha256 block hash plus a 4-byte group index."""
    return hashlib.sha256(i.to_bytes(8, "little")).digest() + group.to_bytes(4, "big")


def mgr(n: int = 4, events: bool = True, policy: str = "lru") -> KvtierOffloadingManager:
    return KvtierOffloadingManager(BlockIndex(n, policy=policy), enable_events=events)


def ctx(name: str = "r") -> ReqContext:
    return ReqContext(req_id=name)


def store(mg, keys, c=None):
    c = c or ctx()
    out = mg.prepare_store(keys, c)
    assert out is not None
    mg.complete_store(out.keys_to_store, c)
    return out


def disk_layer(tmp_path, *, cpu_slots: int = 2, disk_slots: int = 16, clock=None, **extra):
    """kvtier's disk tier (4 KiB chunks, in tmp_path/d) under a CPU index of `cpu_slots`, as
    the vLLM disk layer: (cpu index, disk tier, layer). `extra`: more connector options;
    `clock`: the layer's clock (its guard's and its promotions' waits)."""
    from kvtier_rs import DiskTier, HostPool
    from kvtier_rs.integrations.vllm.disk_layer import DiskLayer

    pool = HostPool(cpu_slots * 4096, 4096)
    cpu = BlockIndex(pool=pool)
    disk = DiskTier(str(tmp_path / "d"), disk_slots * 8192, 4096, admission="always", engine="pool")
    opts = parse_options(
        {"cpu_bytes_to_use": cpu_slots * 4096, "disk_root": str(tmp_path), "disk_bytes_to_use": 1 << 20, **extra}
    )
    timing = {} if clock is None else {"clock": clock}
    return cpu, disk, DiskLayer(disk, pool, cpu, opts, tokens_per_chunk=16, **timing)


def disk_backed(tmp_path, *, events: bool = False, **extra):
    """A manager over a 2-chunk CPU tier with kvtier's disk tier below it, and the disk tier;
    key(1) has been written through and pushed out of the CPU tier (it is only on disk)."""
    cpu, disk, layer = disk_layer(tmp_path, **extra)
    mg = KvtierOffloadingManager(cpu, enable_events=events, lower=layer)
    for keys in ([key(1)], [key(2), key(3)]):
        store(mg, keys)
        assert disk.wait_idle(WAIT_S)
        mg.on_schedule_end(None)  # collects the write-through
    assert cpu.state(key(1)) is None and disk.contains([key(1)]) == [True]
    return mg, disk


def test_lookup_miss_pending_hit():
    mg, c = mgr(), ctx()
    k = key(1)
    assert mg.lookup(k, c) is LookupResult.MISS
    out = mg.prepare_store([k], c)
    assert out.keys_to_store == [k] and list(out.store_spec.block_ids) == [0]
    assert mg.lookup(k, c) is LookupResult.HIT_PENDING  # written, not yet readable
    mg.complete_store([k], c)
    assert mg.lookup(k, c) is LookupResult.HIT


def test_prepare_store_skips_present_keys_and_keeps_order():
    mg = mgr(8)
    store(mg, [key(1), key(2)])
    out = mg.prepare_store([key(1), key(2), key(3), key(4)], ctx())
    assert out.keys_to_store == [key(3), key(4)]
    assert len(out.store_spec.block_ids) == 2
    assert mg.prepare_store([key(1)], ctx()).keys_to_store == []


def test_load_pins_until_complete_load():
    mg, c = mgr(2), ctx()
    store(mg, [key(1), key(2)])
    spec = mg.prepare_load([key(1), key(2)], c)
    assert sorted(spec.block_ids.tolist()) == [0, 1]
    # Both slots pinned: a store that needs an eviction cannot happen -> None, nothing changed.
    assert mg.prepare_store([key(3)], ctx("other")) is None
    assert mg.lookup(key(1), c) is LookupResult.HIT and mg.lookup(key(2), c) is LookupResult.HIT
    mg.complete_load([key(1), key(2)], c)
    out = mg.prepare_store([key(3)], ctx("other"))
    assert out is not None and out.keys_to_store == [key(3)] and len(out.evicted_keys) == 1


def test_prepare_load_of_missing_key_raises():
    mg = mgr()
    with pytest.raises(NotReadyError):
        mg.prepare_load([key(9)], ctx())


def test_prepare_store_never_evicts_an_input_key():
    mg = mgr(3)
    for i in (1, 2, 3):
        store(mg, [key(i)])
    # key(1) is the least recent and an input; the two new keys need 2 slots: the only
    # evictable non-input blocks are key(2) and key(3).
    out = mg.prepare_store([key(1), key(4), key(5)], ctx())
    assert out is not None and out.keys_to_store == [key(4), key(5)]
    assert set(out.evicted_keys) == {key(2), key(3)}
    assert mg.lookup(key(1), ctx()) is LookupResult.HIT


def test_prepare_store_is_all_or_nothing():
    mg = mgr(3)
    store(mg, [key(1), key(2)])
    # Needs 3 new slots; 1 free + only 1 evictable non-input (key(2); key(1) is an input).
    assert mg.prepare_store([key(1), key(3), key(4), key(5)], ctx()) is None
    assert mg.lookup(key(1), ctx()) is LookupResult.HIT
    assert mg.lookup(key(2), ctx()) is LookupResult.HIT
    assert mg.lookup(key(3), ctx()) is LookupResult.MISS
    assert not any(e.removed for e in mg.take_events()), "a refused store must evict nothing"


def test_writing_blocks_are_not_evicted():
    mg = mgr(2)
    assert mg.prepare_store([key(1), key(2)], ctx()) is not None  # both writing
    assert mg.prepare_store([key(3)], ctx()) is None


def test_failed_store_frees_its_slot():
    mg, c = mgr(1), ctx()
    mg.prepare_store([key(1)], c)
    mg.complete_store([key(1)], c, success=False)
    assert mg.lookup(key(1), c) is LookupResult.MISS
    assert mg.prepare_store([key(2)], c).keys_to_store == [key(2)]


def test_a_failed_index_stores_nothing_and_answers_misses():
    mg, c = mgr(2), ctx()
    store(mg, [key(1), key(2)])
    mg._cpu._inject_fault("store_panic")
    # The store that panics (after evicting) and every later one store nothing, and say so with
    # an empty PrepareStoreOutput. None would be vLLM's "cannot store now": it counts an
    # allocation failure, logs a warning and offers the same chunks again on every later step,
    # for as long as the engine runs (the failure is terminal). Before: None.
    for k in (key(3), key(4)):
        out = mg.prepare_store([k], c)
        assert out is not None, "a failed tier must not answer 'cannot store now'"
        assert out.keys_to_store == [] and out.evicted_keys == []
        assert list(out.store_spec.block_ids) == []
    assert all(mg.lookup(key(i), c) is LookupResult.MISS for i in range(1, 5))
    mg._last_report -= 10
    gauges = mg.get_stats().data["data"]
    assert gauges[m.PREFIX + "failed"][("cpu",)] == 1


def test_events_removal_before_store():
    mg = mgr(1)
    store(mg, [key(1)])
    store(mg, [key(2)])
    ev = list(mg.take_events())
    assert [(e.keys, e.removed, e.medium) for e in ev] == [
        ([key(1)], False, Medium.CPU),
        ([key(1)], True, Medium.CPU),
        ([key(2)], False, Medium.CPU),
    ]
    assert list(mg.take_events()) == []


def test_no_events_when_disabled():
    mg = mgr(1, events=False)
    store(mg, [key(1)])
    store(mg, [key(2)])
    assert list(mg.take_events()) == []


def test_request_finish_refreshes_recency():
    mg = mgr(3)
    for i in (1, 2, 3):  # one at a time: key(1) is the least recent
        store(mg, [key(i)])
    c = ctx("reuse")
    mg.on_new_request(c)
    mg.prepare_load([key(1)], c)
    mg.complete_load([key(1)], c)
    mg.on_request_finished(c)  # key(1) becomes the most recent
    out = mg.prepare_store([key(4)], ctx())
    assert out.evicted_keys == [key(2)]


def test_reset_cache_drops_everything_including_in_flight():
    mg, c = mgr(3), ctx()
    store(mg, [key(1)])
    mg.prepare_load([key(1)], c)  # pinned, its completion will never come
    mg.prepare_store([key(2)], c)  # writing, likewise
    mg.reset_cache()
    for k in (key(1), key(2)):
        assert mg.lookup(k, c) is LookupResult.MISS
    out = mg.prepare_store([key(3), key(4), key(5)], ctx("new"))
    assert out is not None and len(out.keys_to_store) == 3


def _served_from_disk(mg, k, c):
    """Whether a lookup of `k` (on disk only) is promoted and becomes a hit."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        r = mg.lookup(k, c)
        if r is LookupResult.HIT:
            return True
        if r is LookupResult.MISS:
            return False
        mg.on_schedule_end(None)
        time.sleep(0.005)
    raise AssertionError(f"lookup of {k!r} never settled")


def test_reset_cache_forgets_the_disk_tier_too_and_for_good(tmp_path):
    # vLLM resets the cache after a weight update: a block written under the old weights must
    # never be promoted again, in this process or after a restart. Before, only the CPU tier
    # was cleared and key(1) came back from disk.
    from kvtier_rs import DiskTier

    mg, disk = disk_backed(tmp_path)
    mg.reset_cache()
    assert disk.contains([key(1), key(2), key(3)]) == [False] * 3
    assert not _served_from_disk(mg, key(1), ctx())
    # Written after the reset: these survive a restart, the old ones do not.
    store(mg, [key(7)])
    assert disk.wait_idle(WAIT_S)
    mg.on_schedule_end(None)
    assert disk.contains([key(7)]) == [True]
    mg.shutdown()
    reopened = DiskTier(str(tmp_path / "d"), 16 * 8192, 4096, admission="always", engine="pool")
    assert reopened.contains([key(1), key(2), key(3), key(7)]) == [False, False, False, True]
    assert reopened.stats()["recovery_discarded"] == 3
    reopened.close()


def test_reset_cache_can_keep_the_disk_tier(tmp_path):
    mg, disk = disk_backed(tmp_path, disk_on_reset="keep")
    mg.reset_cache()
    assert disk.contains([key(1)]) == [True]
    assert _served_from_disk(mg, key(1), ctx())
    mg.shutdown()


def test_after_a_reset_no_promotion_lands_in_a_slot_a_flushed_store_still_writes(tmp_path):
    # vLLM's order around reset_cache (0.32): a store prepared in step N is submitted to the
    # worker at the start of step N+1. A reset in between frees its CPU slot in the index and
    # only flushes the store: the worker runs it at the start of the next step it executes,
    # and vLLM drops its completion. That step's scheduling runs first: a lookup of a chunk
    # held on disk (kept over the reset) promoted it into a free slot, the freed one. Before:
    # the verified disk read landed there, the flushed store then overwrote it, and the chunk
    # was served with the other chunk's bytes. The worker here is kvtier's own, copying real
    # bytes between an engine-shaped KV cache (4 blocks, a chunk each) and the CPU tier.
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )

    from kvtier_rs.integrations.vllm.worker import KvtierWorker

    cpu, disk, layer = disk_layer(tmp_path, cpu_slots=1, disk_on_reset="keep")
    mg = KvtierOffloadingManager(cpu, lower=layer)
    kv = torch.zeros((4, 4096), dtype=torch.int8)
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(kv, 4096)], [[CanonicalKVCacheRef(0, 4096)]])
    worker = KvtierWorker(caches, layer.host, 1)
    jobs = iter(range(1, 100))

    def run(to_host, block, cpu_spec):
        """One worker job between engine block `block` and the CPU slot of `cpu_spec`, done."""
        gpu, job = GPULoadStoreSpec([block], group_sizes=[1], block_indices=[0]), next(jobs)
        if to_host:
            worker.submit_store(job, gpu, cpu_spec)
        else:
            worker.submit_load(job, cpu_spec, gpu)
        worker.wait({job})
        assert [r.job_id for r in worker.get_finished() if r.success] == [job]

    def serve(k, block, c):
        """What vLLM does with a request for chunk `k` (its KV, once computed, in engine block
        `block`): look it up until the answer settles; load a hit into block 0, or compute the
        chunk and store it. Returns the KV the request then attends to."""
        if _served_from_disk(mg, k, c):  # a HIT, from either tier
            run(False, 0, mg.prepare_load([k], c))
            mg.complete_load([k], c)
            return kv[0].clone()
        out = mg.prepare_store([k], c)
        run(True, block, out.store_spec)
        mg.complete_store(out.keys_to_store, c)
        assert disk.wait_idle(WAIT_S)  # its write-through, collected by the next step
        mg.on_schedule_end(None)
        return kv[block].clone()

    kept, stale = key(1), key(2)
    kv[1], kv[2], kv[3] = 1, 2, 3  # the KV of kept, stale and key(3)
    assert (serve(kept, 1, ctx()) == 1).all()  # computed, stored, written through to disk
    flushed = mg.prepare_store([stale], ctx()).store_spec  # evicts kept (on disk); not run yet
    mg.reset_cache()  # e.g. LLM.reset_prefix_cache(reset_connector=True)

    r = ctx("after")
    mg.lookup(kept, r)  # the next step's scheduling...
    assert disk.wait_idle(WAIT_S)
    run(True, 2, flushed)  # ...then its execution, which starts with the flushed store
    mg.on_schedule_end(None)
    assert (serve(kept, 1, r) == 1).all(), "the chunk was served with another chunk's bytes"
    # Once the flush is over, promotions go on: kept, pushed out of the CPU tier by key(3),
    # comes back from disk, with its own bytes.
    assert (serve(key(3), 3, ctx()) == 3).all() and cpu.state(kept) is None
    assert (serve(kept, 1, ctx()) == 1).all()
    assert mg.counters.loads_disk == 1
    mg.shutdown()


def test_a_disk_tier_that_cannot_be_cleared_is_switched_off(tmp_path, caplog, monkeypatch):
    import logging

    from kvtier_rs import KvTierError

    # The adapter logs under vLLM's logger, which vLLM keeps from propagating to the root.
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)

    mg, disk = disk_backed(tmp_path)

    class Unclearable:
        """The disk tier, except that its metadata cannot be rewritten (a full disk, say)."""

        def __getattr__(self, name):
            return getattr(disk, name)

        def clear(self):
            raise KvTierError("write kvtier-disk.meta: No space left on device")

    mg.lower.layer("disk").disk = Unclearable()
    mg.reset_cache()
    assert "disk tier switched off" in caplog.text and "No space left" in caplog.text
    assert disk.contains([key(1)]) == [True]  # still on disk, but never served again here
    assert not _served_from_disk(mg, key(1), ctx())
    written = disk.stats()["blocks_written"]
    store(mg, [key(8)])
    mg.on_schedule_end(None)
    assert disk.wait_idle(WAIT_S)
    assert disk.stats()["blocks_written"] == written, "nothing is written through any more"
    # Operators see it: the disk tier's switched_off gauge (the CPU tier's stays 0).
    values = mg.get_stats().data["data"]
    assert values[m.PREFIX + "switched_off"] == {("cpu",): 0, ("disk",): 1}
    mg.shutdown()


def test_a_disk_hit_skipped_by_the_cost_rule_counts_once_per_request_and_chunk(tmp_path):
    """vLLM asks about a waiting request's chunks again on every step it is not scheduled; each
    skipped chunk counted once a step before."""
    # Recomputing a 16-token chunk at 10^9 tokens/s beats reading 4 KiB at 1 byte/s.
    mg, _ = disk_backed(tmp_path, cost_model={"prefill_tokens_per_s": 1e9, "disk_read_bytes_per_s": 1})
    waiting = ctx("waiting")
    for _ in range(3):  # three steps
        assert mg.lookup(key(1), waiting) is LookupResult.MISS
        mg.on_schedule_end(None)
    assert mg.lower.layer("disk").counters.disk_skipped_by_cost == 1
    assert mg.lookup(key(1), ctx("another")) is LookupResult.MISS
    assert mg.lower.layer("disk").counters.disk_skipped_by_cost == 2
    mg.shutdown()


def _disk_only(tmp_path, n: int, *, clock=None, **extra):
    """A manager over a 2-chunk CPU tier whose disk tier holds key(1)..key(n) that the CPU tier
    no longer holds (written through, then pushed out by key(n + 1) and key(n + 2))."""
    cpu, disk, layer = disk_layer(tmp_path, clock=clock, **extra)
    mg = KvtierOffloadingManager(cpu, lower=layer)
    for i in range(1, n + 3):
        store(mg, [key(i)])
        assert disk.wait_idle(WAIT_S)
        mg.on_schedule_end(None)  # collects the write-through
    assert disk.contains([key(i) for i in range(1, n + 1)]) == [True] * n
    assert [cpu.state(key(i)) for i in range(1, n + 1)] == [None] * n
    return mg, disk


def test_disk_hits_beyond_the_promotion_cap_are_recomputed_and_counted_once(tmp_path):
    # No poll between the lookups, so every promotion started stays in flight: the third and
    # fourth disk hits find the cap (2) reached and are misses, never queued.
    mg, disk = _disk_only(tmp_path, 4, disk_max_promotions_in_flight=2)
    r = ctx("burst")
    assert [mg.lookup(key(i), r) for i in (1, 2)] == [LookupResult.HIT_PENDING] * 2
    assert [mg.lookup(key(i), r) for i in (3, 4)] == [LookupResult.MISS] * 2
    assert mg.lookup(key(3), r) is LookupResult.MISS  # vLLM asks again next step: counted once
    assert mg.lower.layer("disk").counters.disk_refused_backpressure == 2
    assert mg.lower.layer("disk").stats()["promotions_in_flight"] == 2
    assert disk.wait_idle(WAIT_S)
    mg.on_schedule_end(None)  # the two reads land: room again
    mg.on_request_finished(r)  # (its promoted chunks are no longer held for it)
    assert mg.lookup(key(3), ctx("later")) is LookupResult.HIT_PENDING
    values = mg.get_stats().data["data"]
    assert values[m.PREFIX + "disk_refused_backpressure"] == {(): 2}
    mg.shutdown()


def test_a_slow_disk_trips_the_guard_its_hits_are_recomputed_then_it_is_reprobed(tmp_path, caplog):
    now = [0.0]
    rule = {"p99_ms": 100, "window_s": 60, "recover_s": 30, "min_samples": 2}
    mg, disk = _disk_only(tmp_path, 4, clock=lambda: now[0], disk_slo_guard=rule)

    def promote_slowly(k):
        """Promote `k`, the request waiting 0.5 s (on the layer's clock) for its read."""
        r = ctx()
        assert mg.lookup(k, r) is LookupResult.HIT_PENDING
        assert disk.wait_idle(WAIT_S)
        now[0] += 0.5
        mg.on_schedule_end(None)
        mg.on_request_finished(r)  # (its promoted chunk is no longer held for it)

    promote_slowly(key(1))
    assert mg.lower.layer("disk").gate.guards["disk"].allows(), "one slow sample is not a trip"
    promote_slowly(key(2))
    # Two waits of 500 ms against a 100 ms budget: bypassed; its hits are misses, counted.
    assert not mg.lower.layer("disk").gate.guards["disk"].allows()
    waiting = ctx("waiting")
    assert mg.lookup(key(3), waiting) is LookupResult.MISS
    assert mg.lookup(key(3), waiting) is LookupResult.MISS
    assert mg.lower.layer("disk").counters.disk_refused_guard == 1
    assert "SLO guard tripped: the disk tier is bypassed for 30 s" in caplog.text
    values = mg.get_stats().data["data"]
    assert values[m.PREFIX + "guard_state"] == {("disk",): 1}
    assert values[m.PREFIX + "guard_trips"] == {("disk",): 1}
    assert values[m.PREFIX + "disk_refused_guard"] == {(): 1}
    # After the cool-down the tier is back on probation: a disk hit is promoted again.
    now[0] += 31
    assert mg.lookup(key(3), ctx("after")) is LookupResult.HIT_PENDING
    assert "the disk tier is back in service" in caplog.text
    assert disk.wait_idle(WAIT_S)
    mg.on_schedule_end(None)
    values = mg.get_stats().data["data"]
    assert values[m.PREFIX + "guard_state"] == {("disk",): 0}
    assert m.PREFIX + "guard_trips" not in values or values[m.PREFIX + "guard_trips"] == {}
    mg.shutdown()


def test_the_request_rule_bypasses_the_disk_tier_first_then_the_cpu_tier(tmp_path, caplog):
    """slo_guard: requests over the TTFT budget bypass the newest tier (disk) first; still over
    it, the CPU tier goes too; after the cool-down both are re-probed. Driven on a fake clock
    with the TTFT samples KvtierConnector would record."""
    from kvtier_rs.orchestrator.request_guard import RequestGuard

    now = [100.0]
    rule = {"ttft_p99_ms": 200, "window_s": 60, "recover_s": 30, "min_samples": 3}
    cpu, disk, layer = disk_layer(tmp_path, clock=lambda: now[0], slo_guard=rule)
    guard = RequestGuard(layer.options.slo_guard, ("cpu", "disk"), clock=lambda: now[0])
    layer.gate.request_guard = guard
    mg = KvtierOffloadingManager(cpu, lower=layer, request_guard=guard)
    for keys in ([key(1)], [key(2), key(3)]):
        store(mg, keys)
        assert disk.wait_idle(WAIT_S)
        mg.on_schedule_end(None)
    assert cpu.state(key(1)) is None and disk.contains([key(1)]) == [True]

    def slow_requests():
        now[0] += 1.0
        for _ in range(3):
            now[0] += 0.01
            guard.record("ttft", 0.5)

    slow_requests()
    r = ctx("after-trip")
    assert mg.lookup(key(1), r) is LookupResult.MISS  # a disk hit, recomputed
    assert mg.lookup(key(3), r) is LookupResult.HIT  # the CPU tier still serves
    assert (mg.counters.disk_refused_guard, mg.counters.cpu_refused_guard) == (1, 0)
    values = mg.get_stats().data["data"]
    assert values[m.PREFIX + "guard_state"] == {("cpu",): 0, ("disk",): 1}
    slow_requests()  # still over budget with the disk tier out
    assert mg.lookup(key(3), ctx("later")) is LookupResult.MISS
    assert mg.counters.cpu_refused_guard == 1
    values = mg.get_stats().data["data"]
    assert values[m.PREFIX + "guard_state"] == {("cpu",): 1, ("disk",): 1}
    assert values[m.PREFIX + "guard_trips"] == {("cpu",): 1}  # the disk trip went out before
    assert values[m.PREFIX + "cpu_refused_guard"] == {(): 1}
    assert "the disk tier is bypassed" in caplog.text and "the cpu tier is bypassed" in caplog.text
    # Nothing measured requests here (no KvtierConnector): said once in the log.
    assert caplog.text.count("the connector is not KvtierConnector") == 1
    now[0] += 31
    assert mg.lookup(key(3), ctx("re-probed")) is LookupResult.HIT
    assert mg.lookup(key(1), ctx("re-probed")) is LookupResult.HIT_PENDING
    values = mg.get_stats().data["data"]
    assert values[m.PREFIX + "guard_state"] == {("cpu",): 0, ("disk",): 0}
    assert "the disk tier is back in service" in caplog.text
    assert disk.wait_idle(WAIT_S)
    mg.on_schedule_end(None)
    mg.shutdown()


def test_request_timings_record_each_requests_ttft_and_itl_once():
    import types

    from kvtier_rs.integrations.vllm.timings import RequestTimings
    from kvtier_rs.orchestrator.request_guard import RequestGuard, RequestRule

    wall, mono = [1000.0], [50.0]
    seen: list[tuple[str, float]] = []

    class Recorder(RequestGuard):
        def record(self, signal, seconds, *, started_s_ago=None):
            seen.append((signal, round(seconds, 6)))

    t = RequestTimings(
        Recorder(RequestRule(ttft_p99_ms=1), ("cpu",)), wall_clock=lambda: wall[0], clock=lambda: mono[0]
    )
    a = types.SimpleNamespace(request_id="a", arrival_time=999.0, num_output_tokens=0)
    b = types.SimpleNamespace(request_id="b", arrival_time=999.5, num_output_tokens=0)
    t.arrived(a)
    t.arrived(a)  # asked again while it waits: one request
    t.arrived(b)
    t.step()
    assert seen == []  # no token yet
    a.num_output_tokens = 1
    wall[0] += 0.25
    t.step()
    t.step()
    assert seen == [("ttft", 1.25)]
    a.num_output_tokens, mono[0] = 5, mono[0] + 2.0
    t.finished(a)
    assert seen == [("ttft", 1.25), ("itl", 0.5)]  # 2 s over 4 gaps
    b.num_output_tokens = 1  # a one-token answer: first token and finish in one step
    t.finished(b)
    assert seen == [("ttft", 1.25), ("itl", 0.5), ("ttft", 0.75)]
    t.arrived(a)  # a finished request's id seen again is a new arrival only if it waits again
    t.finished(a)
    assert len(seen) == 4 and seen[-1][0] == "ttft"


def test_a_hung_disk_trips_the_guard_from_its_reads_in_flight(tmp_path):
    # Reads that never complete produce no completions: the reads in flight past the budget are
    # the guard's samples. Here they have landed but are not polled, so they look in flight.
    now = [0.0]
    rule = {"p99_ms": 100, "min_samples": 2}
    mg, _ = _disk_only(tmp_path, 3, clock=lambda: now[0], disk_slo_guard=rule)
    layer = mg.lower.layer("disk")
    assert [mg.lookup(key(i), ctx()) for i in (1, 2)] == [LookupResult.HIT_PENDING] * 2
    now[0] += 0.5
    layer.gate.stalled("disk", {job: now[0] - r.started for job, r in layer._reads.items()})
    assert not layer.gate.guards["disk"].allows()
    # Their completions, when they come, are not counted again.
    mg.on_schedule_end(None)
    assert layer.gate.guards["disk"].state()["trips"] == 1
    mg.shutdown()


def test_admission_store_threshold():
    opts = parse_options({"cpu_bytes_to_use": 1 << 20, "store_threshold": 2})
    assert opts.cpu_admission == "uses:2"
    mg = KvtierOffloadingManager(BlockIndex(4, admission=opts.cpu_admission))
    assert mg.prepare_store([key(1)], ctx()).keys_to_store == []  # first offer: refused
    assert mg.prepare_store([key(1)], ctx()).keys_to_store == [key(1)]  # second: admitted


def test_get_stats_emits_only_declared_metrics():
    mg = mgr(1)
    store(mg, [key(1)])
    store(mg, [key(2)])
    c = ctx()
    mg.prepare_load([key(2)], c)
    mg.complete_load([key(2)], c)
    stats = mg.get_stats()
    assert isinstance(stats, OffloadingConnectorStats)
    declared = m.metric_definitions()
    types, values = stats.data["types"], stats.data["data"]
    assert values, "no metrics emitted"
    for name, by_labels in values.items():
        assert name in declared, f"undeclared metric {name}: vLLM would assert"
        for labelvalues in by_labels:
            assert len(labelvalues) == len(declared[name].labelnames), name
    assert values[m.PREFIX + "loads_cpu"][()] == 1
    assert values[m.PREFIX + "evictions"][("cpu",)] == 1
    assert values[m.PREFIX + "resident_blocks"][("cpu",)] == 1
    assert types[m.PREFIX + "loads_cpu"] == "counter"
    # Counters are deltas: with no new activity, nothing is reported again (no report at all
    # while quiet, or a report without counters once the interval has passed).
    again = mg.get_stats()
    assert again is None or not [n for n, t in again.data["types"].items() if t == "counter"]
    mg._last_report -= 10  # the quiet interval has passed: gauges are refreshed, no counters
    again = mg.get_stats()
    assert again is not None and not [n for n, t in again.data["types"].items() if t == "counter"]


def test_package_imports_without_vllm():
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import kvtier_rs.integrations.vllm as v\n"
        "try:\n    v.KvtierOffloadingSpec\nexcept ImportError as e:\n    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("ERR kvtier_rs.integrations.vllm needs vLLM 0.32.x")


@pytest.mark.parametrize(
    "extra, key_name",
    [
        ({}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": "lots"}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 1 << 20, "eviction_policy": "mru"}, "eviction_policy"),
        ({"cpu_bytes_to_use": 1 << 20, "cpu_admission": "sometimes"}, "cpu_admission"),
        ({"cpu_bytes_to_use": 1 << 20, "disk_bytes_to_use": "1GiB"}, "disk_bytes_to_use"),
        ({"cpu_bytes_to_use": 1 << 20, "disk_root": "/tmp/x"}, "disk_bytes"),
        (
            {"cpu_bytes_to_use": 1 << 20, "disk_root": "/x", "disk_bytes_to_use": 1, "disk_io_engine": "aio"},
            "disk_io_engine",
        ),
        ({"cpu_bytes_to_use": 1 << 20, "cost_model": {"prefill_tokens_per_s": -1}}, "cost_model"),
        ({"cpu_bytes_to_use": 1 << 20, "guard": "off"}, "guard"),
        ({"cpu_bytes_to_use": 1 << 20, "cache_policy_module_path": "x"}, "cache_policy_module_path"),
        ({"cpu_bytes_to_use": 1 << 20, "dsik_root": "/x"}, "dsik_root"),
        # store_threshold is checked as an int the core's uses:K takes (K <= 255), whether or
        # not cpu_admission is set (a raw ValueError / TypeError before; 256 blamed `admission`).
        ({"cpu_bytes_to_use": 1 << 20, "cpu_admission": "always", "store_threshold": "x"}, "store_threshold"),
        ({"cpu_bytes_to_use": 1 << 20, "cpu_admission": "always", "store_threshold": [2]}, "store_threshold"),
        ({"cpu_bytes_to_use": 1 << 20, "store_threshold": 256}, "store_threshold"),
        ({"cpu_bytes_to_use": 1 << 20, "store_threshold": -1}, "store_threshold"),
        ({"cpu_bytes_to_use": 1 << 20, "store_threshold": 2.0}, "store_threshold"),
        ({"cpu_bytes_to_use": 1 << 20, "cpu_admission": "always", "store_threshold": 2}, "cpu_admission"),
        # Keys only vLLM's CPU / tiering specs read: nothing reads them under this spec.
        ({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": "not-a-list"}, "secondary_tiers"),
        ({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [{"type": "fs", "root_dir": "/x"}]}, "secondary_tiers"),
        ({"cpu_bytes_to_use": 1 << 20, "backpressure": 5}, "backpressure"),
        ({"cpu_bytes_to_use": 1 << 20, "max_tracker_size": "lots"}, "max_tracker_size"),
        ({"cpu_bytes_to_use": 1 << 20, "tier_poll_interval_s": -3}, "tier_poll_interval_s"),
        ({"cpu_bytes_to_use": 1 << 20, "sync_load_budget_bytes": "x"}, "sync_load_budget_bytes"),
        # cost_model rates: positive and finite (inf passed, 10**400 raised OverflowError).
        (
            {
                "cpu_bytes_to_use": 1 << 20,
                "disk_root": "/x",
                "disk_bytes_to_use": "1GiB",
                "cost_model": {"prefill_tokens_per_s": float("inf"), "disk_read_bytes_per_s": 1e9},
            },
            "cost_model",
        ),
        (
            {
                "cpu_bytes_to_use": 1 << 20,
                "disk_root": "/x",
                "disk_bytes_to_use": "1GiB",
                "cost_model": {"prefill_tokens_per_s": 1000, "disk_read_bytes_per_s": float("inf")},
            },
            "cost_model",
        ),
        (
            {
                "cpu_bytes_to_use": 1 << 20,
                "disk_root": "/x",
                "disk_bytes_to_use": "1GiB",
                "cost_model": {"prefill_tokens_per_s": 10**400, "disk_read_bytes_per_s": 1},
            },
            "cost_model",
        ),
        (
            {
                "cpu_bytes_to_use": 1 << 20,
                "disk_root": "/x",
                "disk_bytes_to_use": "1GiB",
                "cost_model": {"prefill_tokens_per_s": 10**5000, "disk_read_bytes_per_s": 1},
            },
            "cost_model",
        ),
        (
            {
                "cpu_bytes_to_use": 1 << 20,
                "disk_root": "/x",
                "disk_bytes_to_use": "1GiB",
                "cost_model": {"prefill_tokens_per_s": float("nan"), "disk_read_bytes_per_s": 1},
            },
            "cost_model",
        ),
        (
            {
                "cpu_bytes_to_use": 1 << 20,
                "disk_root": "/x",
                "disk_bytes_to_use": "1GiB",
                "cost_model": {"prefill_tokens_per_s": 1000, 1: 2, "zz": 3},
            },
            "cost_model",
        ),
        (
            {"cpu_bytes_to_use": 1 << 20, "disk_root": "/x", "disk_bytes_to_use": "1GiB", "disk_queue_depth": "16"},
            "disk_queue_depth",
        ),
        (
            {"cpu_bytes_to_use": 1 << 20, "disk_root": "/x", "disk_bytes_to_use": "1GiB", "disk_queue_depth": 1025},
            "disk_queue_depth",
        ),
        ({"cpu_bytes_to_use": 1 << 20, "disk_root": "/tmp/a\x00b", "disk_bytes_to_use": "1GiB"}, "disk_root"),
        ({"cpu_bytes_to_use": 10**5000}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 1 << 20, 1: 2, "zz": 3}, 1),  # unknown keys of mixed types
    ],
)
def test_bad_extra_config_names_the_key(extra, key_name):
    with pytest.raises(InvalidArgumentError, match=rf"kv_connector_extra_config\[{re.escape(repr(key_name))}\]"):
        parse_options(extra)


_DISK = {"cpu_bytes_to_use": 1 << 20, "disk_root": "/x", "disk_bytes_to_use": "1GiB"}


@pytest.mark.parametrize(
    ("key_name", "value", "reason"),
    [
        ("disk_slo_guard", 50, "expected null or a dict with p99_ms"),
        ("disk_slo_guard", {"window_s": 10}, "p99_ms is required"),
        ("disk_slo_guard", {"p99_ms": 50, "budget": 1}, r"unknown field\(s\) \['budget'\]"),
        ("disk_slo_guard", {"p99_ms": 0}, "p99_ms must be a positive finite number"),
        ("disk_slo_guard", {"p99_ms": "50ms"}, "p99_ms must be a positive finite number"),
        ("disk_slo_guard", {"p99_ms": 50, "window_s": float("inf")}, "window_s must be a positive"),
        ("disk_slo_guard", {"p99_ms": 50, "recover_s": -1}, "recover_s must be a positive"),
        ("disk_slo_guard", {"p99_ms": 50, "min_samples": 0}, r"min_samples must be an int in 1\.\.100000"),
        ("disk_slo_guard", {"p99_ms": 50, "min_samples": True}, "min_samples must be an int"),
        ("disk_max_promotions_in_flight", 0, r"expected an int in 1\.\.1048576"),
        ("disk_max_promotions_in_flight", "16", "expected an int"),
    ],
)
def test_bad_guard_and_back_pressure_options_name_the_key(key_name, value, reason):
    with pytest.raises(InvalidArgumentError, match=rf"kv_connector_extra_config\['{key_name}'\]: {reason}"):
        parse_options({**_DISK, key_name: value})


def test_guard_and_back_pressure_options_need_the_disk_tier_and_have_defaults():
    with pytest.raises(InvalidArgumentError, match=r"\['disk_slo_guard'\]: needs disk_root"):
        parse_options({"cpu_bytes_to_use": 1 << 20, "disk_slo_guard": {"p99_ms": 50}})
    opts = parse_options(_DISK)
    assert opts.disk_slo_guard is None and opts.disk_max_promotions_in_flight == 1024
    opts = parse_options({**_DISK, "disk_slo_guard": {"p99_ms": 50, "min_samples": 5}})
    assert (opts.disk_slo_guard.p99_ms, opts.disk_slo_guard.window_s, opts.disk_slo_guard.min_samples) == (50, 10, 5)


@pytest.mark.parametrize("key_name", ["offload_prompt_only", "self_describing_kv_events", "canonical_layout"])
@pytest.mark.parametrize("value", ["false", "no", 0, None, [False]])
def test_vllm_s_boolean_keys_take_booleans_only(key_name, value):
    # vLLM reads these with bool(value): "false" (a string from a config file or a CLI) turns
    # offload_prompt_only *on*, self-describing events on, canonical_layout on. Before: kvtier
    # accepted them unchecked (its docs say vLLM validates them; it does not), so the engine
    # ran with the opposite of what was asked, silently.
    with pytest.raises(InvalidArgumentError, match=rf"kv_connector_extra_config\['{key_name}'\]: expected a bool"):
        parse_options({"cpu_bytes_to_use": 1 << 20, key_name: value})
    for ok in (True, False):
        parse_options({"cpu_bytes_to_use": 1 << 20, key_name: ok})


@pytest.mark.parametrize(
    ("key_name", "spec"),
    [
        ("secondary_tiers", "TieringOffloadingSpec"),
        ("backpressure", "TieringOffloadingSpec"),
        ("sync_load_budget_bytes", "TieringOffloadingSpec"),
        ("tier_poll_interval_s", "TieringOffloadingSpec"),
        ("max_tracker_size", "CPUOffloadingSpec"),
    ],
)
def test_keys_of_other_vllm_specs_are_refused_naming_the_spec_that_reads_them(key_name, spec):
    with pytest.raises(
        InvalidArgumentError, match=rf"\['{key_name}'\]: read only by vLLM's {spec}.*KvtierOffloadingSpec"
    ):
        parse_options({"cpu_bytes_to_use": 1 << 20, key_name: 1})


def scheduler_manager(spec):
    """The spec's manager, built as vLLM builds it: after every worker rank mapped the engine's
    host region (here this process maps it for each rank, and lets go once the manager holds it)."""
    worker_maps = [spec.open_region(rank) for rank in range(spec.ranks)]
    try:
        return spec.get_manager()
    finally:
        for region in worker_maps:
            region.close()


@pytest.mark.parametrize(
    ("over", "key_name", "reason"),
    [
        ({"disk_bytes_to_use": 1}, "disk_bytes_to_use", "hold 0 slot"),
        ({"disk_bytes_to_use": 2**62}, "disk_bytes_to_use", "2\\^31 slots"),
        ({"disk_root": "FILE"}, "disk_root", "Not a directory"),
        ({"disk_root": "FILE/sub"}, "disk_root", "Not a directory"),
        ({"cpu_bytes_to_use": 2**62}, "cpu_bytes_to_use", "2\\^32 slots"),
    ],
)
def test_what_only_the_tier_can_check_names_the_key_at_start_up(tmp_path, over, key_name, reason):
    # Before: the core's "invalid argument `capacity_bytes`" / `total_bytes`, or a DiskIoError
    # with the path, naming no key the user wrote.
    from kvtier_rs.integrations.vllm.spec import KvtierOffloadingSpec, engine_state

    (tmp_path / "file").write_bytes(b"x")
    extra = {"cpu_bytes_to_use": 4 * 32768, "disk_root": str(tmp_path / "disk"), "disk_bytes_to_use": "1MiB"}
    extra.update({k: v.replace("FILE", str(tmp_path / "file")) if isinstance(v, str) else v for k, v in over.items()})
    cfg = _offloading_config(extra)
    with pytest.raises(InvalidArgumentError, match=rf"^kv_connector_extra_config\['{key_name}'\]: .*{reason}"):
        scheduler_manager(KvtierOffloadingSpec(cfg))
    # A failed start-up leaves no host memory behind for the engine id.
    assert engine_state(cfg.engine_id) is None


def test_disk_max_write_backlog_bounds_the_disk_layers_write_throughs(tmp_path):
    from kvtier_rs.integrations.vllm.spec import KvtierOffloadingSpec

    extra = {"cpu_bytes_to_use": 4 * 32768, "disk_root": str(tmp_path), "disk_bytes_to_use": "1MiB"}
    for given, want in (({}, 1024), ({"disk_max_write_backlog": 3}, 3)):
        mgr = scheduler_manager(KvtierOffloadingSpec(_offloading_config({**extra, **given})))
        try:
            assert mgr.lower.layer("disk").stager.max_write_backlog == want
        finally:
            mgr.shutdown()
    # A batch above the bound is dropped and counted, never queued.
    mg, disk = _disk_only(tmp_path / "small", 0, disk_max_write_backlog=1)
    layer = mg.lower.layer("disk")
    store(mg, [key(50), key(51)])
    mg.on_schedule_end(None)
    assert layer.stager.counters.writes_dropped_backlog == 2
    assert disk.contains([key(50), key(51)]) == [False, False]
    # Exported by reason (every reason at zero in the first report), as deltas.
    drops = m.PREFIX + m.WRITE_DROPS
    assert mg.get_stats().data["data"][drops] == {
        ("disk", reason): 2 if reason == "backlog" else 0 for reason in m.WRITE_DROP_REASONS
    }
    store(mg, [key(52), key(53)])
    mg.on_schedule_end(None)
    assert mg.get_stats().data["data"][drops] == {("disk", "backlog"): 2}


def test_data_parallel_replicas_get_a_disk_directory_each(tmp_path):
    # Before: both replicas derived one directory and the second failed to start
    # (DirectoryLockedError), though vLLM's spec accepts the set-up.
    from kvtier_rs.integrations.vllm.spec import KvtierOffloadingSpec

    extra = {"cpu_bytes_to_use": 4 * 32768, "disk_root": str(tmp_path), "disk_bytes_to_use": "1MiB"}
    managers = [
        scheduler_manager(KvtierOffloadingSpec(_offloading_config(extra, dp_index=i, dp_size=2))) for i in (0, 1)
    ]
    try:
        dirs = sorted(p.name for p in tmp_path.iterdir())
        assert len(dirs) == 2
        assert [d.split("_dp")[1][0] for d in dirs] == ["0", "1"]
    finally:
        for mgr in managers:
            mgr.shutdown()
    # A replica restarted with the same index reopens its own directory.
    again = scheduler_manager(KvtierOffloadingSpec(_offloading_config(extra, dp_index=1, dp_size=2)))
    again.shutdown()
    assert sorted(p.name for p in tmp_path.iterdir()) == dirs


def test_disk_directories_differ_by_parallelism_and_layout():
    # The bytes of a chunk depend on how the KV cache is split over workers (a TP=2 row holds
    # each worker's half of the heads in turn, a PP=2 row each worker's layers) and on the host
    # layout: deployments that differ in these must never share a directory, even when their
    # rows have the same size. Before: the digest left them out, so all of these were one.
    from kvtier_rs.integrations.vllm.tier_identity import tier_dir

    configs = {
        "tp1": _offloading_config({}),
        "tp2": _offloading_config({}, tp=2),
        "pp2": _offloading_config({}, pp=2),
        "tp2pp2": _offloading_config({}, tp=2, pp=2),
        "pcp2": _offloading_config({}, pcp=2),
        "dcp2": _offloading_config({}, tp=2, dcp=2),
        "replicated": _offloading_config({}, tp=2, replicated=True),
        "canonical": _offloading_config({}, canonical=True),
    }
    dirs = {name: tier_dir("/r", cfg, 32768) for name, cfg in configs.items()}
    assert len(set(dirs.values())) == len(dirs), dirs
    # Same scheme otherwise: <model>_<host format>_<12 hex digits>, stable for one deployment.
    assert re.fullmatch(r"tiny_llama_f2_[0-9a-f]{12}", dirs["tp1"].name)
    assert tier_dir("/r", _offloading_config({}), 32768) == dirs["tp1"]


def _disk_tier_of(root, config, view):
    """KvtierDiskTier under `root` for an engine of `config`, over `view` as vLLM's primary rows."""
    import types

    from kvtier_rs.integrations.vllm.secondary import KvtierDiskTier

    spec = types.SimpleNamespace(config=config)
    return KvtierDiskTier(spec, view, "KvtierDiskTier", None, root_dir=root, capacity_bytes="1MiB")


def test_a_disk_directory_of_another_parallel_layout_is_never_read(tmp_path):
    # KvtierDiskTier runs under vLLM's tiering spec with any TP/PP: a TP=2 deployment reopening
    # the root a TP=1 one wrote (same model, same row size) must find nothing. Before: it
    # recovered the TP=1 blocks and served them, bytes laid out for another split (wrong KV).
    import mmap

    from vllm.v1.kv_offload.tiering.base import TransferJob

    mm = mmap.mmap(-1, 8 * 32768)
    mm[:32768] = bytes(range(256)) * 128  # row 0: the chunk to write
    view = memoryview(mm).cast("B", (8, 32768))
    t = _disk_tier_of(tmp_path, _offloading_config({}), view)
    t.submit_store(TransferJob(1, [key(1)], np.array([0]), False, ctx()))
    t.drain_jobs()
    assert [r.success for r in t.get_finished_jobs()] == [True]
    assert t.lookup(key(1), ctx()) is LookupResult.HIT
    t.shutdown()
    for other in (_offloading_config({}, tp=2), _offloading_config({}, pp=2), _offloading_config({}, canonical=True)):
        t = _disk_tier_of(tmp_path, other, view)
        assert t.lookup(key(1), ctx()) is LookupResult.MISS, other.parallel
        assert t.disk.stats()["recovered_blocks"] == 0
        t.shutdown()
    t = _disk_tier_of(tmp_path, _offloading_config({}), view)  # the same deployment again
    assert t.lookup(key(1), ctx()) is LookupResult.HIT
    t.shutdown()
    view.release()
    mm.close()


def test_a_directory_named_by_the_previous_digest_is_not_found(tmp_path):
    # Directories written before the digest covered TP/PP and the layout may hold blocks of
    # any of them: a deployment must not adopt one, whatever its own parallel layout. Every
    # new digest covers fields the old ones lacked, so none equals an old one; the old
    # directory is simply not found (and left alone).
    import mmap

    from kvtier_rs import DiskTier, HostPool

    old = tmp_path / "tiny_llama_9c4e1767dc60"  # what the previous digest named this config
    pool = HostPool(32768, 32768)
    with DiskTier(str(old), 1 << 20, 32768, admission="always", engine="pool") as d:
        assert d.wait(d.submit_write([key(1)], pool, [0]).job_id, WAIT_S) is not None
    mm = mmap.mmap(-1, 8 * 32768)
    view = memoryview(mm).cast("B", (8, 32768))
    t = _disk_tier_of(tmp_path, _offloading_config({}), view)
    assert t.disk.path.parent == old.parent and t.disk.path != old
    assert t.lookup(key(1), ctx()) is LookupResult.MISS
    t.shutdown()
    view.release()
    mm.close()
    with DiskTier(str(old), 1 << 20, 32768, admission="always", engine="pool") as d:
        assert d.contains([key(1)]) == [True]


def test_a_cascade_with_nothing_to_write_leaves_no_disk_job_behind(tmp_path):
    # A cascade whose keys are all on disk already (or refused by admission or a full device)
    # still makes a disk job, which the tier finishes at once. Before: KvtierDiskTier reported
    # the vLLM job but never took the disk job's result, and polled the disk only while a real
    # job was tracked, so one result per such cascade piled up in the tier (for good, on a
    # disk that refuses everything).
    import mmap

    from vllm.v1.kv_offload.tiering.base import TransferJob

    mm = mmap.mmap(-1, 8 * 32768)
    view = memoryview(mm).cast("B", (8, 32768))
    t = _disk_tier_of(tmp_path, _offloading_config({}), view)
    t.submit_store(TransferJob(1, [key(1)], np.array([0]), False, ctx()))
    t.drain_jobs()
    assert [r.success for r in t.get_finished_jobs()] == [True]
    for job in range(2, 7):  # key(1) is on disk: nothing to write
        t.submit_store(TransferJob(job, [key(1)], np.array([0]), False, ctx()))
    assert [r.job_id for r in t.get_finished_jobs()] == [2, 3, 4, 5, 6]
    assert not t.has_pending_work()
    t.drain_jobs()
    assert t.disk.poll() == [], "finished disk jobs left in the tier"
    t.shutdown()
    view.release()
    mm.close()


@pytest.mark.parametrize(
    ("kw", "key_name"),
    [
        ({"locality": "MARS"}, "locality"),
        ({"locality": "local"}, "locality"),
        ({"queue_depth": "16"}, "queue_depth"),
        ({"queue_depth": 4.5}, "queue_depth"),
        ({"queue_depth": 0}, "queue_depth"),
        ({"queue_depth": 10**6}, "queue_depth"),
        ({"io_engine": ["pool"]}, "io_engine"),
        ({"root": "/x"}, "root"),  # unknown key: a TypeError from the signature before
        ({"root_dir": "/tmp/a\x00b"}, "root_dir"),
        ({"root_dir": "FILE"}, "root_dir"),  # a DiskIoError naming only the path before
        ({"capacity_bytes": 10}, "capacity_bytes"),  # the core's `capacity_bytes`, no prefix
        ({"capacity_bytes": 2**62}, "capacity_bytes"),
    ],
)
def test_bad_tiering_disk_tier_option_names_the_key(tmp_path, kw, key_name):
    import mmap
    import types

    from kvtier_rs.integrations.vllm.secondary import KvtierDiskTier

    (tmp_path / "file").write_bytes(b"x")
    mm = mmap.mmap(-1, 8 * 32768)
    view = memoryview(mm).cast("B", (8, 32768))
    spec = types.SimpleNamespace(config=_offloading_config({"cpu_bytes_to_use": 8 * 32768}))
    opts = {"root_dir": str(tmp_path / "disk"), "capacity_bytes": "1MiB"}
    opts.update({k: v.replace("FILE", str(tmp_path / "file")) if isinstance(v, str) else v for k, v in kw.items()})
    with pytest.raises(
        InvalidArgumentError, match=rf"^secondary_tiers\[type=KvtierDiskTier\]\['{key_name}'\]: "
    ) as refused:
        KvtierDiskTier(spec, view, "KvtierDiskTier", None, **opts)
    # While the error (and so its traceback and the half-built tier) is alive, as when an
    # engine logs or re-raises it, the tier holds no export of vLLM's region: vLLM can unmap it.
    assert refused.value is not None
    view.release()
    mm.close()


def test_tiering_disk_tier_takes_a_path_and_an_enum_locality(tmp_path):
    import mmap
    import types

    from vllm.v1.kv_offload.base import Locality

    from kvtier_rs.integrations.vllm.secondary import KvtierDiskTier

    mm = mmap.mmap(-1, 8 * 32768)
    view = memoryview(mm).cast("B", (8, 32768))
    spec = types.SimpleNamespace(config=_offloading_config({"cpu_bytes_to_use": 8 * 32768}))
    for loc, want in ((None, Locality.LOCAL), ("REMOTE", Locality.REMOTE), (Locality.REMOTE, Locality.REMOTE)):
        t = KvtierDiskTier(spec, view, "KvtierDiskTier", None, root_dir=tmp_path, capacity_bytes="1MiB", locality=loc)
        assert t.locality is want
        t.shutdown()


def test_good_extra_config():
    o = parse_options(
        {
            "spec_name": "KvtierOffloadingSpec",
            "cpu_bytes_to_use": "2MiB",
            "eviction_policy": "ARC",
            "disk_root": "/tmp/kv",
            "disk_bytes_to_use": "1GiB",
            "disk_io_engine": "pool",
            "cost_model": {"prefill_tokens_per_s": 1000, "disk_read_bytes_per_s": 1e9},
        }
    )
    assert (o.cpu_bytes, o.cpu_policy, o.disk_bytes, o.disk_enabled) == (2 << 20, "arc", 1 << 30, True)
    assert o.cost_model.load_beats_recompute(tokens=32, nbytes=32768)  # 33 us read vs 32 ms compute
    assert not o.cost_model.load_beats_recompute(tokens=1, nbytes=1 << 30)


def test_a_promotion_collects_finished_write_throughs_before_giving_up(tmp_path):
    # Lookups run before a step's first poll: after an idle spell, the CPU slots may be pinned
    # only by write-throughs that have finished on disk but were not collected yet. The
    # promotion collects them and goes ahead instead of reporting a miss.
    cpu, disk, layer = disk_layer(tmp_path)

    def store(keys):
        out = cpu.prepare_store(keys)
        cpu.complete_store(out.keys)
        layer.write_through(list(out.keys))

    store([b"c"])
    assert disk.wait_idle(WAIT_S)
    layer.poll()
    store([b"a", b"b"])  # evicts c from the CPU tier; a and b are pinned while written
    assert cpu.state(b"c") is None and disk.contains([b"c"]) == [True]
    assert disk.wait_idle(WAIT_S), "the write-throughs finished, nobody collected them"
    assert cpu.stats()["pinned_blocks"] == 2
    assert layer.lookup_and_promote(b"c", ReqContext(req_id="r")) == LookupResult.HIT_PENDING
    assert disk.wait_idle(WAIT_S)
    layer.poll()
    assert cpu.state(b"c")[0] == "ready"
    layer.shutdown()


def test_a_write_through_the_disk_tier_has_no_room_for_is_refused_not_raised(tmp_path):
    # complete_store (an engine hook) writes through to disk: a batch larger than the disk tier,
    # or one arriving while every disk slot is being written, is refused and counted.
    cpu, disk, layer = disk_layer(tmp_path, cpu_slots=4, disk_slots=2)
    keys = [b"a", b"b", b"c"]
    out = cpu.prepare_store(keys)
    cpu.complete_store(out.keys)
    layer.write_through(keys)  # three blocks for a two-slot disk tier
    assert layer.stager.counters.writes_refused == 3
    assert cpu.stats()["pinned_blocks"] == 0, "refused blocks are unpinned"
    layer.write_through(keys[:2])
    layer.write_through(keys[2:])  # both disk slots still being written (or just written)
    layer.drain()
    assert cpu.stats()["pinned_blocks"] == 0
    layer.shutdown()


def test_a_disk_hit_is_reported_as_one_after_prepare_load(tmp_path):
    # vLLM asks get_load_source after prepare_load (update_state_after_alloc, then
    # get_external_cache_hit_sources): the answer must still be DISK for a promoted chunk.
    from vllm.v1.kv_offload.base import CacheHitSource

    mg, disk = disk_backed(tmp_path)
    r = ctx("r")
    mg.on_new_request(r)
    assert mg.lookup(key(1), r) == LookupResult.HIT_PENDING
    assert disk.wait_idle(WAIT_S)
    mg.on_schedule_end(None)
    assert mg.lookup(key(1), r) == LookupResult.HIT
    mg.prepare_load([key(1)], r)
    assert mg.get_load_source(key(1), r) == CacheHitSource.DISK
    mg.complete_load([key(1)], r)
    assert mg.get_load_source(key(1), r) == CacheHitSource.HOST, "served: it is a CPU block now"
    assert mg.counters.loads_disk == 1
    mg.shutdown()


def test_events_of_the_lower_tier_keep_their_place_in_the_stream(tmp_path):
    # A promotion lands (the disk layer queues "stored in CPU"), then prepare_store evicts that
    # chunk ("removed"): take_events must yield them in that order, or a consumer replaying the
    # stream believes the chunk is still in the CPU tier.
    mg, disk = disk_backed(tmp_path, events=True)
    cpu, k = mg.cpu_index, key(1)
    list(mg.take_events())
    r = ctx("r")
    mg.on_new_request(r)
    assert mg.lookup(k, r) == LookupResult.HIT_PENDING
    mg.on_request_finished(r)  # aborted while the promotion runs
    assert disk.wait_idle(WAIT_S)
    mg.on_schedule_end(None)  # the promotion lands
    out = mg.prepare_store([key(4), key(5)], ctx("s"))
    assert k in out.evicted_keys
    about_k = [("removed" if e.removed else "stored", e.medium) for e in mg.take_events() if k in e.keys]
    assert about_k == [("stored", Medium.CPU), ("removed", Medium.CPU)]
    assert cpu.state(k) is None
    mg.shutdown()


def test_a_promotion_never_evicts_a_chunk_that_answered_hit_to_the_same_request(tmp_path):
    # A hybrid model: a full-attention group 0 and a sliding-window group 1 (a window of two
    # chunks), four chunks each. vLLM looks up group 0's chunks (all HIT), then scans group 1
    # backward: its last chunk is on disk only, so the lookup starts a promotion (HIT_PENDING)
    # whose CPU slot comes from an eviction; the chunk before misses, which voids that window;
    # chunks 1 and 0 hit. vLLM's scan then reports two hit chunks *without* deferring the
    # request, and loads chunks 0-1 of every group at once. Before: the promotion evicted group
    # 0's chunk 0 (the least recent chunk), which had answered HIT, and prepare_load raised
    # NotReadyError in the engine's scheduler.
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler

    cpu, disk, layer = disk_layer(tmp_path, cpu_slots=7)
    mg = KvtierOffloadingManager(cpu, lower=layer)
    full, window = [key(i, 0) for i in range(4)], [key(i, 1) for i in range(4)]
    other = key(9)
    # window[3] goes to disk only; then, least recent first, the chunks in the CPU tier.
    for k in (window[3], *full, other, window[0], window[1]):
        store(mg, [k])
        assert disk.wait_idle(WAIT_S)
        mg.on_schedule_end(None)  # collects the write-through: nothing stays pinned
    assert cpu.state(window[3]) is None and disk.contains([window[3]]) == [True]

    r = ctx("hybrid")
    mg.on_new_request(r)
    assert [mg.lookup(k, r) for k in full] == [LookupResult.HIT] * 4
    # vLLM's own sliding-window scan (it reads nothing of the scheduler but its manager).
    scan = OffloadingConnectorScheduler._sliding_window_lookup
    assert scan(SimpleNamespace(manager=mg), window, 2, r) == 2, "not deferred: vLLM loads now"
    assert mg.lower.layer("disk").stager.counters.promotions_submitted == 1, "the scan promoted window[3]"
    loads = [*full[:2], *window[:2]]
    spec = mg.prepare_load(loads, r)  # raised NotReadyError before
    assert len(set(spec.block_ids.tolist())) == 4
    assert cpu.state(other) is None, "the promotion evicted a chunk the request had not hit"
    mg.complete_load(loads, r)
    mg.on_request_finished(r)
    mg.shutdown()


def test_a_request_s_hits_are_held_once_however_many_chunks_it_promotes(tmp_path):
    # A prompt whose head is in the CPU tier and whose tail is on disk: vLLM's scan answers HIT
    # for the head, then each tail chunk starts a promotion. The head is pinned once, when the
    # first promotion is to start, and held until the request's lookups end (not pinned and
    # unpinned around every promotion: a long prompt would cost hits x promotions).
    cpu, disk, layer = disk_layer(tmp_path, cpu_slots=8)
    mg = KvtierOffloadingManager(cpu, lower=layer)
    tail, other, head = [key(i) for i in range(3)], [key(i) for i in range(10, 13)], [key(i) for i in range(20, 25)]
    for k in (*tail, *other, *head):  # the tail leaves the CPU tier (least recent)
        store(mg, [k])
        assert disk.wait_idle(WAIT_S)
        mg.on_schedule_end(None)
    assert [cpu.state(k) for k in tail] == [None] * 3
    r = ctx("long")
    pins = cpu.stats()["pins"]
    assert [mg.lookup(k, r) for k in head] == [LookupResult.HIT] * 5
    assert [mg.lookup(k, r) for k in tail] == [LookupResult.HIT_PENDING] * 3
    assert cpu.stats()["pins"] - pins == len(head)
    assert [cpu.state(k) for k in other] == [None] * 3, "the promotions evicted the others"
    mg.on_schedule_end(None)  # the step ends: the request's lookups are over
    assert all(cpu.state(k)[1] == 0 for k in head), "still held after the lookups ended"
    mg.shutdown()


def test_a_request_that_excludes_storage_is_not_served_from_disk(tmp_path):
    # kv_load_tiers [{"medium": "CPU"}] becomes ReqContext.load_tier_filter: vLLM's own tiering
    # skips the storage tiers it excludes, and so does kvtier's disk tier (Medium.STORAGE).
    from vllm.v1.kv_offload.base import TierFilter, TierMatcher

    mg, disk = disk_backed(tmp_path)
    cpu_only = ReqContext(req_id="c", load_tier_filter=TierFilter(matchers=(TierMatcher(medium=Medium.CPU),)))
    mg.on_new_request(cpu_only)
    assert mg.lookup(key(1), cpu_only) == LookupResult.MISS
    assert mg.lower.layer("disk").stager.counters.promotions_submitted == 0
    anyone = ctx("a")
    mg.on_new_request(anyone)
    assert mg.lookup(key(1), anyone) == LookupResult.HIT_PENDING
    mg.shutdown()


def test_a_directory_of_an_earlier_format_is_never_opened_and_is_named_in_the_log(tmp_path, caplog, monkeypatch):
    # Directories named without a host format were written by releases whose scheduler could
    # persist memory no worker filled (zeros with valid checksums): never read again.
    import logging

    from kvtier_rs.integrations.vllm.spec import KvtierOffloadingSpec

    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    old = tmp_path / "tiny_llama_0123456789ab"
    old.mkdir()
    (old / "kvtier-disk.meta").write_text("left by an earlier release\n")
    extra = {"cpu_bytes_to_use": 4 * 32768, "disk_root": str(tmp_path), "disk_bytes_to_use": "1MiB"}
    mgr = scheduler_manager(KvtierOffloadingSpec(_offloading_config(extra)))
    try:
        new = sorted(p.name for p in tmp_path.iterdir() if p != old)
        assert len(new) == 1 and "_f2_" in new[0]
        assert "ignoring disk-tier directory tiny_llama_0123456789ab" in caplog.text, caplog.text
        assert (old / "kvtier-disk.meta").read_text() == "left by an earlier release\n", "left alone"
    finally:
        mgr.shutdown()


def test_the_tiering_specs_disk_tier_also_names_a_directory_of_an_earlier_format(tmp_path, caplog, monkeypatch):
    import logging
    import mmap

    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    old = tmp_path / "tiny_llama_0123456789ab"
    old.mkdir()
    (old / "kvtier-disk.meta").write_text("left by an earlier release\n")
    mm = mmap.mmap(-1, 8 * 32768)
    tier = _disk_tier_of(tmp_path, _offloading_config({}), memoryview(mm).cast("B", (8, 32768)))
    try:
        assert "ignoring disk-tier directory tiny_llama_0123456789ab" in caplog.text, caplog.text
        assert (old / "kvtier-disk.meta").read_text() == "left by an earlier release\n", "left alone"
    finally:
        tier.shutdown()
