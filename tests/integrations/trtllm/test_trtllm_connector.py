"""kvtier's TensorRT-LLM connector driven the way TensorRT-LLM's executor drives it
(tests/support/trtllm/driver.py), on CPU, with the real orchestrator, tiers and transfer engine."""

from __future__ import annotations

import datetime
import functools
import pickle
import re
import sys
import threading
import time
import types

import pytest
import torch
from support.disk import HeldReads
from support.trtllm.driver import (
    Engine,
    Request,
    RequestData,
    Retention,
    SchedulerOutput,
    TokenRange,
    llm_args,
    standin_engine_hash,
)

from kvtier_rs._core import BlockIndex, InvalidArgumentError, KvTierError
from kvtier_rs.integrations import trtllm
from kvtier_rs.integrations.trtllm import identity
from kvtier_rs.integrations.trtllm.config import parse_options
from kvtier_rs.integrations.trtllm.metadata import KvtierConnectorMetadata, LoadSpec, SaveSpec, block_retention
from kvtier_rs.tiers import host as host_tier
from kvtier_rs.transfer import CpuTransferEngine

TPB = 4
# How long a test waits for what must happen (a copy to land, a thread to get somewhere): far
# beyond any stall of a loaded machine, and only spent when the product is broken.
WAIT_S = 60.0


def wait_for(done, what):
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, f"{what} within {WAIT_S} s"
        time.sleep(0.002)


def make(
    tmp_path,
    *,
    cpu_blocks=16,
    disk=False,
    engine_factory=None,
    block_hasher=None,
    keep_load_results=None,
    request_data="v1",
    **extra,
):
    # One block = 3 layers * 2 * 4 tokens * 24 values * 2 bytes = 1152 bytes; slots are 4 KiB.
    cfg = {"cpu_bytes": cpu_blocks * 4096, "io_engine": "cpu", "namespace": f"t-{tmp_path.name}", **extra}
    if disk:
        cfg.update(disk_root=str(tmp_path / "disk"), disk_bytes=256 * 8192, disk_io_engine="pool")
    sched_cls = type("S", (trtllm.KvtierScheduler,), {"kvtier_config": cfg})
    attrs = {"kvtier_config": cfg, "engine_factory": engine_factory}
    if keep_load_results is not None:
        attrs["keep_load_results"] = keep_load_results
    work_cls = type("W", (trtllm.KvtierWorker,), attrs)
    args = llm_args(TPB)
    worker = work_cls(args)
    eng = Engine(sched_cls(args), worker, tokens_per_block=TPB, block_hasher=block_hasher, request_data=request_data)
    return eng


@pytest.fixture
def engines():
    made = []
    yield made
    for e in made:
        e.worker.close()


def prompt(seed, n):
    return [seed * 1000 + i for i in range(n)]


def test_imports_without_tensorrt_llm_and_says_what_is_missing():
    assert "tensorrt_llm" not in sys.modules
    assert trtllm.BASE_MODULE is None
    with pytest.raises(ImportError, match="needs TensorRT-LLM"):
        trtllm.connector_config()


def test_second_request_sharing_a_prefix_is_matched_and_loaded(tmp_path, engines):
    eng = make(tmp_path)
    engines.append(eng)
    shared = prompt(1, 12)  # 3 full blocks
    eng.run_request(Request(1, shared + [7, 8, 9]))
    # Same 12-token prefix, different tail: 3 blocks from kvtier = 12 tokens.
    r2 = Request(2, shared + [5, 6])
    eng.step([r2])
    assert eng.matched[2] == 12
    assert eng.worker.counts["loaded_blocks"] == 3  # and the driver checked every loaded byte
    # A prompt that is entirely cached still recomputes its last token: 2 blocks, not 3.
    r3 = Request(3, list(shared))
    eng.step([r3])
    assert eng.matched[3] == 8
    # TensorRT-LLM matched 1 block itself: kvtier offers only what lies beyond it.
    r4 = Request(4, shared + [1])
    eng.step([r4], gpu_matched={4: 4})
    assert eng.matched[4] == 8
    # A different cache salt never shares.
    r5 = Request(5, shared + [1], cache_salt="tenant-b")
    eng.step([r5])
    assert eng.matched[5] == 0


def test_partial_native_match_is_topped_up_to_a_block_boundary(tmp_path, engines):
    eng = make(tmp_path)
    engines.append(eng)
    shared = prompt(2, 12)
    eng.run_request(Request(1, shared + [3]))
    r = Request(2, shared + [4])
    eng.step([r], gpu_matched={2: 6})  # partial reuse: 1.5 blocks
    assert eng.matched[2] == 6  # up to 12 tokens


def _evicted_to_disk(eng, first):
    """Run `first` as a request, then push its blocks out of the 4-slot CPU tier to disk."""
    eng.run_request(Request(1, first + [1]))
    for i in range(4):
        eng.worker.tiers.orchestrator.drain()  # write-throughs pin slots until done
        eng.run_request(Request(10 + i, prompt(40 + i, 12) + [1]))
    orch = eng.worker.tiers.orchestrator
    orch.drain()
    return orch


def test_disk_max_write_backlog_bounds_the_write_throughs(tmp_path, engines):
    # A step's offload of 3 blocks is one write-through: above a backlog of 2 it is dropped
    # and counted, never queued; the default (1024) takes it.
    for backlog, dropped in ((2, 3), (None, 0)):
        eng = make(
            tmp_path / str(backlog),
            cpu_blocks=8,
            disk=True,
            **({} if backlog is None else {"disk_max_write_backlog": backlog}),
        )
        engines.append(eng)
        eng.run_request(Request(1, prompt(3, 12) + [1]))
        orch = eng.worker.tiers.orchestrator
        orch.drain()
        assert orch.stager.max_write_backlog == (backlog or 1024)
        writes = orch.stats()["tiers"]["disk"]["writes"]
        assert (writes["dropped_backlog"], writes["completed"]) == (dropped, 3 - dropped), writes


