"""The data path on CPU: device blocks (CPU tensors) -> CPU tier -> disk -> CPU -> device, with
random layouts, many requests, partial hits, failures injected at each stage, and the cost
model and SLO guard deciding on synthetic numbers."""

from __future__ import annotations

import random
import re
import time

import numpy as np
import pytest
import torch
from support.disk import HeldReads

import kvtier_rs as kv
from kvtier_rs._core import DiskTier
from kvtier_rs.orchestrator import CostModel, GuardRule, SloGuard, TierOrchestrator
from kvtier_rs.tiers.events import EventStream
from kvtier_rs.transfer import BlockLayout, CpuTransferEngine, Region, coalesce_runs


def random_layout(rng: random.Random, num_blocks: int) -> tuple[BlockLayout, list[torch.Tensor]]:
    """Per-layer, K/V-split or one pool tensor, with random shapes and dtypes."""
    dtype = rng.choice([torch.float16, torch.float32, torch.bfloat16, torch.int8])
    layers = rng.randint(1, 4)
    tokens, heads, dim = rng.choice([4, 16]), rng.randint(1, 3), rng.choice([8, 32, 64])
    kind = rng.choice(["per_layer", "kv_split", "pool"])
    if kind == "per_layer":
        ts = [torch.randn(num_blocks, heads, tokens, 2 * dim).to(dtype) for _ in range(layers)]
        return BlockLayout.per_layer(ts), ts
    if kind == "kv_split":
        ts = [torch.randn(2, num_blocks, tokens, heads, dim).to(dtype) for _ in range(layers)]
        return BlockLayout.kv_split(ts), ts
    pool = torch.randn(num_blocks, layers, 2, tokens, heads * dim).to(dtype)
    row = pool[0].numel() * pool.element_size()
    per_layer = row // layers
    regions = [Region.rows_of(pool, offset_bytes=i * per_layer, bytes_per_block=per_layer) for i in range(layers)]
    return BlockLayout(regions), [pool]


def block_bytes_of(layout: BlockLayout, block: int) -> bytes:
    return b"".join(r.byte_rows()[block].numpy().tobytes() for r in layout.regions)