def test_loads_are_byte_identical_after_eviction_to_disk(tmp_path, engines):
    eng = make(tmp_path, cpu_blocks=4, disk=True)
    engines.append(eng)
    first = prompt(3, 12)
    orch = _evicted_to_disk(eng, first)
    plan_before = orch.stats()["tiers"]["disk"]["promotions"]
    cpu_before = orch.stats()["tiers"]["cpu"]["promotions"]
    r = Request(2, first + [2])
    eng.step([r])
    assert eng.matched[2] == 12
    st = orch.stats()["tiers"]
    from_disk = st["disk"]["promotions"] - plan_before
    assert (from_disk, st["cpu"]["promotions"] - cpu_before) == (3, 0)
    # The forward pass verified every token's KV at every layer; check the rows directly too.
    for pos in range(12):
        for layer in range(eng.layers):
            want = eng.token_kv(first[: pos + 1], layer)
            assert torch.equal(eng._slot(r.block_ids[pos // TPB], pos, layer), want)


def test_a_slow_disk_trips_the_disk_guard_and_is_back_after_the_cool_down(tmp_path, engines, caplog):
    """The disk tier's reads made 300 ms slow for two requests' loads: they trip the disk guard
    (budget 50 ms); the next request's disk hits are recomputed, not waited on; after the
    cool-down the tier, fast again, serves the one after. The driver's forward pass checks
    every token's KV at every layer throughout."""
    recover_s = 5.0
    rule = {"p99_ms": 50, "window_s": 600, "recover_s": recover_s, "min_samples": 2}
    eng = make(tmp_path, cpu_blocks=4, disk=True, disk_slo_guard=rule)
    engines.append(eng)
    prompts = [prompt(60 + i, 12) for i in range(4)]
    for i, p in enumerate(prompts):
        eng.run_request(Request(1 + i, p + [1]))
        eng.worker.tiers.orchestrator.drain()  # write-throughs pin slots until done
    orch = _evicted_to_disk(eng, prompt(59, 12))
    orch.stager.disk._inject_fault("read_delay_ms:300", 6)  # the block reads of two loads
    guard = orch.guards["disk"]
    for i in (0, 1):
        eng.step([Request(20 + i, prompts[i] + [2])])
        assert eng.matched[20 + i] == 12
    assert guard.state()["state"] == "bypassed" and guard.state()["trips"] == 1
    tripped_seen = time.monotonic()
    refused = orch.stats()["tiers"]["disk"]["refused"]["guard"]
    eng.step([Request(22, prompts[2] + [2])])
    assert eng.matched[22] == 0, "a bypassed tier's hits are recomputed"
    assert orch.stats()["tiers"]["disk"]["refused"]["guard"] == refused + 3
    time.sleep(max(0.0, recover_s - (time.monotonic() - tripped_seen)) + 0.2)
    orch.drain()  # request 22's write-throughs pin CPU slots until done; 23 stages through them
    eng.step([Request(23, prompts[3] + [2])])
    assert eng.matched[23] == 12, "after the cool-down the tier is re-probed and serves"
    assert guard.state()["state"] == "active" and guard.state()["trips"] == 1
    assert "SLO guard tripped: the disk tier" in caplog.text and "disk tier is back in service" in caplog.text


def test_a_disk_hit_with_no_cpu_slot_to_stage_through_is_recomputed_not_promised(tmp_path, engines):
    # TensorRT-LLM cannot be told that a load fell short, so a promised disk hit that then found
    # no CPU slot stopped the engine (KvTierError in the forward pass). Now the scheduler
    # promises only what it could reserve.
    eng = make(tmp_path, cpu_blocks=4, disk=True)
    engines.append(eng)
    first = prompt(3, 12)
    orch = _evicted_to_disk(eng, first)
    index = orch.host.index
    resident = [k for k, state, _, _ in index.entries() if state == "ready"]
    index.pin_for_load(resident)  # every CPU slot held (by loads of other requests, say)
    r = Request(2, first + [2])
    eng.step([r])  # the forward pass checks every token's KV: the request recomputed its prefix
    assert eng.matched[2] == 0
    st = orch.stats()
    assert st["tiers"]["disk"]["hits"] >= 3 and st["tiers"]["disk"]["promotions"] == 0
    assert st["load_released"] == 0 and st["load_failed"] == 0
    index.unpin(resident)
    assert index.stats()["pinned_blocks"] == 0


def test_promised_disk_hits_are_read_from_the_answer_on(tmp_path, engines):
    # The reservation starts the disk read when the scheduler answers; the CPU slots it reads
    # into are neither readable nor evictable until verified.
    eng = make(tmp_path, cpu_blocks=4, disk=True)
    engines.append(eng)
    first = prompt(3, 12)
    orch = _evicted_to_disk(eng, first)
    r = Request(2, first + [2])
    assert eng.sched.get_num_new_matched_tokens(r, 0) == (12, False)
    assert orch.host.index.stats()["writing_blocks"] == 3 and orch.stager.reads_in_flight == 1
    # Asked again before it was scheduled: the reservation goes back, but its read still lands
    # in the CPU tier, so the second answer is served from there.
    eng.sched._release_reservation(eng.sched._reqs[2])
    orch.drain()
    cpu_before = orch.stats()["tiers"]["cpu"]["promotions"]
    eng.step([r])  # the forward pass checks every loaded token's KV
    st = orch.stats()
    assert eng.matched[2] == 12 and st["tiers"]["cpu"]["promotions"] - cpu_before == 3
    assert st["load_released"] == 3 and orch.host.index.stats()["pinned_blocks"] == 0


def _matched_not_scheduled(tmp_path, engines, seed):
    """An engine whose request 2 was matched (3 CPU hits reserved) and not scheduled yet."""
    eng = make(tmp_path)
    engines.append(eng)
    shared = prompt(seed, 12)
    eng.run_request(Request(1, shared + [1]))
    index = eng.worker.tiers.orchestrator.host.index
    r = Request(2, shared + [2])
    assert eng.sched.get_num_new_matched_tokens(r, 0) == (12, False)
    assert index.stats()["pinned_blocks"] == 3
    return eng, index, r


def test_a_load_that_cannot_bind_gives_the_steps_other_reservations_back(tmp_path, engines):
    eng, index, _ = _matched_not_scheduled(tmp_path, engines, 12)
    held = eng.sched._reqs[2].reservation
    keys = tuple(eng.sched._reqs[2].load_keys)
    meta = KvtierConnectorMetadata(
        0,
        loads=(
            LoadSpec(9, keys[:1], (20,), ("trtllm", 9, 99)),  # a reservation nobody holds
            LoadSpec(2, keys, (21, 22, 23), held),
        ),
    )
    eng.worker.bind_connector_meta(meta)
    with pytest.raises(InvalidArgumentError, match="no unbound reservation"):
        eng.worker.start_load_kv(None)
    assert index.stats()["pinned_blocks"] == 0, "the second load's pins were given back"


def test_an_unscheduled_request_gives_its_reservation_back(tmp_path, engines):
    eng, index, r = _matched_not_scheduled(tmp_path, engines, 5)
    # Asked again (a reset): the first reservation goes, a new one is made.
    assert eng.sched.get_num_new_matched_tokens(r, 0) == (12, False)
    assert index.stats()["pinned_blocks"] == 3
    # Finished (cancelled) before it was ever scheduled: nothing stays pinned.
    assert eng.sched.request_finished(r, []) is False
    assert index.stats()["pinned_blocks"] == 0
    assert eng.worker.tiers.orchestrator.stats()["load_released"] == 6


def test_block_below_min_priority_is_not_offloaded(tmp_path, engines):
    eng = make(tmp_path, min_offload_priority=30)
    engines.append(eng)
    toks = prompt(5, 16)
    ret = Retention([TokenRange(0, 8, 80), TokenRange(8, None, 10)])
    eng.run_request(Request(1, toks + [1], retention=ret))
    assert eng.sched.counts["below_min_priority_blocks"] >= 2
    # Only the two priority-80 blocks reached the CPU tier (no copy was even made of the others).
    assert len(eng.worker.tiers.orchestrator.host.index.entries()) == 2
    assert eng.worker.counts["offloaded_blocks"] == 2
    r2 = Request(2, toks + [2])
    eng.step([r2])
    assert eng.matched[2] == 8  # the two priority-80 blocks, not the priority-10 ones


def test_priorities_order_eviction_and_durations_expire(tmp_path, engines, monkeypatch):
    # The CPU index runs on a manual clock: the 300 ms lapse when the test moves the clock on,
    # never while a slow machine is still running the first half.
    with monkeypatch.context() as m:
        m.setattr(host_tier, "BlockIndex", functools.partial(BlockIndex, manual_clock=True))
        eng = make(tmp_path, cpu_blocks=4)
    engines.append(eng)
    keep = prompt(6, 8)
    ret = Retention([TokenRange(0, None, 90, datetime.timedelta(milliseconds=300))])
    eng.run_request(Request(1, keep + [1], retention=ret))
    for i in range(3):  # default-priority chains churn the rest of the tier
        eng.run_request(Request(10 + i, prompt(60 + i, 8) + [1]))
    # The same claim again: a default-priority one would renew the blocks to 35 (a later claim
    # overrides), and what follows would pass whether or not durations lapse.
    r = Request(2, keep + [2], retention=ret)
    eng.step([r])
    assert eng.matched[2] == 8, "priority-90 blocks must outlive default-priority ones"
    eng.step(finish=[2])
    eng.worker.tiers.orchestrator.drain()
    eng.poll_finished()
    # The duration lapses: the blocks fall back to 35 and age out like the rest.
    eng.worker.tiers.orchestrator.host.index.advance_clock(0.35)
    for i in range(3):
        eng.run_request(Request(20 + i, prompt(80 + i, 8) + [1]))
    r = Request(3, keep + [3])
    eng.step([r])
    assert eng.matched[3] == 0


def _claimed_twice(tmp_path, engines, seed, second_priority):
    """A 4-slot CPU tier whose 2-block prefix was claimed at priority 90, then again (request 2)
    at `second_priority`; returns (engine, prefix tokens)."""
    eng = make(tmp_path, cpu_blocks=4)
    engines.append(eng)
    keep = prompt(seed, 8)
    eng.run_request(Request(1, keep + [1], retention=Retention([TokenRange(0, None, 90, None)])))
    eng.run_request(Request(2, keep + [2], retention=Retention([TokenRange(0, None, second_priority, None)])))
    return eng, keep


def test_a_later_claim_overrides_the_priority_of_blocks_already_held(tmp_path, engines):
    # TensorRT-LLM: "a later claim with a new priority always overrides the old one". The
    # second request's blocks are all in the CPU tier already, so nothing new is stored.
    # 31: above min_offload_priority (30), so the blocks are offered again, and below 35.
    eng, keep = _claimed_twice(tmp_path, engines, 7, 31)
    assert eng.matched[2] == 8
    for i in range(2):  # two default-priority chains need the whole 4-slot tier
        eng.run_request(Request(10 + i, prompt(70 + i, 8) + [1]))
    r = Request(3, keep + [3])
    eng.step([r])
    assert eng.matched[3] == 0, "renewed to priority 31, the chain goes before default-priority ones"
    assert eng.worker.tiers.orchestrator.host.index.stats()["renewals"] >= 2


def test_a_later_claim_below_the_offload_minimum_still_renews_what_is_held(tmp_path, engines):
    # Priority 10 is below min_offload_priority (30): the blocks are not offered again, but the
    # copies kvtier holds from the first claim must not keep priority 90.
    eng, keep = _claimed_twice(tmp_path, engines, 9, 10)
    for i in range(2):
        eng.run_request(Request(10 + i, prompt(80 + i, 8) + [1]))
    index = eng.worker.tiers.orchestrator.host.index
    assert index.stats()["renewals"] == 2, "both held blocks take the new claim's priority"
    r = Request(3, keep + [3])
    eng.step([r])
    assert eng.matched[3] == 0, "renewed to priority 10, the chain goes before default-priority ones"


def test_held_blocks_renewed_below_the_minimum_keep_the_head_more_recent(tmp_path, engines):
    eng, keep = _claimed_twice(tmp_path, engines, 11, 10)
    head, tail = eng.sched.identity.extend(None, keep, 0, 2, None, None)
    index = eng.worker.tiers.orchestrator.host.index
    assert index.lookup_prefix([head, tail]) == 2
    # One eviction at level 10 must take the chain's tail: a prefix without its head is useless.
    out = index.prepare_store([b"x" * 16, b"y" * 16, b"z" * 16], priority=35)
    assert list(out.evicted) == [tail]
    index.complete_store(out.keys, False)


def test_blocks_completed_in_later_chunks_of_a_low_priority_claim_are_renewed_too(tmp_path, engines):
    # The driver schedules a prompt in one chunk; here the scheduler sees its blocks complete
    # one at a time, as chunked prefill reports them.
    eng = make(tmp_path, cpu_blocks=4)
    engines.append(eng)
    keep = prompt(13, 8)
    eng.run_request(Request(1, keep + [1], retention=Retention([TokenRange(0, None, 90, None)])))
    index = eng.worker.tiers.orchestrator.host.index
    r = Request(2, keep + [2], retention=Retention([TokenRange(0, None, 10, None)]))
    eng.sched.get_num_new_matched_tokens(r, 0)
    state = eng.sched._reqs[2]
    state.block_ids, state.priorities = [5, 6, 7], [None, None, None]
    before = index.stats()["renewals"]
    assert eng.sched._save_spec(2, state, 1) is None  # block 0: below the minimum, renewed
    assert index.stats()["renewals"] - before == 1
    assert eng.sched._save_spec(2, state, 2) is None  # block 1, completed by a later chunk
    assert index.stats()["renewals"] - before == 2
    eng.sched._release_reservation(state)


def test_a_later_claim_renews_the_disk_copies_too(tmp_path, engines):
    eng = make(tmp_path, cpu_blocks=4, disk=True)
    engines.append(eng)
    keep = prompt(8, 8)
    eng.run_request(Request(1, keep + [1], retention=Retention([TokenRange(0, None, 90, None)])))
    eng.worker.tiers.orchestrator.drain()
    disk = eng.worker.tiers.orchestrator.stager.disk
    before = disk.stats()["renewals"]
    eng.run_request(Request(2, keep + [2], retention=Retention([TokenRange(0, None, 31, None)])))
    assert disk.stats()["renewals"] - before == 2


def test_a_duration_longer_than_the_index_counts_never_expires():
    # timedelta.max (~2.7 million years) is beyond the index's u64 nanosecond clock: it is passed
    # on as "no duration" (never falls back to 35), which the index accepts, not as a number it
    # would refuse.
    forever = Retention([TokenRange(0, None, 90, datetime.timedelta.max)])
    assert block_retention(forever, 64, 16, 0) == (90, None)
    ms = Retention([TokenRange(0, None, 90, 1500)])  # plain milliseconds
    assert block_retention(ms, 64, 16, 0) == (90, 1.5)
    # TensorRT-LLM does not check durations: a negative one has lapsed already.
    lapsed = Retention([TokenRange(0, None, 90, datetime.timedelta(seconds=-1))])
    assert block_retention(lapsed, 64, 16, 0) == (90, 0.0)


class GatedEngine(CpuTransferEngine):
    """The real CPU engine, whose device->host copies wait until the test opens the gate."""

    gate = threading.Event()

    def copy_now(self, direction, *args, **kwargs):
        if direction == "d2h" and not self.gate.wait(WAIT_S):
            raise RuntimeError("gate never opened")
        super().copy_now(direction, *args, **kwargs)


def test_request_with_save_in_flight_is_not_reported_early(tmp_path, engines):
    GatedEngine.gate.clear()
    eng = make(tmp_path, engine_factory=GatedEngine)
    engines.append(eng)
    r = Request(1, prompt(7, 12) + [1])
    eng.step([r])
    eng.step(finish=[1])
    assert 1 in eng.saving
    for _ in range(5):
        assert eng.poll_finished() == []
    assert eng.worker.counts["offloaded_blocks"] == 3
    GatedEngine.gate.set()
    wait_for(lambda: eng.poll_finished() == [1], "request 1 reported finished")
    assert 1 not in eng.saving
    assert eng.worker.tiers.orchestrator.stats()["tiers"]["cpu"]["stored"] == 3  # the copies succeeded


def test_layer_waits_come_before_each_layer_and_check_the_index(tmp_path, engines):
    eng = make(tmp_path)
    engines.append(eng)
    eng.step([Request(1, prompt(8, 9))])
    assert eng.layer_calls[:2] == [("wait", 0), ("save", 0)]
    with pytest.raises(InvalidArgumentError, match="layer_idx"):
        eng.worker.wait_for_layer_load(eng.layers, None)


class LayerGatedEngine(CpuTransferEngine):
    """The real CPU engine, whose host->device copies of every layer but the first wait until the
    test opens the gate: the per-layer jobs let layer 0 run before the rest has landed."""

    gate = threading.Event()

    def copy_now(self, direction, block_ids, slots, sub_blocks=None, regions=None):
        if direction == "h2d" and regions != [0] and not self.gate.wait(WAIT_S):
            raise RuntimeError("gate never opened")
        super().copy_now(direction, block_ids, slots, sub_blocks, regions)


def test_layer_zero_runs_while_later_layers_are_still_loading(tmp_path, engines, monkeypatch):
    LayerGatedEngine.gate.set()
    eng = make(tmp_path, engine_factory=LayerGatedEngine)
    engines.append(eng)
    eng.run_request(Request(1, prompt(5, 12) + [1]))  # offloaded, then the GPU copy is freed
    LayerGatedEngine.gate.clear()
    errors: list[BaseException] = []
    first = len(eng.layer_calls)
    orch = eng.worker.tiers.orchestrator
    real_poll, layer1_polls = orch.poll, []
    blocked = threading.Event()

    def poll():
        # A second poll once layer 1's wait began: its first check found layer 1 missing, so the
        # wait is holding layer 1 back (not a sleep that a slow thread may outlast).
        if ("wait", 1) in eng.layer_calls[first:]:
            layer1_polls.append(None)
            if len(layer1_polls) >= 2:
                blocked.set()
        return real_poll()

    monkeypatch.setattr(orch, "poll", poll)

    def second_request():
        try:
            eng.step([Request(2, prompt(5, 12) + [2])])
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    t = threading.Thread(target=second_request)
    t.start()
    # Until layer 1's wait blocks, or the step ends (layer 1 ran early, on KV not copied yet).
    wait_for(lambda: blocked.is_set() or not t.is_alive(), "layer 1's wait blocked or the step ended")
    # Layer 0 ran (its attention checked every loaded token's KV) while layers 1.. still copy.
    recent = eng.layer_calls[first:]
    assert recent == [("wait", 0), ("save", 0), ("wait", 1)], (recent, errors)
    assert eng.matched[2] == 12
    LayerGatedEngine.gate.set()
    t.join(WAIT_S)
    assert not t.is_alive() and not errors, errors
    assert eng.layer_calls[first:][-1] == ("save", eng.layers - 1)


def test_metadata_is_small_and_picklable(tmp_path, engines):
    eng = make(tmp_path)
    engines.append(eng)
    eng.run_request(Request(1, prompt(9, 32) + [1]))
    meta = eng.step([Request(2, prompt(9, 32) + [2])])
    assert meta.loads and len(pickle.dumps(meta)) < 2000


def test_bad_metadata_and_unknown_ids_are_clear_errors(tmp_path, engines):
    eng = make(tmp_path)
    engines.append(eng)
    w = eng.worker
    w.bind_connector_meta({"loads": []})
    with pytest.raises(InvalidArgumentError, match="expected KvtierConnectorMetadata"):
        w.start_load_kv(None)
    bad = KvtierConnectorMetadata(0, loads=(LoadSpec(1, (b"x" * 16,), (10_000,), ("trtllm", 1, 0)),))
    w.bind_connector_meta(bad)
    with pytest.raises(InvalidArgumentError, match=r"loads\[0\].*outside the KV pool") as ei:
        w.start_load_kv(None)
    assert ei.value.arg == "metadata"
    bad = KvtierConnectorMetadata(0, loads=(LoadSpec(1, (b"x" * 16,), (1,), ("trtllm", 1, 0), asynchronous=1),))
    w.bind_connector_meta(bad)
    with pytest.raises(InvalidArgumentError, match=r"loads\[0\].*asynchronous must be a bool"):
        w.start_load_kv(None)
    bad = KvtierConnectorMetadata(0, loads=(LoadSpec(1, (b"x" * 16,), (1,), ("trtllm", 1)),))
    w.bind_connector_meta(bad)
    with pytest.raises(InvalidArgumentError, match=r"loads\[0\].*reservation must be \(str, int, int\)"):
        w.start_load_kv(None)
    # A reservation the orchestrator does not hold (never made, or released): refused before any copy.
    w.bind_connector_meta(KvtierConnectorMetadata(0, loads=(LoadSpec(1, (b"x" * 16,), (1,), ("trtllm", 1, 99)),)))
    with pytest.raises(InvalidArgumentError, match="no unbound reservation"):
        w.start_load_kv(None)
    bad = KvtierConnectorMetadata(0, saves=(SaveSpec(1, (b"k" * 16,), (1,), (101,), (None,)),))
    w.bind_connector_meta(bad)
    with pytest.raises(InvalidArgumentError, match="priorities"):
        w.wait_for_save(None)
    w.bind_connector_meta(None)
    # A finished request with no save submitted (its step's forward pass failed) has nothing in
    # flight: reported finished, not an error (see the failed-forward tests below).
    assert w.get_finished([12345], []) == ([12345], [])
    with pytest.raises(InvalidArgumentError, match="unknown to kvtier"):
        eng.sched.update_state_after_alloc(Request(777, [1, 2]), [0])


@pytest.mark.parametrize(
    ("cfg", "key"),
    [
        ({}, "cpu_bytes"),
        ({"cpu_bytes": "lots"}, "cpu_bytes"),
        ({"cpu_bytes": "1MiB", "min_offload_priority": 101}, "min_offload_priority"),
        ({"cpu_bytes": "1MiB", "cpu_admission": "priority:50"}, "cpu_admission"),
        ({"cpu_bytes": "1MiB", "disk_bytes": "1GiB"}, "disk_bytes"),
        ({"cpu_bytes": "1MiB", "disk_root": "/x"}, "disk_bytes"),
        ({"cpu_bytes": "1MiB", "io_engine": "gpu"}, "io_engine"),
        ({"cpu_bytes": "1MiB", "cpu_policy": "mru"}, "cpu_policy"),
        ({"cpu_bytes": "1MiB", "bogus": 1}, "bogus"),
        ({"cpu_bytes": "1MiB", "block_identity": "sha"}, "block_identity"),
        # cost_model's rate and load_timeout_s: positive and finite (inf passed; an int beyond
        # float range raised OverflowError).
        ({"cpu_bytes": "1MiB", "cost_model": {"prefill_tokens_per_s": float("inf")}}, "cost_model"),
        ({"cpu_bytes": "1MiB", "cost_model": {"prefill_tokens_per_s": 10**400}}, "cost_model"),
        ({"cpu_bytes": "1MiB", "cost_model": {"prefill_tokens_per_s": float("nan")}}, "cost_model"),
        ({"cpu_bytes": "1MiB", "load_timeout_s": 10**400}, "load_timeout_s"),
        ({"cpu_bytes": "1MiB", "load_timeout_s": float("inf")}, "load_timeout_s"),
        ({"cpu_bytes": "1MiB", "load_timeout_s": 10**5000}, "load_timeout_s"),
        ({"cpu_bytes": "1MiB", "disk_root": "/x", "disk_bytes": "1GiB", "disk_queue_depth": "16"}, "disk_queue_depth"),
        ({"cpu_bytes": "1MiB", "disk_root": "/tmp/a\x00b", "disk_bytes": "1GiB"}, "disk_root"),
        ({"cpu_bytes": "1MiB", 1: 2, "zz": 3}, 1),  # unknown keys of mixed types: a TypeError before
        ({"cpu_bytes": "1MiB", "cpu_slo_guard": {"window_s": 1}}, "cpu_slo_guard"),
        ({"cpu_bytes": "1MiB", "cpu_slo_guard": {"p99_ms": float("nan")}}, "cpu_slo_guard"),
        ({"cpu_bytes": "1MiB", "cpu_slo_guard": [50]}, "cpu_slo_guard"),
        ({"cpu_bytes": "1MiB", "disk_slo_guard": {"p99_ms": 50}}, "disk_slo_guard"),  # needs disk_root
        ({"cpu_bytes": "1MiB", "cpu_max_promotions_in_flight": 0}, "cpu_max_promotions_in_flight"),
        (
            {"cpu_bytes": "1MiB", "disk_root": "/x", "disk_bytes": "1GiB", "disk_max_promotions_in_flight": 1.5},
            "disk_max_promotions_in_flight",
        ),
    ],
)
def test_config_errors_name_the_key(cfg, key):
    with pytest.raises(InvalidArgumentError, match=rf"config\[{re.escape(repr(key))}\]"):
        parse_options(cfg)


@pytest.mark.parametrize(
    ("text", "what", "arg"),
    [
        (
            '{"cpu_bytes": "1MiB", "load_timeout_s": 1' + "0" * 400 + "}",
            r"config\['load_timeout_s'\]",
            "load_timeout_s",
        ),
        (
            '{"cpu_bytes": "1MiB", "cost_model": {"prefill_tokens_per_s": Infinity}}',
            r"config\['cost_model'\]",
            "cost_model",
        ),
        (
            '{"cpu_bytes": "1MiB", "load_timeout_s": 1' + "0" * 5000 + "}",
            "KVTIER_TRTLLM_CONFIG: not usable JSON",
            "KVTIER_TRTLLM_CONFIG",
        ),
        (
            '{"cpu_bytes": ' + "[" * 100000 + "]" * 100000 + "}",
            "KVTIER_TRTLLM_CONFIG: not usable JSON",
            "KVTIER_TRTLLM_CONFIG",
        ),
        (
            b'{"cpu_bytes": "1MiB", "namespace": "caf\xe9"}',
            "KVTIER_TRTLLM_CONFIG: .* is not UTF-8",
            "KVTIER_TRTLLM_CONFIG",
        ),
    ],
    ids=["int-401-digits", "Infinity", "int-5000-digits", "nested-100000-deep", "latin-1-file"],
)
def test_config_from_environment_errors_are_clear(monkeypatch, tmp_path, text, what, arg):
    if isinstance(text, bytes):  # a file (Latin-1 here): a UnicodeDecodeError before
        (tmp_path / "cfg.json").write_bytes(text)
        text = str(tmp_path / "cfg.json")
    monkeypatch.setenv("KVTIER_TRTLLM_CONFIG", text)
    with pytest.raises(InvalidArgumentError, match=what) as ei:
        trtllm.KvtierScheduler(llm_args(TPB))
    assert ei.value.arg == arg  # the key, or the variable itself: no need to parse the message


@pytest.mark.parametrize(
    ("cfg", "key", "reason"),
    [
        ({"cpu_bytes": 100}, "cpu_bytes", "cannot hold one block"),
        ({"disk_bytes": 100}, "disk_bytes", "hold 0 slot"),
        ({"disk_bytes": 2**62}, "disk_bytes", r"2\^31 slots"),
        ({"disk_root": "FILE"}, "disk_root", "Not a directory"),
        ({"disk_root": "FILE/sub"}, "disk_root", "Not a directory"),
    ],
)
def test_what_only_the_tiers_can_check_names_the_key_at_start_up(tmp_path, cfg, key, reason):
    # Before: the core's "invalid argument `capacity_bytes`", or a DiskIoError naming only the path.
    (tmp_path / "file").write_bytes(b"x")
    extra = {"disk_root": str(tmp_path / "disk"), "disk_bytes": 256 * 8192, "disk_io_engine": "pool"}
    extra.update({k: v.replace("FILE", str(tmp_path / "file")) if isinstance(v, str) else v for k, v in cfg.items()})
    with pytest.raises(InvalidArgumentError, match=rf"^kvtier trtllm config\['{key}'\]: .*{reason}"):
        make(tmp_path, **extra)


def test_config_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTIER_TRTLLM_CONFIG", '{"cpu_bytes": "64KiB", "io_engine": "cpu"}')
    s = trtllm.KvtierScheduler(llm_args(TPB, model="env-model"))
    assert s.options.cpu_bytes == 65536
    monkeypatch.setenv("KVTIER_TRTLLM_CONFIG", "not json")
    with pytest.raises(InvalidArgumentError, match="KVTIER_TRTLLM_CONFIG") as ei:
        trtllm.KvtierScheduler(llm_args(TPB))
    assert ei.value.arg == "KVTIER_TRTLLM_CONFIG"
    monkeypatch.delenv("KVTIER_TRTLLM_CONFIG")
    with pytest.raises(InvalidArgumentError, match="kvtier trtllm config: none given") as ei:
        trtllm.KvtierScheduler(llm_args(TPB))
    assert ei.value.arg == "KVTIER_TRTLLM_CONFIG"
    with pytest.raises(InvalidArgumentError, match="expected a dict, got list") as ei:
        parse_options([])
    assert ei.value.arg == "kvtier_config"


def test_scheduler_without_registered_pool_says_so(monkeypatch):
    monkeypatch.setenv("KVTIER_TRTLLM_CONFIG", '{"cpu_bytes": "64KiB"}')
    s = trtllm.KvtierScheduler(llm_args(TPB, model="nobody"))
    with pytest.raises(KvTierError, match="register_kv_caches"):
        s.get_num_new_matched_tokens(Request(1, list(range(20))), 0)


# ---- block identity from the engine's own hashes -------------------------------------------------
# TensorRT-LLM's hasher cannot be installed here, so `standin_engine_hash` plays it: the connector
# is given it where it would import TensorRT-LLM's, and the driver reports block_hashes with it
# (or with something else, to show a disagreement is caught).


def salt_blind_hasher(tokens, parent, lora, salt_id):
    """Like the bindings' BlockKeyHasher: no cache salt argument, so salted requests cannot be
    reproduced."""
    return None if salt_id is not None else standin_engine_hash(tokens, parent, lora, None)


def test_without_tensorrt_llm_the_kvtier_chain_is_used_and_engine_is_refused(tmp_path):
    assert identity.engine_block_hasher() is None
    assert identity.block_identity("auto", "ns", TPB).scheme == "kvtier"
    with pytest.raises(InvalidArgumentError, match="block_identity.*not importable"):
        identity.block_identity("engine", "ns", TPB)


def test_blocks_are_named_by_the_engines_hashes(tmp_path, engines, monkeypatch):
    monkeypatch.setattr(identity, "engine_block_hasher", lambda: standin_engine_hash)
    eng = make(tmp_path, block_hasher=standin_engine_hash, block_identity="engine")
    engines.append(eng)
    assert eng.sched.identity.scheme == "engine"
    shared = prompt(1, 12)
    r1 = Request(1, shared + [7, 8, 9])
    eng.run_request(r1)
    # Every stored key is the namespace prefix + the engine's hash of that block.
    hashes = eng.block_hashes(Request(0, shared))
    index = eng.worker.tiers.orchestrator.host.index
    keys = [eng.sched.identity.key_for(h) for h in hashes]
    assert all(key[8:] == h.to_bytes(8, "little") for key, h in zip(keys, hashes, strict=True))
    assert index.lookup_prefix(keys) == 3
    assert eng.sched.counts["engine_hash_mismatches"] == 0
    r2 = Request(2, shared + [5, 6])
    eng.step([r2])
    assert eng.matched[2] == 12  # found by engine hash, loaded byte-identical (the driver checks)


def test_a_chain_that_disagrees_with_the_engine_is_not_saved(tmp_path, engines, monkeypatch):
    monkeypatch.setattr(identity, "engine_block_hasher", lambda: standin_engine_hash)

    def other_engine_hash(tokens, parent, lora, salt_id):  # e.g. a release that hashes differently
        return standin_engine_hash(tokens, parent ^ 1, lora, salt_id)

    eng = make(tmp_path, block_hasher=other_engine_hash, block_identity="engine")
    engines.append(eng)
    shared = prompt(2, 12)
    eng.run_request(Request(1, shared + [7]))
    assert eng.sched.counts["engine_hash_mismatches"] == 1
    assert eng.worker.counts["offloaded_blocks"] == 0
    eng.step([Request(2, shared + [5])])
    assert eng.matched[2] == 0


def test_a_request_whose_hash_cannot_be_reproduced_is_neither_matched_nor_saved(tmp_path, engines, monkeypatch):
    monkeypatch.setattr(identity, "engine_block_hasher", lambda: salt_blind_hasher)
    eng = make(tmp_path, block_identity="engine")
    engines.append(eng)
    shared = prompt(3, 12)
    salted = Request(1, shared + [7])
    salted.cache_salt_id = 99
    eng.run_request(salted)
    assert eng.sched.counts["unkeyed_requests"] == 1
    assert eng.worker.counts["offloaded_blocks"] == 0
    # Unsalted requests still work under the engine's hash.
    eng.run_request(Request(2, shared + [8]))
    eng.step([Request(3, shared + [9])])
    assert eng.matched[3] == 12


def test_engine_hasher_calls_tensorrt_llms_own_hash_as_the_engine_chains_it(monkeypatch):
    # A stand-in for tensorrt_llm.runtime.kv_cache_hash (TensorRT-LLM cannot be installed here)
    # with its signature; what is checked is kvtier's use of it: chaining, salt on the first
    # block only (string salts through get_cache_salt_id), non-text tokens refused.
    class NonTextTokenHashError(Exception):
        pass

    calls = []

    def hash_v1_block_key(tokens, parent_hash=0, lora_task_id=None, cache_salt_id=None):
        if any(type(t) is not int for t in tokens):
            raise NonTextTokenHashError
        calls.append((tuple(tokens), parent_hash, lora_task_id, cache_salt_id))
        return standin_engine_hash(tokens, parent_hash, lora_task_id, cache_salt_id)

    kv_hash = types.ModuleType("tensorrt_llm.runtime.kv_cache_hash")
    kv_hash.hash_v1_block_key = hash_v1_block_key
    kv_hash.NonTextTokenHashError = NonTextTokenHashError
    kv_hash.get_cache_salt_id = lambda s: 1000 + len(s)
    runtime = types.ModuleType("tensorrt_llm.runtime")
    runtime.kv_cache_hash = kv_hash
    monkeypatch.setitem(sys.modules, "tensorrt_llm", types.ModuleType("tensorrt_llm"))
    monkeypatch.setitem(sys.modules, "tensorrt_llm.runtime", runtime)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.runtime.kv_cache_hash", kv_hash)

    chain = identity.block_identity("engine", "ns", 2)
    assert chain.scheme == "engine"
    keys = chain.extend(None, [1, 2, 3, 4], 0, 2, 7, "tenant")
    h1 = standin_engine_hash((1, 2), 0, 7, 1006)
    assert calls == [((1, 2), 0, 7, 1006), ((3, 4), h1, 7, None)]
    assert [chain.engine_hash(k) for k in keys] == [h1, standin_engine_hash((3, 4), h1, 7, None)]
    # Extending from the last key continues the same chain.
    assert chain.extend(keys[0], [1, 2, 3, 4], 1, 1, 7, "tenant") == keys[1:]
    assert chain.extend(None, [1.5, 2], 0, 1, None, None) is None


# ---- a forward pass that fails ----------------------------------------------------------------
# TensorRT-LLM's _forward_step catches an error in the forward pass (the model's, or the
# connector's wait_for_layer_load / wait_for_save), fails every active request (request_finished)
# and goes on: get_finished at the end of the iteration and start_load_kv on the next run outside
# that handler, so an error raised there ends the executor loop.


def test_a_request_whose_save_never_reached_the_worker_is_reported_finished(tmp_path, engines):
    # The scheduler handed request 1 its first SaveSpec in this step's metadata (so
    # request_finished says a save is in flight), but the forward pass failed before
    # wait_for_save: the worker never saw it. get_finished raised InvalidArgumentError for the
    # id, outside the forward's error handler, and the request was never reported finished (its
    # blocks stayed allocated for good).
    eng = make(tmp_path)
    engines.append(eng)
    r = Request(1, prompt(21, 12) + [1])
    eng.step([r], model_error_at_layer=1)
    assert [str(e) for e in eng.forward_errors] == ["model error in layer 1"]
    assert 1 not in eng.saving and not eng.running, "reported finished, its blocks freed"
    assert eng.worker.counts["finished_without_save"] == 1
    # The engine serves on: the same prompt again is computed (nothing was offloaded) and saved.
    eng.run_request(Request(2, prompt(21, 12) + [2]))
    eng.step([Request(3, prompt(21, 12) + [3])])
    assert eng.matched[3] == 12


class FailingLoadsEngine(CpuTransferEngine):
    """The real CPU engine, copying inline (a job is finished when submitted); the next
    `fail_next` host->device jobs fail."""

    fail_next = 0

    def __init__(self, layout, pool):
        super().__init__(layout, pool, inline=True)

    def copy_now(self, direction, *args, **kwargs):
        if direction == "h2d" and FailingLoadsEngine.fail_next > 0:
            FailingLoadsEngine.fail_next -= 1
            raise RuntimeError("injected copy failure")
        super().copy_now(direction, *args, **kwargs)


def test_a_failed_load_does_not_lose_the_other_loads_of_its_step(tmp_path, engines):
    # Two loads finished in the same poll, the first short: _collect raised at it and dropped
    # the rest of the batch, so the second stayed in _pending_loads although the orchestrator had
    # retired it. Every later start_load_kv then raised 'previous step's loads are unfinished'
    # (outside the engine's forward error handler): the engine could not run another step.
    FailingLoadsEngine.fail_next = 0
    eng = make(tmp_path, engine_factory=FailingLoadsEngine)
    engines.append(eng)
    eng.run_request(Request(1, prompt(31, 12) + [1]))
    eng.run_request(Request(2, prompt(32, 12) + [1]))
    FailingLoadsEngine.fail_next = eng.layers  # every layer of the first load of the next step
    eng.step([Request(3, prompt(31, 12) + [2]), Request(4, prompt(32, 12) + [2])], handle_errors=True)
    assert len(eng.forward_errors) == 1 and "request 3: 3 of 3 blocks failed to load" in str(eng.forward_errors[0])
    assert not eng.running and not eng.saving
    # The next step runs (and its loads are checked token by token by the driver).
    eng.step([Request(5, prompt(32, 12) + [3])])
    assert eng.matched[5] == 12 and len(eng.forward_errors) == 1


class StaleLoadEngine(CpuTransferEngine):
    """The real CPU engine, whose host->device copies of every layer but the first wait until
    the test opens the gate, and then fail if `fail` is set."""

    gate = threading.Event()
    fail = False

    def copy_now(self, direction, block_ids, slots, sub_blocks=None, regions=None):
        if direction == "h2d" and regions != [0]:
            if not self.gate.wait(WAIT_S):
                raise RuntimeError("gate never opened")
            if StaleLoadEngine.fail:
                raise RuntimeError("injected copy failure")
        super().copy_now(direction, block_ids, slots, sub_blocks, regions)


def _load_left_in_flight(tmp_path, engines, seed, *, fail):
    """An engine whose last step failed in layer 0 while its load's later layers still copy."""
    StaleLoadEngine.gate.set()
    StaleLoadEngine.fail = False
    eng = make(tmp_path, engine_factory=StaleLoadEngine)
    engines.append(eng)
    eng.run_request(Request(1, prompt(seed, 12) + [1]))
    StaleLoadEngine.gate.clear()
    StaleLoadEngine.fail = fail
    eng.step([Request(2, prompt(seed, 12) + [2])], model_error_at_layer=0)
    assert eng.matched[2] == 12 and [str(e) for e in eng.forward_errors] == ["model error in layer 0"]
    assert eng.worker._pending_loads or eng.worker._stale_loads, "the load is still copying"
    return eng


def test_the_next_step_waits_for_a_load_left_in_flight_by_a_failed_step(tmp_path, engines, monkeypatch):
    # The load's request failed with its step and its blocks went back to the engine, which may
    # give them to this step's requests: the late copies must land before this step runs. Before,
    # start_load_kv raised 'previous step's loads are unfinished' (outside the engine's forward
    # error handler: the executor loop ended).
    eng = _load_left_in_flight(tmp_path, engines, 41, fail=False)
    worker, orch = eng.worker, eng.worker.tiers.orchestrator
    real_poll, real_start = orch.poll, worker.start_load_kv
    starting, at_return = [], []

    def poll():
        # The late copies are let through only after a poll of start_load_kv's: they cannot have
        # landed before it began waiting, however the threads are scheduled.
        out = real_poll()
        if starting:
            StaleLoadEngine.gate.set()
        return out

    def start_load_kv(stream):
        starting.append(None)
        try:
            real_start(stream)
        finally:
            starting.clear()
        at_return.append((worker.counts["stale_loads"], len(worker._stale_loads)))

    try:
        with monkeypatch.context() as m:
            m.setattr(orch, "poll", poll)
            m.setattr(worker, "start_load_kv", start_load_kv)
            eng.step([Request(3, prompt(42, 12) + [1])])
    finally:
        StaleLoadEngine.gate.set()
    assert at_return == [(1, 0)], "start_load_kv returned only once the late copies had landed"
    assert eng.worker.counts["stale_loads"] == 1 and not eng.worker._stale_loads
    assert eng.worker.tiers.orchestrator.host.index.stats()["pinned_blocks"] == 0
    eng.step([Request(4, prompt(41, 12) + [4])])  # and loads work again
    assert eng.matched[4] == 12


def test_a_load_of_a_failed_step_that_fails_later_is_not_raised_again(tmp_path, engines):
    # Its request is gone; its failure concerns nobody. Before, get_finished raised 'failed to
    # load' for it (outside the forward error handler: the executor loop ended), or the next
    # step's wait_for_layer_load did, failing requests that had nothing to do with it.
    eng = _load_left_in_flight(tmp_path, engines, 43, fail=True)
    StaleLoadEngine.gate.set()

    def collected():
        eng.poll_finished()  # get_finished, as the engine calls it every iteration
        return not eng.worker._pending_loads and not eng.worker._stale_loads

    wait_for(collected, "the failed step's load collected")
    assert eng.worker.counts["stale_loads"] == 1
    StaleLoadEngine.fail = False
    eng.step([Request(3, prompt(43, 12) + [3])])
    assert len(eng.forward_errors) == 1


def test_load_results_kept_for_inspection_are_bounded(tmp_path, engines):
    # Every load's result was appended to worker.load_results and never dropped (nothing reads
    # it): a serving process grew by one LoadResult per request that loaded, for good.
    eng = make(tmp_path, keep_load_results=2)
    engines.append(eng)
    eng.run_request(Request(1, prompt(51, 8) + [1]))
    for i in range(3):
        eng.step([Request(10 + i, prompt(51, 8) + [2 + i])])
    assert eng.worker.counts["loaded_blocks"] == 6
    assert [r.request_id[1] for r in eng.worker.load_results] == [11, 12]  # the most recent


@pytest.mark.parametrize(("request_data", "offloaded"), [("v2", 3), ("legacy", 0), ("v1", 0)])
def test_retention_config_is_mirrored_only_where_the_engine_honours_it(tmp_path, engines, request_data, offloaded):
    # KV cache manager V2 ignores KvCacheRetentionConfig and reports RequestData.priorities =
    # None (the reference: "treat None as 35"). kvtier read the request's config instead, so a
    # prompt the engine keeps at 35 was held below min_offload_priority and never offloaded.
    # Releases whose RequestData has no priorities field (1.2) honour the config: read it there.
    eng = make(tmp_path, request_data=request_data)
    engines.append(eng)
    low = Retention([TokenRange(0, None, 10)])
    eng.run_request(Request(1, prompt(61, 12) + [1], retention=low))
    assert eng.worker.counts["offloaded_blocks"] == offloaded
    assert eng.sched.counts["below_min_priority_blocks"] == (0 if offloaded else 3)


def test_a_finished_request_waits_for_its_own_saves_only(tmp_path, engines):
    """A request is reported finished once its own device -> host copies are over. Before, it
    waited until none of the blocks it had offloaded was being written in the CPU tier, so one of
    them taken again by unrelated work (a disk promotion's reservation, another request's store
    after an eviction) held its GPU blocks until that work was done."""
    GatedEngine.gate.clear()  # its copies wait, so it is still saving when the step ends
    eng = make(tmp_path, engine_factory=GatedEngine)
    engines.append(eng)
    req = Request(1, prompt(3, 12) + [1, 2])
    eng.step([req])
    eng.step(finish=[1])
    assert 1 in eng.saving
    GatedEngine.gate.set()
    orch = eng.worker.tiers.orchestrator
    orch.drain()  # its copies are done
    index = orch.host.index
    held = [key for key, state, _, _ in index.entries() if state == "ready"]
    assert held, "the request offloaded nothing"
    # Unrelated work takes one of its blocks again: it is being written, for someone else.
    index.remove([held[0]])
    index.prepare_store([held[0]])
    assert eng.poll_finished() == [1]
    index.complete_store([held[0]], False)


# ---- the shared remote tier ---------------------------------------------------------------------
def _remote(cluster, **extra):
    return {"remote_url": cluster.url, "remote_admission": "always", "remote_probe_wait_s": WAIT_S, **extra}


def _stored_by_a_replica_that_is_gone(tmp_path, cluster, seed):
    """A 12-token prefix (3 blocks) that one engine computed and wrote to the remote tier before
    it went away (its CPU tier with it)."""
    shared = prompt(seed, 12)
    first = make(tmp_path, **_remote(cluster))
    first.run_request(Request(1, shared + [1]))
    first.worker.tiers.orchestrator.drain()
    assert first.worker.tiers.orchestrator.stats()["tiers"]["remote"]["writes"]["completed"] == 3
    first.worker.close()
    return shared


def test_a_prefix_one_engine_computed_is_loaded_by_the_next_from_the_remote_tier(tmp_path, engines, cluster):
    shared = _stored_by_a_replica_that_is_gone(tmp_path, cluster, 9)
    second = make(tmp_path, **_remote(cluster))  # another replica: nothing local
    engines.append(second)
    r = Request(2, shared + [2])
    second.step([r])
    assert second.matched[2] == 12
    assert second.worker.counts["loaded_blocks"] == 3  # and the driver checked every loaded byte
    st = second.worker.tiers.orchestrator.stats()["tiers"]["remote"]
    assert (st["hits"], st["promotions"]) == (3, 3)
    for pos in range(12):
        for layer in range(second.layers):
            assert torch.equal(
                second._slot(r.block_ids[pos // TPB], pos, layer), second.token_kv(shared[: pos + 1], layer)
            )


def test_without_an_answer_in_time_remote_blocks_are_recomputed_not_promised(tmp_path, engines, cluster):
    shared = _stored_by_a_replica_that_is_gone(tmp_path, cluster, 10)
    cluster.pause(0)
    cluster.pause(1)
    cluster.pause(2)
    try:
        second = make(tmp_path, **_remote(cluster, remote_probe_wait_s=0.05, remote_deadline_s=1.0))
        engines.append(second)
        second.step([Request(2, shared + [2])])
        assert second.matched[2] == 0, "the store did not answer within remote_probe_wait_s"
    finally:
        for i in range(3):
            cluster.resume(i)


def test_remote_keys_are_checked_like_the_others():
    with pytest.raises(InvalidArgumentError, match=r"remote_probe_wait_s.*needs remote_url"):
        parse_options({"cpu_bytes": "1MiB", "remote_probe_wait_s": 0.01})
    with pytest.raises(InvalidArgumentError, match="remote_url"):
        parse_options({"cpu_bytes": "1MiB", "remote_url": "redis://:secret@host:1"})
    o = parse_options({"cpu_bytes": "1MiB", "remote_url": "redis://127.0.0.1:7000"})
    assert o.remote_probe_wait_s == 0.005 and o.settings is not None and o.settings.remote is not None
    assert parse_options({"cpu_bytes": "1MiB"}).remote_probe_wait_s is None


# ---- async loads (async_loads: "staged") ------------------------------------------------------
def test_a_disk_load_waits_outside_the_batch_and_comes_back_with_its_kv(tmp_path, engines):
    """A request whose blocks come from disk is answered load_kv_async: it is parked while
    another request decodes (no layer waits for its read, which is held back), and once the
    read lands and get_finished reports it, it runs as a new request on the loaded KV (the
    driver checks every token of every layer)."""
    eng = make(tmp_path, cpu_blocks=4, disk=True, async_loads="staged")
    engines.append(eng)
    first = prompt(3, 12)
    orch = _evicted_to_disk(eng, first)
    other = Request(5, prompt(77, 6), max_new_tokens=8)
    eng.step([other])  # prefill of an unrelated request
    held = HeldReads(orch.stager.disk)
    orch.stager.disk = held
    r = Request(2, first + [2])
    meta = eng.step([r])  # parked; `other` decodes in the same step
    assert eng.matched[2] == 12 and 2 in eng.parked
    assert [(s.request_id, s.asynchronous) for s in meta.loads] == [(2, True)]
    for _ in range(3):  # the read is held back: `other` keeps decoding, nothing waits for it
        eng.step()
        assert 2 in eng.parked and eng.announced_loading == {2}
    assert eng.worker.counts["loaded_blocks"] == 0
    held.release = True
    eng.wait_loaded(2)
    meta = eng.step()  # request 2 is prefilled from position 12 on the loaded blocks
    assert r.state == "GENERATION_IN_PROGRESS"
    # Copied to the device in this step, from the CPU slots the read filled (synchronous).
    assert [(s.request_id, s.asynchronous) for s in meta.loads] == [(2, False)]
    assert eng.worker.counts["loaded_blocks"] == 3
    assert orch.stats()["tiers"]["disk"]["promotions"] == 3
    assert orch.host.index.stats()["pinned_blocks"] == 0


def test_cpu_hits_stay_synchronous_under_async_loads(tmp_path, engines):
    eng = make(tmp_path, async_loads="staged")
    engines.append(eng)
    shared = prompt(4, 12)
    eng.run_request(Request(1, shared + [1]))
    r = Request(2, shared + [2])
    meta = eng.step([r])
    assert eng.matched[2] == 12 and 2 not in eng.parked
    assert [(s.request_id, s.asynchronous) for s in meta.loads] == [(2, False)]
    assert eng.worker.counts["loaded_blocks"] == 3


def test_a_cpu_load_and_an_async_disk_load_share_a_step(tmp_path, engines):
    """One step loads a request from the CPU tier (synchronously, per layer) and parks another
    for its disk read: the async load goes last in the metadata, the synchronous one runs in
    the step on its loaded KV, and the parked one comes back once its read lands (the driver
    checks every loaded token of both)."""
    eng = make(tmp_path, cpu_blocks=8, disk=True, async_loads="staged")
    engines.append(eng)
    on_disk = prompt(3, 12)
    orch = _evicted_to_disk(eng, on_disk)
    in_cpu = prompt(43, 12)  # the last request _evicted_to_disk ran: still in the CPU tier
    held = HeldReads(orch.stager.disk)
    orch.stager.disk = held
    parked, running = Request(2, on_disk + [2]), Request(3, in_cpu + [3])
    meta = eng.step([parked, running])
    assert (eng.matched[2], eng.matched[3]) == (12, 12)
    assert [(s.request_id, s.asynchronous) for s in meta.loads] == [(3, False), (2, True)]
    assert 2 in eng.parked and 3 not in eng.parked
    assert running.state == "GENERATION_IN_PROGRESS"
    assert eng.worker.counts["loaded_blocks"] == 3, "request 3's blocks, in this step"
    held.release = True
    eng.wait_loaded(2)
    eng.step()
    assert parked.state == "GENERATION_IN_PROGRESS"
    assert eng.worker.counts["loaded_blocks"] == 6
    assert orch.host.index.stats()["pinned_blocks"] == 0


def test_a_failed_bind_releases_the_steps_loads_and_keeps_watching_its_parked_ones(tmp_path, engines, monkeypatch):
    eng = make(tmp_path, cpu_blocks=8, disk=True, async_loads="staged")
    engines.append(eng)
    on_disk = prompt(3, 12)
    orch = _evicted_to_disk(eng, on_disk)
    in_cpu = prompt(43, 12)  # the last request _evicted_to_disk ran: still in the CPU tier

    def refused(*args, **kwargs):
        raise KvTierError("the copy engine is closed")

    monkeypatch.setattr(orch, "bind", refused)
    parked, running = Request(2, on_disk + [2]), Request(3, in_cpu + [3])
    released = orch.stats()["load_released"]
    with pytest.raises(KvTierError, match="copy engine is closed"):
        eng.step([parked, running])  # start_load_kv raises: the executor loop would end here
    monkeypatch.undo()
    eng.running.pop(3)
    assert orch.stats()["load_released"] == released + 3, "the failed load's reservation is given back"
    eng.wait_loaded(2)  # announced in the next get_finished: its staging was still watched
    eng.step()
    assert parked.state == "GENERATION_IN_PROGRESS" and eng.worker.counts["loaded_blocks"] == 3
    assert orch.host.index.stats()["pinned_blocks"] == 0


def test_async_loads_are_off_by_default(tmp_path, engines):
    eng = make(tmp_path, cpu_blocks=4, disk=True)
    engines.append(eng)
    first = prompt(3, 12)
    _evicted_to_disk(eng, first)
    assert eng.sched.get_num_new_matched_tokens(Request(2, first + [2]), 0) == (12, False)


def test_a_request_back_from_an_async_load_saves_only_computed_blocks(tmp_path, engines):
    """It comes back as a new request whose computed_position already counts the loaded
    tokens: adding them again would file blocks of a later prefill chunk, not computed yet."""
    eng = make(tmp_path, cpu_blocks=4, disk=True, async_loads="staged")
    engines.append(eng)
    first = prompt(3, 12)
    _evicted_to_disk(eng, first)
    r = Request(2, first + prompt(8, 12))  # 24 tokens: 3 blocks loaded, 3 to compute
    eng.step([r])
    eng.wait_loaded(2)
    # The engine schedules the rest of the prompt in chunks; the first chunk is 4 tokens.
    chunk = RequestData(2, r.get_tokens(0), list(r.block_ids), 12, 4)
    meta = eng.sched.build_connector_meta(SchedulerOutput(new_requests=[chunk]))
    assert [len(s.keys) for s in meta.saves] == [4], "blocks 0-3 are complete after this chunk, not 0-5"


def test_a_short_async_load_stops_at_get_finished_naming_the_request(tmp_path, engines):
    eng = make(tmp_path, cpu_blocks=4, disk=True, async_loads="staged")
    engines.append(eng)
    first = prompt(3, 12)
    orch = _evicted_to_disk(eng, first)
    orch.stager.disk._inject_fault("eio_read", 1)
    with pytest.raises(KvTierError, match=r"async load of request 2: \d of 3 blocks could not be staged"):
        eng.step([Request(2, first + [2])])
        eng.wait_loaded(2)
    assert 2 in eng.parked, "never reported: TensorRT-LLM would run it on missing KV"


def test_get_finished_refuses_a_loading_id_it_has_no_load_for(tmp_path, engines):
    eng = make(tmp_path, async_loads="staged")
    engines.append(eng)
    with pytest.raises(InvalidArgumentError, match=r"started_loading_req_ids.*\[99\]"):
        eng.worker.get_finished([], [99])


def _parked_then_failed(tmp_path, engines):
    """An engine whose request 2 was parked for a disk read held back, then failed with the
    step's other request by a model error (the executor's handler frees its blocks at once):
    (engine, orchestrator, the held reads, request 2's freed blocks)."""
    eng = make(tmp_path, cpu_blocks=4, disk=True, async_loads="staged")
    engines.append(eng)
    first = prompt(3, 12)
    orch = _evicted_to_disk(eng, first)
    eng.step([Request(5, prompt(77, 6), max_new_tokens=8)])
    held = HeldReads(orch.stager.disk)
    orch.stager.disk = held
    parked = Request(2, first + [2])
    eng.step([parked])
    freed = list(parked.block_ids)
    eng.step(model_error_at_layer=0)
    assert 2 not in eng.parked and set(freed) <= set(eng.free)
    return eng, orch, held, freed


def test_a_parked_request_failed_by_the_engine_never_has_its_blocks_written(tmp_path, engines):
    """TensorRT-LLM's error handler fails parked requests too and frees their blocks at once,
    without a connector call; here the engine hands them straight to the next request. kvtier
    copies nothing to the device for a parked request, so when the held read lands the
    newcomer's KV stays its own (the driver checks every token of every layer it attends to).
    Before, the load was bound at parking and its copies landed in the newcomer's blocks."""
    eng, _, held, freed = _parked_then_failed(tmp_path, engines)
    eng.free = freed + [b for b in eng.free if b not in freed]  # handed out next
    newcomer = Request(6, prompt(90, 16), max_new_tokens=6)
    eng.step([newcomer])
    assert set(freed) & set(newcomer.block_ids)
    held.release = True  # the read lands in CPU slots; request 2's report is set aside
    deadline = time.monotonic() + WAIT_S
    while 2 in eng.dropped_loading:
        assert time.monotonic() < deadline, "the staging was never reported"
        eng.step()  # the newcomer decodes, attending to its own KV in the freed blocks
    for _ in range(2):
        eng.step()
    for pos in range(len(newcomer.tokens) - 1):
        for layer in range(eng.layers):
            got = eng._slot(newcomer.block_ids[pos // TPB], pos, layer)
            assert torch.equal(got, eng.token_kv(newcomer.tokens[: pos + 1], layer)), (pos, layer)


def test_a_parked_request_the_engine_finished_gives_its_reservation_back(tmp_path, engines):
    # No connector call tells kvtier: the same iteration's get_finished finds it finished.
    eng, orch, held, _ = _parked_then_failed(tmp_path, engines)
    assert eng.sched.counts["abandoned_loads"] == 1
    assert not eng.dropped_loading, "its staging was reported as over, and set aside"
    held.release = True  # the read lands in the CPU tier, owned by no load
    orch.drain()
    assert orch.host.index.stats()["pinned_blocks"] == 0


def test_a_parked_request_cancelled_on_an_idle_engine_gives_its_reservation_back(tmp_path, engines, monkeypatch):
    """Nothing else is scheduled, so no metadata is built: the worker's get_finished asks. The
    held read outlasting load_timeout_s then stops nothing: there is no staging left to time."""
    eng = make(tmp_path, cpu_blocks=4, disk=True, async_loads="staged", load_timeout_s=10)
    engines.append(eng)
    first = prompt(3, 12)
    orch = _evicted_to_disk(eng, first)
    held = HeldReads(orch.stager.disk)
    orch.stager.disk = held
    parked = Request(2, first + [2])
    eng.step([parked])
    freed = list(parked.block_ids)
    eng.cancel_parked(2)
    assert eng.step() is None, "an idle step"
    assert eng.sched.counts["abandoned_loads"] == 1
    assert not eng.dropped_loading, "the staging was reported, and set aside"
    real, later = time.monotonic, [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: real() + later[0])
    later[0] = 100.0  # ten times load_timeout_s, the read still held
    eng.step()
    held.release = True
    later[0] = 0.0
    orch.drain()
    assert orch.host.index.stats()["pinned_blocks"] == 0
    assert all(torch.isnan(eng.pool[b]).all() for b in freed), "a freed block was written"


def _reported_async(tmp_path, engines, **extra):
    """An engine whose request 2, parked for a disk read, has been reported loaded (it runs at
    the next step): (engine, request)."""
    eng = make(tmp_path, cpu_blocks=4, disk=True, async_loads="staged", **extra)
    engines.append(eng)
    first = prompt(3, 12)
    _evicted_to_disk(eng, first)
    r = Request(2, first + [2])
    eng.step([r])
    eng.wait_loaded(2)
    return eng, r


def test_a_reported_request_that_waits_long_for_a_batch_still_loads(tmp_path, engines, monkeypatch):
    eng, r = _reported_async(tmp_path, engines, load_timeout_s=10)
    eng.running.pop(2)  # no room in a batch for it yet
    real, later = time.monotonic, [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: real() + later[0])
    later[0] = 100.0  # ten times load_timeout_s
    eng.step()
    eng.step()
    eng.running[2] = r
    meta = eng.step()
    assert [(s.request_id, s.asynchronous) for s in meta.loads] == [(2, False)]
    assert r.state == "GENERATION_IN_PROGRESS" and eng.worker.counts["loaded_blocks"] == 3
    assert eng.sched.counts["abandoned_loads"] == 0


def test_async_loads_need_a_release_that_resumes_a_parked_request_on_its_blocks(monkeypatch):
    """The staged load copies into the blocks allocated at parking, in the step the request
    comes back in: a connector manager without should_add_sequence cannot be relied on to keep
    those blocks and resume it as a new request."""
    old = types.ModuleType("kv_cache_connector_without_async_resume")
    old.KvCacheConnectorManager = type("KvCacheConnectorManager", (), {})
    monkeypatch.setitem(sys.modules, old.__name__, old)
    monkeypatch.setattr(trtllm, "BASE_MODULE", old.__name__)
    assert not trtllm.resumes_async_loads()
    cfg = {"cpu_bytes": 16 * 4096, "io_engine": "cpu", "async_loads": "staged"}
    cls = type("S", (trtllm.KvtierScheduler,), {"kvtier_config": cfg})
    with pytest.raises(InvalidArgumentError, match=r"async_loads.*should_add_sequence") as ei:
        cls(llm_args(TPB))
    assert ei.value.arg == "async_loads"
    off = type("S", (trtllm.KvtierScheduler,), {"kvtier_config": {**cfg, "async_loads": "off"}})
    assert off(llm_args(TPB)).options.async_loads == "off", "synchronous loads need nothing of the release"
    old.KvCacheConnectorManager.should_add_sequence = lambda self, request: True
    assert trtllm.resumes_async_loads()
    assert cls(llm_args(TPB)).options.async_loads == "staged"


def test_a_parked_request_back_as_a_cached_request_still_gets_its_load(tmp_path, engines):
    # Should a release report the returning request among the cached ones, its load (the
    # tokens the engine counts as computed) must still be copied before its first layer.
    eng, r = _reported_async(tmp_path, engines)
    data = RequestData(2, r.get_tokens(0), list(r.block_ids), 12, 1)
    meta = eng.sched.build_connector_meta(SchedulerOutput(cached_requests=[data]))
    assert [(s.request_id, s.asynchronous, s.block_ids) for s in meta.loads] == [(2, False, tuple(r.block_ids[:3]))]
    # What its new tokens and block ids cover is not known: nothing of it is saved, now or later.
    assert meta.saves == ()
    more = RequestData(2, [7], [], 13, 1)
    assert eng.sched.build_connector_meta(SchedulerOutput(cached_requests=[more])).saves == ()


def test_a_remote_load_answered_async_is_served_byte_for_byte(tmp_path, engines, cluster):
    shared = _stored_by_a_replica_that_is_gone(tmp_path, cluster, 11)
    second = make(tmp_path, async_loads="staged", **_remote(cluster))
    engines.append(second)
    r = Request(2, shared + [2])
    second.step([r])
    assert second.matched[2] == 12 and 2 in second.parked
    second.wait_loaded(2)
    second.step()  # the forward pass checks every loaded token's KV
    assert r.state == "GENERATION_IN_PROGRESS" and second.worker.counts["loaded_blocks"] == 3
    st = second.worker.tiers.orchestrator.stats()["tiers"]["remote"]
    assert (st["hits"], st["promotions"]) == (3, 3)


def _parked_by_hand(eng, r):
    """Request `r` answered load_kv_async and its load started, as TensorRT-LLM's step does,
    but not yet announced to get_finished (the driver's step announces it at its end)."""
    n, load_async = eng.sched.get_num_new_matched_tokens(r, 0)
    assert load_async and n == 12
    r.block_ids = [eng.free.pop(0) for _ in range(5)]
    eng.sched.update_state_after_alloc(r, list(r.block_ids))
    meta = pickle.loads(pickle.dumps(eng.sched.build_connector_meta(SchedulerOutput())))
    assert [s.request_id for s in meta.loads] == [r.request_id]
    eng.worker.bind_connector_meta(meta)
    eng.worker.start_load_kv(None)


def test_an_async_load_is_announced_once_and_reported_once(tmp_path, engines):
    eng = make(tmp_path, cpu_blocks=4, disk=True, async_loads="staged")
    engines.append(eng)
    first = prompt(3, 12)
    _evicted_to_disk(eng, first)
    _parked_by_hand(eng, Request(2, first + [2]))
    with pytest.raises(InvalidArgumentError, match=r"started_loading_req_ids.*\[2\].*announced twice"):
        eng.worker.get_finished([], [2, 2])
    reported = eng.worker.get_finished([], [2])[1]
    deadline = time.monotonic() + WAIT_S
    while not reported:
        assert time.monotonic() < deadline, "the load was never reported"
        reported = eng.worker.get_finished([], [])[1]
    assert reported == [2]
    assert eng.worker.get_finished([], [])[1] == [], "reported once"
    with pytest.raises(InvalidArgumentError, match="started_loading_req_ids"):
        eng.worker.get_finished([], [2])


def test_an_async_load_not_in_place_within_load_timeout_s_stops_naming_the_request(tmp_path, engines):
    eng = make(tmp_path, cpu_blocks=4, disk=True, async_loads="staged", load_timeout_s=0.5)
    engines.append(eng)
    first = prompt(3, 12)
    orch = _evicted_to_disk(eng, first)
    held = HeldReads(orch.stager.disk)  # a device that stopped answering
    orch.stager.disk = held
    eng.step([Request(2, first + [2])])
    with pytest.raises(KvTierError, match=r"async load of request 2: not in place after 0.5 s"):
        wait_for(lambda: eng.poll_finished() is None, "the overdue load reported")
    held.release = True  # the device answers again: the worker can close