def make(tmp_path, rng, *, cpu_blocks=8, disk_blocks=64, gpu_blocks=32, disk_admission="always", **kw):
    layout, tensors = random_layout(rng, gpu_blocks)
    host = kv.HostTier(kv.TierConfig(cpu_blocks * (-(-layout.bytes_per_block // 4096) * 4096), layout.bytes_per_block))
    engine = CpuTransferEngine(layout, host.pool)
    disk = DiskTier(
        str(tmp_path / "disk"),
        disk_blocks * host.pool.slot_bytes,
        host.pool.slot_bytes,
        admission=disk_admission,
        engine="pool",
    )
    orch = TierOrchestrator(host, engine, disk=disk, **kw)
    return orch, layout, tensors


def scramble(tensors):
    for t in tensors:
        t.copy_(torch.randn(t.shape).to(t.dtype))


@pytest.mark.parametrize("seed", range(6))
def test_round_trip_through_cpu_and_disk_is_byte_identical(tmp_path, seed):
    rng = random.Random(seed)
    orch, layout, tensors = make(tmp_path, rng)
    keys = [f"req-{seed}-{i}".encode() for i in range(6)]
    src_blocks = rng.sample(range(32), 6)
    want = [block_bytes_of(layout, b) for b in src_blocks]
    orch.offload(keys, src_blocks)
    orch.drain()
    assert orch.stats()["tiers"]["disk"]["writes"]["completed"] == 6
    # Push the chain out of the CPU tier (8 slots) so it must come back from disk.
    other = [f"other-{i}".encode() for i in range(8)]
    orch.offload(other, list(range(8)))
    orch.drain()
    plan = orch.plan(keys)
    assert (plan.cpu_hits, plan.disk_hits) == (0, 6)
    scramble(tensors)
    dst = rng.sample(range(32), 6)
    orch.load(keys, dst, request_id="r")
    (res,) = orch.drain()
    assert (res.loaded_disk, res.failed) == (6, 0)
    assert [block_bytes_of(layout, b) for b in dst] == want


def test_many_requests_and_partial_hits(tmp_path):
    rng = random.Random(99)
    orch, layout, tensors = make(tmp_path, rng, cpu_blocks=16, disk_blocks=128)
    chains = {r: [f"c{r}-{i}".encode() for i in range(4)] for r in range(6)}
    truth = {}
    for r, chain in chains.items():
        blocks = list(range(r * 4 % 32, r * 4 % 32 + 4))
        truth.update({k: block_bytes_of(layout, b) for k, b in zip(chain, blocks, strict=True)})
        orch.offload(chain, blocks)
        orch.drain()  # an engine polls every step; stores in flight cannot be evicted
    scramble(tensors)
    # Several loads in flight at once; each request's chain extended by 2 unknown blocks.
    dsts = {}
    free_dst = rng.sample(range(32), 24)  # disjoint destinations for the concurrent loads
    for r, chain in chains.items():
        keys = chain + [f"new{r}-{j}".encode() for j in range(2)]
        plan = orch.plan(keys)
        assert plan.cpu_hits + plan.disk_hits == 4 and plan.misses == 2
        dsts[r] = free_dst[r * 4 : r * 4 + 4]
        orch.load(keys, dsts[r], request_id=r, plan=plan)
    results = {res.request_id: res for res in orch.drain()}
    assert set(results) == set(chains)
    # With every CPU slot pinned by the loads in flight, a disk promotion finds no room: that
    # request recomputes (all-or-nothing, counted) rather than waiting. Retried alone, it loads.
    starved = [r for r, res in results.items() if res.loaded == 0]
    assert orch.stager.counters.promotions_no_cpu_space == len(starved) <= 2
    for r in starved:
        # Never attempted: unreserved, not failed (no copy or read went wrong).
        assert (results[r].failed, results[r].unreserved) == (0, 4)
        orch.load(chains[r], dsts[r], request_id=("retry", r))
        (again,) = orch.drain()
        assert again.loaded == 4
    for r, chain in chains.items():
        got = [block_bytes_of(layout, b) for b in dsts[r]]
        assert got == [truth[k] for k in chain], f"request {r}"
    s = orch.stats()
    assert (s["load_unreserved"], s["load_failed"]) == (4 * len(starved), 0)
    assert s["misses"] == 12
    assert s["tiers"]["cpu"]["promotions"] + s["tiers"]["disk"]["promotions"] == 24


def test_gpu_hits_are_skipped_and_counted(tmp_path):
    orch, layout, _ = make(tmp_path, random.Random(1))
    keys = [b"a", b"b", b"c"]
    orch.offload(keys, [0, 1, 2])
    orch.drain()
    plan = orch.plan(keys, gpu_hit_blocks=1)
    assert (plan.gpu_hits, plan.cpu_hits, plan.load_cpu) == (1, 2, 2)
    orch.load(keys, [5, 6], gpu_hit_blocks=1, request_id=1, plan=plan)  # the plan counted the lookup
    (res,) = orch.drain()
    assert res.loaded_cpu == 2
    assert block_bytes_of(layout, 5) == block_bytes_of(layout, 1)
    assert orch.stats()["tiers"]["gpu"]["hits"] == 1


class FailingEngine(CpuTransferEngine):
    """Fails the next job of the given direction (injected at the copy stage)."""

    fail: set[str] = set()

    def copy_now(self, direction, block_ids, slots):
        if direction in self.fail:
            self.fail.discard(direction)
            raise RuntimeError(f"injected {direction} failure")
        super().copy_now(direction, block_ids, slots)


def make_failing(tmp_path, rng, **kw):
    layout, tensors = random_layout(rng, 32)
    host = kv.HostTier(kv.TierConfig(8 * (-(-layout.bytes_per_block // 4096) * 4096), layout.bytes_per_block))
    engine = FailingEngine(layout, host.pool)
    engine.fail = set()
    disk = open_failing_disk(tmp_path, host.pool.slot_bytes)
    return TierOrchestrator(host, engine, disk=disk, **kw), layout, tensors, engine


def open_failing_disk(tmp_path, slot_bytes: int) -> DiskTier:
    return DiskTier(str(tmp_path / "d"), 64 * slot_bytes, slot_bytes, admission="always", engine="pool")


def corrupt_on_disk(orch: TierOrchestrator, tmp_path, payload: bytes) -> None:
    """Flip one byte in the middle of `payload` where the disk tier of `make_failing` stored it
    (found by its content in the slab files), with the tier closed, then reopen it."""
    orch.stager.disk.close()
    for f in (tmp_path / "d").iterdir():
        data = bytearray(f.read_bytes())
        at = data.find(payload)
        if at >= 0:
            data[at + len(payload) // 2] ^= 0xFF
            f.write_bytes(bytes(data))
            break
    else:
        raise AssertionError("the payload was not found on disk")
    orch.stager.disk = open_failing_disk(tmp_path, orch.host.pool.slot_bytes)


def test_offload_without_space_changes_nothing(tmp_path):
    orch, _, _ = make(tmp_path, random.Random(9), cpu_blocks=2)
    orch.offload([b"a", b"b"], [0, 1])  # both slots now being written
    t = orch.offload([b"c"], [2])
    assert t.no_space and t.stored == []
    orch.drain()
    assert orch.host.index.lookup_prefix([b"a", b"b", b"c"]) == 2
    assert orch.stats()["tiers"]["cpu"]["store_no_space"] == 1
    # A chain whose head the tier holds, refused for its new tail: only the tail was refused.
    orch.host.index.pin_for_load([b"a", b"b"])
    t = orch.offload([b"a", b"b", b"c", b"d"], [0, 1, 2, 3])
    assert t.no_space
    assert orch.stats()["tiers"]["cpu"]["store_no_space"] == 1 + 2


def test_failed_offload_leaves_nothing_readable(tmp_path):
    orch, _, _, engine = make_failing(tmp_path, random.Random(2))
    engine.fail.add("d2h")
    orch.offload([b"x", b"y"], [0, 1])
    orch.drain()
    assert orch.host.index.lookup_prefix([b"x", b"y"]) == 0
    assert len(orch.host.index) == 0, "the failed store's slots were freed"
    assert orch.stager.disk.lookup_prefix([b"x"]) == 0, "nothing was written through"
    assert orch.stats()["tiers"]["cpu"]["store_failed"] == 2


def test_failed_load_is_counted_and_pins_released(tmp_path):
    orch, layout, tensors, engine = make_failing(tmp_path, random.Random(3))
    orch.offload([b"x", b"y"], [0, 1])
    orch.drain()
    engine.fail.add("h2d")
    orch.load([b"x", b"y"], [4, 5], request_id="r")
    (res,) = orch.drain()
    assert (res.loaded, res.failed) == (0, 2)
    assert all(pins == 0 for _, _, pins, _ in orch.host.index.entries())
    assert orch.stats()["load_failed"] == 2


def test_corrupt_disk_block_is_a_miss_and_never_loaded(tmp_path):
    rng = random.Random(4)
    orch, layout, tensors, _ = make_failing(tmp_path, rng)
    keys = [b"k0", b"k1", b"k2"]
    want = [block_bytes_of(layout, b) for b in (0, 1, 2)]
    orch.offload(keys, [0, 1, 2])
    orch.drain()
    orch.host.index.clear()  # only the disk copies are left
    corrupt_on_disk(orch, tmp_path, want[1])
    scramble(tensors)
    before = [block_bytes_of(layout, b) for b in (8, 9, 10)]
    plan = orch.plan(keys)
    assert plan.disk_hits == 3, "the damage is only found when the block is read"
    orch.load(keys, [8, 9, 10], request_id="r", plan=plan)
    (res,) = orch.drain()
    assert (res.loaded_disk, res.failed) == (1, 2), "k0 verifies; k1 is corrupt; k2 is past the hole"
    assert block_bytes_of(layout, 8) == want[0]
    assert [block_bytes_of(layout, b) for b in (9, 10)] == before[1:], "no corrupt byte reached the device"
    assert orch.host.index.lookup_prefix(keys) == 1
    assert orch.stats()["tiers"]["disk"]["promotion_blocks_failed"] == 1


def test_a_disk_read_that_fails_verification_is_a_sample_for_the_disk_guard(tmp_path):
    """The engine waited on the read: a disk failing its reads must be able to trip its guard
    (before, a promotion whose read failed gave no sample at all)."""
    rule = GuardRule(p99_ms=1e6, min_samples=10**9)
    orch, layout, _, _ = make_failing(tmp_path, random.Random(4), guards={"disk": rule})
    orch.offload([b"k0"], [0])
    orch.drain()
    orch.host.index.clear()
    corrupt_on_disk(orch, tmp_path, block_bytes_of(layout, 0))
    orch.load([b"k0"], [8], request_id="r")
    (res,) = orch.drain()
    assert (res.loaded_disk, res.failed) == (0, 1)
    assert orch.guards["disk"].state()["samples"] == 1


def test_cost_model_refuses_loads_slower_than_recompute(tmp_path):
    rng = random.Random(5)
    layout, _ = random_layout(rng, 32)
    bpb = layout.bytes_per_block
    # Recomputing one block takes 16 tokens / 1e6 tok/s = 16 us.
    cost = CostModel(
        prefill_tokens_per_s=1e6,
        tokens_per_block=16,
        block_bytes=bpb,
        bandwidth={"cpu": bpb / 1e-6, "disk": bpb / 1e-3},
        latency_s={"cpu": 0.0, "disk": 0.0},
    )
    assert cost.worth_loading("cpu", 4)  # 4 us < 64 us
    assert not cost.worth_loading("disk", 4)  # 4 ms + 4 us > 64 us
    orch, layout, _ = make(tmp_path, rng, cost=cost)
    cost.block_bytes = layout.bytes_per_block
    cost.bandwidth = {"cpu": layout.bytes_per_block / 1e-6, "disk": layout.bytes_per_block / 1e-3}
    keys = [b"p", b"q"]
    orch.offload(keys, [0, 1])
    orch.drain()
    orch.host.index.clear()
    plan = orch.plan(keys)
    assert plan.disk_hits == 2 and plan.load_disk == 0
    assert plan.refused == {"disk": {"cost": 2}}
    # Measured transfers move the estimate: a fast disk observation makes loading worth it.
    for _ in range(50):
        cost.observe("disk", 10**9, 1e-3)
    assert orch.plan(keys).load_disk == 2


def test_backpressure_recomputes_instead_of_queueing(tmp_path):
    import threading

    class HeldEngine(CpuTransferEngine):
        """Host -> device copies wait for the gate: a load stays in flight until it opens."""

        def copy_now(self, direction, block_ids, slots, sub_blocks=None, regions=None):
            if direction == "h2d":
                assert self.gate.wait(60)  # opened by the test; a bound only against a hang
            super().copy_now(direction, block_ids, slots, sub_blocks, regions)

    ts = [torch.randn(8, 2, 8, 8)]
    layout = BlockLayout.per_layer(ts)
    host = kv.HostTier(kv.TierConfig(4 * 4096, layout.bytes_per_block))
    engine = HeldEngine(layout, host.pool)
    engine.gate = threading.Event()
    orch = TierOrchestrator(host, engine, max_promotions_in_flight={"cpu": 1})
    orch.offload([b"a"], [0])
    orch.offload([b"b"], [1])
    orch.drain()
    orch.load([b"a"], [3], request_id=1)  # held: in flight
    plan = orch.plan([b"b"])
    assert plan.load_cpu == 0 and plan.refused == {"cpu": {"backpressure": 1}}
    engine.gate.set()
    (res,) = orch.drain()
    assert res.loaded_cpu == 1
    assert orch.plan([b"b"]).load_cpu == 1, "nothing in flight: loaded again"


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_guard_trips_on_tail_latency_and_recovers():
    clock = FakeClock()
    g = SloGuard("disk", GuardRule(p99_ms=20, window_s=5, recover_s=10, min_samples=10), clock=clock)
    for _ in range(50):
        clock.t += 0.05
        g.record(0.002)  # 2 ms: fine
    assert g.allows() and g.state()["trips"] == 0
    for _ in range(10):
        clock.t += 0.05
        g.record(0.100)  # 100 ms tail
    assert not g.allows()
    st = g.state()
    assert st["state"] == "bypassed" and st["trips"] == 1 and st["bypassed_for_s"] > 9
    clock.t += 10.1
    assert g.allows(), "back on probation after recover_s"
    # Old slow samples fell out of the window: fast samples keep it active.
    for _ in range(30):
        clock.t += 0.05
        g.record(0.001)
    assert g.allows() and g.state()["trips"] == 1


def test_guard_bypass_is_a_refusal_in_the_plan(tmp_path):
    orch, _, _ = make(tmp_path, random.Random(7), guards={"cpu": GuardRule(p99_ms=1, min_samples=1)})
    orch.offload([b"a"], [0])
    orch.drain()
    orch.guards["cpu"].record(0.5)
    plan = orch.plan([b"a"])
    assert plan.load_cpu == 0 and plan.refused == {"cpu": {"guard": 1}}
    assert orch.stats()["guards"]["cpu"]["state"] == "bypassed"


def test_bad_arguments_are_clear_errors(tmp_path):
    orch, layout, _ = make(tmp_path, random.Random(8))
    with pytest.raises(kv.InvalidArgumentError, match="gpu_block_ids"):
        orch.offload([b"a", b"b"], [0])
    with pytest.raises(kv.InvalidArgumentError, match="gpu_block_ids"):
        orch.offload([b"a"], [10_000])
    with pytest.raises(kv.InvalidArgumentError, match="gpu_hit_blocks"):
        orch.plan([b"a"], gpu_hit_blocks=5)
    with pytest.raises(kv.InvalidArgumentError, match="guards"):
        TierOrchestrator(orch.host, orch.engine, guards={"tape": GuardRule(p99_ms=1)})
    with pytest.raises(kv.InvalidArgumentError, match="p99_ms"):
        GuardRule(p99_ms=0)
    with pytest.raises(kv.InvalidArgumentError, match="prefill_tokens_per_s"):
        CostModel(prefill_tokens_per_s=0, tokens_per_block=16, block_bytes=4096)


def test_coalescing_merges_adjacent_blocks_and_slots():
    assert coalesce_runs([5, 3, 4, 9], [12, 10, 11, 1]) == [(3, 10, 3), (9, 1, 1)]
    assert coalesce_runs([1, 2], [5, 7]) == [(1, 5, 1), (2, 7, 1)]


class GroupGatedEngine(CpuTransferEngine):
    """Host->device copies of every region group but the first wait for the gate."""

    gate = None

    def copy_now(self, direction, block_ids, slots, sub_blocks=None, regions=None):
        if direction == "h2d" and regions not in (None, [0]):
            assert self.gate.wait(120)  # opened by the test after its wait below
        super().copy_now(direction, block_ids, slots, sub_blocks, regions)


def test_region_groups_land_in_order_and_report_readiness(tmp_path):
    import threading

    ts = [torch.randn(16, 2, 8, 8) for _ in range(3)]
    layout = BlockLayout.per_layer(ts)
    host = kv.HostTier(kv.TierConfig(8 * 4096, layout.bytes_per_block))
    engine = GroupGatedEngine(layout, host.pool)
    engine.gate = threading.Event()
    orch = TierOrchestrator(host, engine)
    orch.offload([b"a", b"b"], [0, 1])
    orch.drain()
    want = [[t[b].clone() for t in ts] for b in (0, 1)]
    for t in ts:
        t.zero_()
    orch.load([b"a", b"b"], [5, 6], request_id="r", region_groups=[[0], [1], [2]])
    deadline = time.monotonic() + 60  # layer 0 lands whatever the load; the bound only stops a hang
    while orch.groups_ready("r") < 1 and time.monotonic() < deadline:
        orch.poll()
        time.sleep(0.001)
    assert orch.groups_ready("r") == 1, "layer 0 is in place while the other layers wait"
    assert torch.equal(ts[0][5], want[0][0]) and not ts[1][5].any()
    engine.gate.set()
    (res,) = orch.drain()
    assert res.loaded_cpu == 2 and orch.groups_ready("r") is None
    assert all(torch.equal(ts[i][5 + j], want[j][i]) for i in range(3) for j in range(2))
    with pytest.raises(kv.InvalidArgumentError, match="regions"):
        orch.load([b"a"], [7], request_id="bad", region_groups=[[2, 1]])


def test_disk_blocks_smaller_than_host_blocks_are_refused(tmp_path):
    from kvtier_rs.orchestrator.disk_stager import DiskStager

    host = kv.HostTier(kv.TierConfig(4 * 8192, 8192))
    with DiskTier(str(tmp_path / "disk"), 16 * 4096, 4096, engine="pool") as disk:
        expected = r"disk: its blocks \(4096 B\) are smaller than the host tier's \(8192 B\)"
        with pytest.raises(kv.InvalidArgumentError, match=expected):
            DiskStager(host, disk)


def orchestrator_state(orch):
    """Everything a refused call must leave as it was."""
    return (
        orch.host.index.entries(),
        dict(orch.host.stats()),
        orch.counts.as_dict(),
        dict(orch._in_flight.loads),
        orch.pending(),
    )


@pytest.mark.parametrize(
    "bad_ids, why",
    [
        ([5, 5], "named more than once"),
        ([32, 33], "outside"),
        ([-1, 3], "outside"),
        ([2.9, 3], "must be integers"),
        ([4, True], "must be integers"),
        (7, "single block id"),
    ],
)
def test_load_with_bad_gpu_block_ids_changes_nothing(tmp_path, bad_ids, why):
    orch, layout, tensors = make(tmp_path, random.Random(11))
    keys = [b"a", b"b"]
    want = [block_bytes_of(layout, b) for b in (0, 1)]
    orch.offload(keys, [0, 1])
    orch.drain()
    before = orchestrator_state(orch)
    with pytest.raises(kv.InvalidArgumentError, match=f"`gpu_block_ids`.*{why}"):
        orch.load(keys, bad_ids, request_id="r")
    assert orchestrator_state(orch) == before, "a refused load pins, registers and counts nothing"
    assert orch.host.stats()["pinned_blocks"] == 0
    assert orch.groups_ready("r") is None
    # The same request id is free, and the load lands the right bytes.
    scramble(tensors)
    orch.load(keys, [np.int64(8), torch.tensor(9)], request_id="r")
    (res,) = orch.drain()
    assert (res.request_id, res.loaded_cpu, res.failed) == ("r", 2, 0)
    assert [block_bytes_of(layout, b) for b in (8, 9)] == want
    assert all(pins == 0 for _, _, pins, _ in orch.host.index.entries())


def test_offload_takes_only_integer_block_ids(tmp_path):
    orch, layout, _ = make(tmp_path, random.Random(12))
    for bad, why in (([2.9], "must be integers"), ([np.float32(2.0)], "must be integers"), (2, "single block id")):
        with pytest.raises(kv.InvalidArgumentError, match=f"`gpu_block_ids`.*{why}"):
            orch.offload([b"k"], bad)
        assert len(orch.host.index) == 0 and orch.pending() == 0, "nothing was reserved"
    t = orch.offload([b"k", b"j"], [np.int64(2), torch.tensor(3)])
    orch.drain()
    assert t.stored == [b"k", b"j"]
    got = orch.host.read([b"k", b"j"])
    assert got == [block_bytes_of(layout, 2), block_bytes_of(layout, 3)]


@pytest.mark.parametrize("single", [b"\x05\x06", bytearray(b"\x05\x06"), memoryview(b"\x05\x06"), "ab", 5])
def test_a_single_key_is_refused_where_a_chain_is_expected(tmp_path, single):
    orch, _, _ = make(tmp_path, random.Random(13))
    msg = "invalid argument `keys`: expected a sequence of keys, got a single key"
    with pytest.raises(kv.InvalidArgumentError, match=msg):
        orch.offload(single, [3, 4])
    with pytest.raises(kv.InvalidArgumentError, match=msg):
        orch.plan(single)
    with pytest.raises(kv.InvalidArgumentError, match=msg):
        orch.load(single, [3, 4], request_id="r")
    assert len(orch.host.index) == 0 and orch.pending() == 0 and orch.counts.lookups == 0
    # A tuple or a generator of keys is a chain.
    orch.offload((b"\x05", b"\x06"), iter([3, 4]))
    orch.drain()
    assert orch.plan(k for k in (b"\x05", b"\x06")).cpu_hits == 2


def test_a_load_the_engine_refuses_is_recomputed_and_leaves_no_pins(tmp_path):
    orch, layout, _ = make(tmp_path, random.Random(13))
    keys = [b"a", b"b"]
    orch.offload(keys, [0, 1])
    orch.drain()
    orch.engine.close()  # the engine now refuses copies (ClosedError)
    res = orch.load(keys, [4, 5], request_id="r")
    assert (res.loaded_cpu, res.failed) == (0, 2), "the blocks are recomputed"
    assert orch.pending() == 0 and orch.groups_ready("r") is None
    assert all(pins == 0 for _, _, pins, _ in orch.host.index.entries())


def _chain_on_disk_only(orch, layout, rng, name, n=4):
    """A chain of `n` blocks written through to disk and pushed out of the CPU tier (8 slots)."""
    keys = [f"{name}-{i}".encode() for i in range(n)]
    src = rng.sample(range(32), n)
    want = [block_bytes_of(layout, b) for b in src]
    orch.offload(keys, src)
    orch.drain()
    other = [f"{name}-push-{i}".encode() for i in range(8)]
    orch.offload(other, list(range(24, 32)))
    orch.drain()
    assert orch.host.index.lookup_prefix(keys) == 0 and orch.stager.disk.lookup_prefix(keys) == n
    return keys, want


def test_a_reservation_holds_its_blocks_until_bound(tmp_path):
    # What TensorRT-LLM needs: the hits it was promised cannot be evicted, or lose their CPU
    # staging slots, between the answer and the load.
    rng = random.Random(11)
    orch, layout, tensors = make(tmp_path, rng)
    disk_keys, want_disk = _chain_on_disk_only(orch, layout, rng, "d", 3)
    cpu_keys = [f"c-{i}".encode() for i in range(2)]
    cpu_src = [20, 21]
    want_cpu = [block_bytes_of(layout, b) for b in cpu_src]
    orch.offload(cpu_keys, cpu_src)
    orch.drain()
    # A chain whose head is in the CPU tier and whose tail is on disk.
    keys = cpu_keys + disk_keys
    res = orch.reserve(keys, request_id="r")
    assert (res.cpu, res.disk, res.blocks) == (2, 3, 5)
    # The reservation itself is no job in flight: only its read is (drain must not wait on it).
    assert orch.stager.reads_in_flight == 1 and orch.pending() == 1
    idx = orch.host.index.stats()
    assert (idx["pinned_blocks"], idx["writing_blocks"]) == (2, 3)
    # Everything else wants the CPU tier's 8 slots now: only the 3 unreserved ones are free.
    orch.drain()  # the read lands (and stays pinned, unbound)
    for i in range(4):
        orch.offload([f"flood-{i}-{j}".encode() for j in range(3)], [8 + j for j in range(3)])
        orch.drain()
    assert orch.host.index.lookup_prefix(keys) == 5, "a reserved block was evicted"
    scramble(tensors)
    dst = [0, 1, 2, 3, 4]
    orch.bind("r", dst)
    (result,) = orch.drain()
    assert (result.loaded_cpu, result.loaded_disk, result.failed) == (2, 3, 0)
    assert [block_bytes_of(layout, b) for b in dst] == want_cpu + want_disk
    assert orch.host.index.stats()["pinned_blocks"] == 0


def test_staged_says_when_a_reservations_reads_are_in_and_how_many_blocks_they_hold(tmp_path):
    # TensorRT-LLM's async loads report a parked request once its blocks are all in CPU slots
    # (staged) and copy them to the device only when it is back in a batch.
    rng = random.Random(16)
    orch, layout, _ = make(tmp_path, rng)
    disk_keys, _ = _chain_on_disk_only(orch, layout, rng, "d", 3)
    orch.offload([b"head"], [20])
    orch.drain()
    keys = [b"head", *disk_keys]
    assert orch.reserve(keys, request_id="r").blocks == 4
    assert orch.staged("r") is None, "the disk read is in flight until a poll takes its completion"
    orch.drain()
    assert orch.staged("r") == 4
    orch.bind("r", [0, 1, 2, 3])
    with pytest.raises(kv.InvalidArgumentError, match="'r' has no unbound reservation to query.*already bound"):
        orch.staged("r")
    (result,) = orch.drain()
    assert result.loaded == 4
    # A read that fails: fewer blocks held than reserved, and bind loads no more than that.
    orch.host.index.clear()
    orch.stager.disk._inject_fault("eio_read", 1)
    assert orch.reserve(disk_keys, request_id="short").blocks == 3
    orch.drain()
    held = orch.staged("short")
    assert held is not None and held < 3
    orch.bind("short", [0, 1, 2])
    (result,) = orch.drain()
    assert result.loaded == held
    with pytest.raises(kv.InvalidArgumentError, match="to query.*never reserved"):
        orch.staged("nope")


def test_a_disk_hit_without_a_cpu_slot_is_not_reserved(tmp_path):
    rng = random.Random(12)
    orch, layout, _ = make(tmp_path, rng)
    keys, _ = _chain_on_disk_only(orch, layout, rng, "d", 3)
    resident = [k for k, state, _, _ in orch.host.index.entries() if state == "ready"]
    orch.host.index.pin_for_load(resident)  # every CPU slot held by loads in flight
    plan = orch.plan(keys)
    assert plan.load_disk == 3  # the plan alone would promise these
    res = orch.reserve(keys, request_id="r", plan=plan)
    assert res.blocks == 0
    orch.release("r")
    assert orch.stats()["tiers"]["disk"]["index"]["pinned_blocks"] == 0


def test_release_gives_a_reservation_back_and_keeps_the_promotion(tmp_path):
    rng = random.Random(13)
    orch, layout, _ = make(tmp_path, rng)
    keys, _ = _chain_on_disk_only(orch, layout, rng, "d", 3)
    orch.offload([b"head"], [5])
    orch.drain()
    res = orch.reserve([b"head", *keys], request_id="r")
    assert (res.cpu, res.disk) == (1, 3)
    orch.release("r")
    assert orch.host.index.stats()["pinned_blocks"] == 0
    assert orch.drain() == []  # the read finishes; no load result for a released reservation
    # The read became an ordinary promotion: the chain is cached in the CPU tier, unpinned.
    assert orch.host.index.lookup_prefix(keys) == 3
    assert orch.host.index.stats()["pinned_blocks"] == 0
    st = orch.stats()
    assert st["load_released"] == 4 and st["load_failed"] == 0
    assert st["tiers"]["disk"]["promotions"] == 0  # nothing reached a device


def test_reservation_misuse_is_a_clear_error(tmp_path):
    rng = random.Random(14)
    orch, layout, _ = make(tmp_path, rng)
    orch.offload([b"a", b"b"], [1, 2])
    orch.drain()
    with pytest.raises(kv.InvalidArgumentError, match="'nope' has no unbound reservation to bind.*never reserved"):
        orch.bind("nope", [0])
    orch.reserve([b"a", b"b"], request_id="r")
    with pytest.raises(kv.InvalidArgumentError, match="already has a load in flight"):
        orch.reserve([b"a"], request_id="r")
    with pytest.raises(kv.InvalidArgumentError, match="1 ids for 2 reserved blocks"):
        orch.bind("r", [0])
    with pytest.raises(kv.InvalidArgumentError, match="gpu_block_ids"):
        orch.bind("r", [0, 0])
    assert orch.host.index.stats()["pinned_blocks"] == 2  # refused binds changed nothing
    orch.bind("r", [3, 4])
    with pytest.raises(kv.InvalidArgumentError, match="to release.*already bound"):
        orch.release("r")
    orch.drain()
    with pytest.raises(kv.InvalidArgumentError, match="to release.*never reserved, or finished"):
        orch.release("r")
    assert orch.host.index.stats()["pinned_blocks"] == 0


def test_a_released_read_still_in_flight_is_taken_over_by_the_next_reservation(tmp_path):
    # A request asked again before its first reservation's read landed: the blocks are being
    # written in the CPU tier, so a new promotion cannot start; the new reservation takes the
    # read over instead of recomputing the chain.
    rng = random.Random(15)
    orch, layout, tensors = make(tmp_path, rng)
    keys, want = _chain_on_disk_only(orch, layout, rng, "d", 3)
    assert orch.reserve(keys, request_id="first").disk == 3
    orch.release("first")
    res = orch.reserve(keys, request_id="again")  # no poll in between: the read is in flight
    assert (res.cpu, res.disk) == (0, 3)
    scramble(tensors)
    orch.bind("again", [7, 8, 9])
    (result,) = orch.drain()
    assert (result.loaded_disk, result.failed, result.unreserved) == (3, 0, 0)
    assert [block_bytes_of(layout, b) for b in (7, 8, 9)] == want
    assert orch.host.index.stats()["pinned_blocks"] == 0


def test_load_copies_wait_for_the_compute_stream_in_both_parts(tmp_path):
    """The destinations were just given to the request, and a forward pass still running may read
    them for the request that held them before: every copy of a load, the CPU part's at bind and
    the disk part's when its read lands, is ordered after the caller's compute stream."""

    class SpyEngine(CpuTransferEngine):
        def load(self, slots, block_ids, *, after_stream=None, **kw):
            self.seen.append(after_stream)
            return super().load(slots, block_ids, after_stream=after_stream, **kw)

    rng = random.Random(11)
    layout, _ = random_layout(rng, 32)
    host = kv.HostTier(kv.TierConfig(2 * (-(-layout.bytes_per_block // 4096) * 4096), layout.bytes_per_block))
    engine = SpyEngine(layout, host.pool)
    engine.seen = []
    disk = open_failing_disk(tmp_path, host.pool.slot_bytes)
    orch = TierOrchestrator(host, engine, disk=disk)
    orch.offload([b"a", b"b"], [0, 1])
    orch.drain()
    orch.host.index.remove([b"b"])  # b only on disk now
    compute = object()  # stands for the engine's stream (the CPU engine ignores it)
    orch.load([b"a", b"b"], [8, 9], request_id="r", after_stream=compute)
    (res,) = orch.drain()
    assert (res.loaded_cpu, res.loaded_disk) == (1, 1)
    assert engine.seen == [compute, compute]


def _two_layer_tiers(tmp_path, *, engine_cls=CpuTransferEngine, with_disk=True, **kw):
    ts = [torch.randn(16, 2, 8, 8) for _ in range(2)]
    layout = BlockLayout.per_layer(ts)
    host = kv.HostTier(kv.TierConfig(8 * 4096, layout.bytes_per_block))
    engine = engine_cls(layout, host.pool, inline=True)
    disk = None
    if with_disk:
        disk = DiskTier(str(tmp_path / "disk"), 64 * 4096 * 2, host.pool.slot_bytes, admission="always", engine="pool")
    return TierOrchestrator(host, engine, disk=disk, **kw), ts


class RefusesSecondGroup(CpuTransferEngine):
    """Refuses (ClosedError, as when closed meanwhile) the second load job once armed."""

    armed = False
    loads = 0

    def load(self, *args, **kwargs):
        if self.armed:
            self.loads += 1
            if self.loads == 2:
                raise kv.ClosedError("closed: transfer engine")
        return super().load(*args, **kwargs)


def test_a_load_refused_after_its_first_region_group_is_failed_not_loaded(tmp_path):
    """The engine copies layer 0 and refuses layer 1: the load must come back failed (the
    engine recomputes it), never as loaded with a layer that was never copied."""
    orch, ts = _two_layer_tiers(tmp_path, engine_cls=RefusesSecondGroup, with_disk=False)
    orch.offload([b"a"], [0])
    orch.drain()
    for t in ts:
        t[5].zero_()
    orch.engine.armed = True
    orch.load([b"a"], [5], request_id="r", region_groups=[[0], [1]])
    (res,) = orch.drain()
    assert (res.loaded_cpu, res.failed) == (0, 1)
    assert not ts[1][5].any(), "layer 1 was indeed never copied"
    assert orch.stats()["load_failed"] == 1
    assert all(pins == 0 for _, _, pins, _ in orch.host.index.entries())


def test_a_closed_disk_tier_loses_no_completion_and_the_cpu_tier_serves_on(tmp_path):
    """A store's write-through finds the disk tier closed in the same poll that collects a
    load: the load is still reported and unpinned, and later offloads and plans go on with
    the CPU tier alone (the refused write-throughs are counted)."""
    orch, _ = _two_layer_tiers(tmp_path)
    orch.offload([b"a"], [0])
    orch.drain()
    orch.offload([b"x"], [1])  # an inline engine: both jobs have finished at submission
    orch.load([b"a"], [5], request_id="A")
    orch.stager.disk.close()
    (res,) = orch.poll()
    assert res.request_id == "A" and res.loaded_cpu == 1
    assert orch.pending() == 0 and all(pins == 0 for _, _, pins, _ in orch.host.index.entries())
    assert orch.stats()["tiers"]["disk"]["writes"]["not_started"] == 1
    assert orch.stats()["tiers"]["disk"]["store_refused"]["unavailable"] == 1
    orch.offload([b"y"], [2])
    orch.drain()
    plan = orch.plan([b"y", b"z"])
    assert (plan.cpu_hits, plan.disk_hits) == (1, 0)


class FailingEvents(EventStream):
    """An event stream whose publishing of one store raises (an internal error in the middle
    of handling a batch of completions)."""

    def publish(self, kind, tier, keys, reason=None):
        if kind == "stored" and list(keys) == [b"x"]:
            raise RuntimeError("injected bookkeeping error")
        return super().publish(kind, tier, keys, reason)


def test_an_error_handling_one_completion_loses_none_of_the_others(tmp_path):
    orch, _ = _two_layer_tiers(tmp_path, with_disk=False, events=FailingEvents())
    orch.offload([b"a"], [0])
    orch.drain()
    orch.offload([b"x"], [1])  # handled first in the batch, and raises
    orch.load([b"a"], [5], request_id="A")
    with pytest.raises(RuntimeError, match="injected"):
        orch.poll()
    (res,) = orch.poll()  # the load that finished in the same batch is not lost
    assert res.request_id == "A" and res.loaded_cpu == 1
    assert orch.pending() == 0 and all(pins == 0 for _, _, pins, _ in orch.host.index.entries())


def test_a_disk_write_through_refused_entirely_leaves_no_job_behind(tmp_path):
    """The disk tier refuses every key of a write-through (its admission here): the job it
    finished at once is taken, not left for a poll that never comes."""
    orch, _ = _two_layer_tiers(tmp_path)
    orch.stager.disk.close()
    orch.stager.disk = DiskTier(
        str(tmp_path / "disk2"), 64 * 4096 * 2, orch.host.pool.slot_bytes, admission="uses:255", engine="pool"
    )
    for i in range(20):
        orch.offload([f"k{i}".encode()], [i % 16])
        orch.drain()
    assert orch.stats()["tiers"]["disk"]["writes"]["refused"] == 20
    assert orch.stager.disk.poll() == [], "finished write jobs were left uncollected"


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"max_promotions_in_flight": {"cpu": "8"}}, "`max_promotions_in_flight['cpu']`: must be a positive int"),
        ({"max_promotions_in_flight": {"cpu": 0}}, "`max_promotions_in_flight['cpu']`: must be a positive int"),
        ({"max_promotions_in_flight": {"gpu": 4}}, "`max_promotions_in_flight`: unknown tiers ['gpu']"),
        ({"max_promotions_in_flight": [("cpu", 4)]}, "`max_promotions_in_flight`: expected a dict"),
        ({"max_disk_write_backlog": "1024"}, "`max_disk_write_backlog`: must be a positive int"),
        ({"max_disk_write_backlog": 0}, "`max_disk_write_backlog`: must be a positive int"),
        ({"disk_read_timeout_s": 0}, "`disk_read_timeout_s`"),
        ({"disk_read_timeout_s": "10"}, "`disk_read_timeout_s`"),
    ],
)
def test_orchestrator_settings_are_checked_at_construction(tmp_path, kwargs, words):
    orch, _ = _two_layer_tiers(tmp_path, with_disk=False)
    with pytest.raises(kv.InvalidArgumentError, match=re.escape(words)):
        TierOrchestrator(orch.host, orch.engine, **kwargs)


def test_a_plan_made_for_other_keys_is_refused(tmp_path):
    orch, ts = _two_layer_tiers(tmp_path, with_disk=False)
    keys = [b"k0", b"k1", b"k2"]
    orch.offload(keys, [0, 1, 2])
    orch.drain()
    with pytest.raises(kv.InvalidArgumentError, match="`plan`: made for 3 keys with 0 GPU hits"):
        orch.load(keys, [10, 11], gpu_hit_blocks=1, plan=orch.plan(keys, 0), request_id="r")
    with pytest.raises(kv.InvalidArgumentError, match="`plan`: made for 1 keys"):
        orch.reserve(keys, plan=orch.plan(keys[:1]), request_id="r")
    assert orch.pending() == 0 and all(pins == 0 for _, _, pins, _ in orch.host.index.entries())


@pytest.mark.parametrize("cpu_admission", ["priority:50", "uses:2"])
def test_a_disk_hit_is_staged_through_the_cpu_tier_whatever_its_admission_rule(tmp_path, cpu_admission):
    """Blocks the CPU tier admitted (priority 80, or used twice) are written through to disk;
    after a restart (a fresh CPU tier over the reopened disk tier) their disk hits are promoted
    through the CPU tier without asking its rule again: the promotion's default priority, or
    a use count that restarted, refused them and turned the hits into misses counted as 'no
    CPU slot'."""
    ts = [torch.randn(16, 2, 8, 8)]
    layout = BlockLayout.per_layer(ts)

    def start():
        host = kv.HostTier(kv.TierConfig(4 * 4096, layout.bytes_per_block, admission=cpu_admission))
        engine = CpuTransferEngine(layout, host.pool, inline=True)
        disk = DiskTier(str(tmp_path / "disk"), 64 * 4096 * 2, host.pool.slot_bytes, admission="always", engine="pool")
        return TierOrchestrator(host, engine, disk=disk)

    keys = [b"a", b"b"]
    want = [ts[0][i].clone() for i in (0, 1)]
    orch = start()
    for _ in range(2 if cpu_admission.startswith("uses") else 1):
        orch.offload(keys, [0, 1], priority=80)
        orch.drain()
    assert orch.stager.disk.lookup_prefix(keys) == 2
    orch.stager.disk.close()

    orch = start()
    plan = orch.plan(keys)
    assert (plan.cpu_hits, plan.disk_hits, plan.load_disk) == (0, 2, 2)
    orch.load(keys, [8, 9], request_id="r", plan=plan)
    (res,) = orch.drain()
    assert (res.loaded_disk, res.unreserved) == (2, 0)
    assert torch.equal(ts[0][8], want[0]) and torch.equal(ts[0][9], want[1])


def test_a_hung_disk_trips_its_guard_and_its_loads_give_up_on_it(tmp_path):
    """Every disk read hangs. The guard needs 20 samples but back-pressure lets only 4 reads be
    in flight, so the stall samples alone could never trip it: a tier with all its allowed
    promotions stalled trips outright. And loads waiting on the hung reads give their disk part
    up after disk_read_timeout_s (recomputed), instead of waiting for good; when the reads
    finally land, the blocks are in the CPU tier, owned by no load."""
    orch, layout, _ = make(
        tmp_path,
        random.Random(21),
        cpu_blocks=8,
        guards={"disk": GuardRule(p99_ms=5)},
        max_promotions_in_flight={"disk": 4},
        # Out of reach until the trip is checked (a slow machine must not give the reads up
        # first); lowered below once it has been.
        disk_read_timeout_s=3600.0,
    )
    chains = [[f"c{i}".encode()] for i in range(4)]
    for i, c in enumerate(chains):
        orch.offload(c, [i])
        orch.drain()
    orch.offload([f"push{i}".encode() for i in range(8)], list(range(8, 16)))
    orch.drain()
    orch.stager.disk = HeldReads(orch.stager.disk)
    for i, c in enumerate(chains):
        orch.load(c, [20 + i], request_id=i)
    assert orch.plan([b"c0"], count=False).refused == {"disk": {"backpressure": 1}}
    time.sleep(0.02)  # past the guard's 5 ms: every read in flight has stalled
    assert orch.poll() == []
    guard = orch.guards["disk"].state()
    assert guard["state"] == "bypassed" and guard["trips"] == 1, guard
    orch.disk_read_timeout_s = 0.2
    time.sleep(0.2)  # past disk_read_timeout_s (a lower bound: the loads were bound before it)
    done = orch.poll()
    assert sorted(r.request_id for r in done) == [0, 1, 2, 3]
    assert all((r.loaded_disk, r.failed) == (0, 1) for r in done)
    assert orch.stats()["load_timed_out"] == 4 and orch.stats()["load_failed"] == 4
    orch.stager.disk.release = True
    orch.drain()
    assert all(orch.host.index.lookup_prefix(c) == 1 for c in chains), "the late reads landed in the CPU tier"
    assert all(pins == 0 for _, _, pins, _ in orch.host.index.entries())


def given_up_one_at_a_time(tmp_path, n_loads, **kw):
    """Disk-resident chains loaded one request at a time from a disk whose reads hang, each
    given up after disk_read_timeout_s before the next arrives (a modest request rate): their
    reads stay in flight, owned by no load. Returns the orchestrator and the chains left."""
    orch, _, _ = make(tmp_path, random.Random(22), cpu_blocks=8, disk_read_timeout_s=0.05, **kw)
    chains = [[f"c{i}".encode()] for i in range(n_loads + 1)]
    for i, c in enumerate(chains):
        orch.offload(c, [i])
        orch.drain()
    orch.offload([f"push{i}".encode() for i in range(8)], list(range(8, 16)))
    orch.drain()
    assert all(orch.host.index.lookup_prefix(c) == 0 and orch.stager.disk.lookup_prefix(c) == 1 for c in chains)
    orch.stager.disk = HeldReads(orch.stager.disk)
    for i, c in enumerate(chains[:n_loads]):
        orch.load(c, [20 + i], request_id=i)
        time.sleep(0.06)  # past disk_read_timeout_s (and any guard threshold below it)
        (res,) = orch.poll()
        assert (res.request_id, res.loaded_disk, res.failed) == (i, 0, 1)
    return orch, chains[n_loads:]


def test_reads_given_up_on_a_hung_disk_count_against_its_back_pressure(tmp_path):
    """A read a load gave up on still holds a CPU staging slot and the disk's queue: counted as
    a promotion in flight. Before, they were not, so at one request at a time every load waited
    out the timeout and the hung reads piled up without bound, each holding a CPU slot."""
    orch, (left,) = given_up_one_at_a_time(tmp_path, 4, max_promotions_in_flight={"disk": 4})
    assert orch.plan(left, count=False).refused == {"disk": {"backpressure": 1}}
    orch.stager.disk.release = True
    orch.drain()
    assert orch.plan(left, count=False).load_disk == 1, "the landed reads no longer count"


def test_a_hung_disk_at_one_request_at_a_time_trips_its_guard(tmp_path):
    """One stall sample per load (4 here, below the 20 a trip needs) and one load in flight at a
    time: the reads given up on are what fill the tier's cap of promotions in flight, all of them
    stalled, which trips the guard outright. Before, they counted for nothing: the guard stayed
    active and every later request with disk hits waited out the timeout."""
    orch, (left,) = given_up_one_at_a_time(
        tmp_path, 4, max_promotions_in_flight={"disk": 4}, guards={"disk": GuardRule(p99_ms=5)}
    )
    guard = orch.guards["disk"].state()
    assert guard["state"] == "bypassed" and guard["trips"] == 1, guard
    assert orch.plan(left, count=False).refused == {"disk": {"guard": 1}}


def test_a_probe_without_a_remote_tier_still_refuses_bad_arguments(tmp_path):
    orch, _, _ = make(tmp_path, random.Random(1))
    try:
        assert orch.probe([b"k" * 16], 0), "nothing to ask: answered"
        with pytest.raises(kv.InvalidArgumentError) as ei:
            orch.probe([b"k" * 16], 2)
        assert ei.value.arg == "gpu_hit_blocks"
        with pytest.raises(kv.InvalidArgumentError) as ei:
            orch._planner.asked_of("remote", [b"k" * 16])  # no remote tier is staged here
        assert ei.value.arg == "tier"
        assert orch._planner.asked_of("disk", [b"k" * 16]) == [b"k" * 16]
    finally:
        orch.drain()
        orch.stager.disk.close()
