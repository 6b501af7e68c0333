"""Transfer layouts with several device blocks per host slot (vLLM's blocks_per_chunk) and
explicit, padded host offsets: the CPU engine and the CUDA engine's copy plan (replayed with
memmove on CPU memory) must put every byte at the same place, and read it back from there."""

from __future__ import annotations

import ctypes
import random
import threading
import time

import pytest
import torch

import kvtier_rs as kv
from kvtier_rs.transfer import BlockLayout, CpuTransferEngine, Region, TransferEngine
from kvtier_rs.transfer.base import host_runs
from kvtier_rs.transfer.cuda import copy_plan

NUM_BLOCKS = 24


def tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Two "layers" with different page sizes; the second is packed (row stride > page), as
    # vLLM's canonical caches may be.
    a = torch.randint(-128, 127, (NUM_BLOCKS, 96), dtype=torch.int8, generator=g)
    b_full = torch.randint(-128, 127, (NUM_BLOCKS, 80), dtype=torch.int8, generator=g)
    return [a, b_full]


def sub_layout(ts: list[torch.Tensor], bps: int) -> BlockLayout:
    """vLLM's slot: [tensor0: bps pages of 128 B | tensor1: bps pages of 64 B], each page padded
    beyond what is copied (96 and 48 bytes)."""
    a, b = ts
    regions = [
        Region(tensor=a, bytes_per_block=96, block_stride_bytes=96),
        Region(tensor=b, bytes_per_block=48, block_stride_bytes=80),  # packed rows
    ]
    return BlockLayout(regions, blocks_per_slot=bps, host_offsets=[0, 128 * bps], sub_block_strides=[128, 64])


def expected_host(layout: BlockLayout, ts, block_ids, slots, subs, slot_bytes, num_slots) -> bytes:  # noqa: PLR0917 - the copy's inputs, as the engine takes them
    """Where each byte must land, computed from the layout's definition alone."""
    host = bytearray(slot_bytes * num_slots)
    for b, s, j in zip(block_ids, slots, subs, strict=True):
        for r, region in enumerate(layout.regions):
            at = s * slot_bytes + layout.host_offsets[r] + j * layout.sub_block_strides[r]
            host[at : at + region.bytes_per_block] = region.tensor[b, : region.bytes_per_block].numpy().tobytes()
    return bytes(host)


def run_plan(pieces) -> None:
    for dst, dp, src, sp, width, height in pieces:
        for row in range(height):
            ctypes.memmove(dst + row * dp, src + row * sp, width)


def cases(bps: int, rng: random.Random):
    """Block->(slot, sub-block) maps: a request's chunks (adjacent sub-blocks, a first chunk
    entered mid-way), scattered pairs, and runs that cross slot boundaries."""
    n_slots = 8
    positions = [(s, j) for s in range(n_slots) for j in range(bps)]
    yield list(range(3, 3 + 2 * bps - 1)), positions[1 : 2 * bps]  # starts at sub-block 1
    picks = rng.sample(positions, 7)
    yield rng.sample(range(1, NUM_BLOCKS), 7), picks
    yield list(range(10, 10 + 3 * bps)), positions[bps : 4 * bps]  # three whole slots, one run


@pytest.mark.parametrize("bps", [1, 2, 4])
@pytest.mark.parametrize("engine", ["cpu", "cpu_inline", "plan"])
def test_sub_block_round_trip_matches_layout_definition(bps, engine):
    rng = random.Random(bps)
    for block_ids, pos in cases(bps, rng):
        ts = tensors(bps)
        layout = sub_layout(ts, bps)
        assert layout.slot_extent == 192 * bps - 16  # last region's padding is not needed
        pool = kv.HostPool(8 * 4096, layout.slot_extent)
        host = torch.frombuffer(pool, dtype=torch.uint8)
        slots, subs = [p[0] for p in pos], [p[1] for p in pos]
        want_host = expected_host(layout, ts, block_ids, slots, subs, pool.slot_bytes, pool.num_slots)
        sub_arg = subs if bps > 1 else None
        if engine != "plan":
            with CpuTransferEngine(layout, pool, inline=engine == "cpu_inline") as eng:
                res = eng.wait([eng.store(block_ids, slots, sub_blocks=sub_arg)])
            assert res[0].success and res[0].bytes == len(block_ids) * 144
        else:
            run_plan(copy_plan(layout, pool.ptr, pool.slot_bytes, "d2h", block_ids, slots, sub_arg))
        assert host.numpy().tobytes() == want_host
        # Load back into other device blocks (zeroed first); nothing else may change.
        before = [t.clone() for t in ts]
        for t in ts:
            t.zero_()
        dst = rng.sample(range(NUM_BLOCKS), len(block_ids))
        if engine != "plan":
            with CpuTransferEngine(layout, pool, inline=engine == "cpu_inline") as eng:
                assert eng.wait([eng.load(slots, dst, sub_blocks=sub_arg)])[0].success
        else:
            run_plan(copy_plan(layout, pool.ptr, pool.slot_bytes, "h2d", dst, slots, sub_arg))
        for region, t0 in zip(layout.regions, before, strict=True):
            w = region.bytes_per_block
            for src_b, dst_b in zip(block_ids, dst, strict=True):
                assert torch.equal(region.tensor[dst_b, :w], t0[src_b, :w])
            untouched = sorted(set(range(NUM_BLOCKS)) - set(dst))
            assert not region.tensor[untouched].any()
            # Bytes past the copied page (the packed row's tail) are never written.
            assert not region.tensor[:, w:].any()


def test_runs_never_cross_a_slot_and_merge_inside_one():
    layout = sub_layout(tensors(0), 4)
    # Blocks 5..12 into slot 2 sub 1..3, slot 3 sub 0..3, slot 4 sub 0: three runs.
    slots = [2, 2, 2, 3, 3, 3, 3, 4]
    subs = [1, 2, 3, 0, 1, 2, 3, 0]
    assert host_runs(layout, list(range(5, 13)), slots, subs) == [(5, 2, 1, 3), (8, 3, 0, 4), (12, 4, 0, 1)]
    pieces = copy_plan(layout, 0, 4096, "d2h", list(range(5, 13)), slots, subs)
    assert len(pieces) == 3 * len(layout.regions)
    # Host pitch inside a slot is the region's sub-block stride.
    assert {p[1] for p in pieces} == {128, 64}


def test_default_layout_is_unchanged_by_the_extension():
    ts = tensors(1)
    plain = BlockLayout.per_layer(ts)
    assert plain.blocks_per_slot == 1
    assert plain.host_offsets == (0, 96) and plain.slot_extent == plain.bytes_per_block == 176
    assert plain.sub_block_strides == (96, 80)
    two = BlockLayout([Region.rows_of(t) for t in ts], blocks_per_slot=2)
    assert two.host_offsets == (0, 192) and two.slot_extent == 352


def test_bad_sub_block_arguments_are_clear_errors():
    ts = tensors(2)
    with pytest.raises(kv.InvalidArgumentError, match="blocks_per_slot"):
        BlockLayout([Region.rows_of(ts[0])], blocks_per_slot=0)
    with pytest.raises(kv.InvalidArgumentError, match="host_offsets"):
        BlockLayout([Region.rows_of(t) for t in ts], host_offsets=[0, 50])  # overlaps region 0
    with pytest.raises(kv.InvalidArgumentError, match="sub_block_strides"):
        BlockLayout([Region.rows_of(ts[0])], blocks_per_slot=2, sub_block_strides=[10])
    layout = sub_layout(ts, 2)
    pool = kv.HostPool(4 * 4096, layout.slot_extent)
    with CpuTransferEngine(layout, pool) as eng:
        with pytest.raises(kv.InvalidArgumentError, match="sub_blocks"):
            eng.store([1, 2], [0, 0], sub_blocks=[0, 2])
        with pytest.raises(kv.InvalidArgumentError, match="sub_blocks"):
            eng.store([1, 2], [0, 0], sub_blocks=[0])
    small = kv.HostPool(4 * 4096, 4096)
    big = sub_layout(ts, 32)  # 32 sub-blocks of 192 B need more than one 4 KiB slot
    with pytest.raises(kv.InvalidArgumentError, match="needs"):
        CpuTransferEngine(big, small)


def test_wrapped_pool_is_the_buffer_in_place():
    import mmap

    m = mmap.mmap(-1, 6 * 4096)
    pool = kv.HostPool.wrap(m, 8192)
    assert pool.wrapped and pool.num_slots == 3 and pool.slot_bytes == 8192
    ts = tensors(3)
    layout = BlockLayout([Region.rows_of(t) for t in ts])
    with CpuTransferEngine(layout, pool) as eng:
        assert eng.wait([eng.store([4], [2])])[0].success
    assert m[2 * 8192 : 2 * 8192 + 96] == ts[0][4].numpy().tobytes()
    with pytest.raises(BufferError):
        m.close()  # the pool holds the mmap's buffer: it cannot be unmapped under it
    del eng, pool
    import gc

    gc.collect()
    m.close()  # released with the pool


def test_wrap_refuses_what_it_cannot_use_in_place():
    import mmap

    m = mmap.mmap(-1, 4 * 4096)
    with pytest.raises(kv.InvalidArgumentError, match="slot_bytes"):
        kv.HostPool.wrap(m, 5000)
    with pytest.raises(kv.InvalidArgumentError, match="aligned"):
        kv.HostPool.wrap(memoryview(m)[64:], 4096)
    with pytest.raises(kv.InvalidArgumentError, match="read-only"):
        kv.HostPool.wrap(bytes(8192), 4096)
    with pytest.raises(kv.InvalidArgumentError, match="buffer"):
        kv.HostPool.wrap(object(), 4096)
    with pytest.raises(kv.InvalidArgumentError, match="cannot hold one slot"):
        kv.HostPool.wrap(memoryview(m)[:4095], 4096)


def test_inline_cpu_engine_finishes_before_returning():
    ts = tensors(4)
    layout = BlockLayout([Region.rows_of(t) for t in ts])
    pool = kv.HostPool(4 * 4096, layout.slot_extent)
    eng = CpuTransferEngine(layout, pool, inline=True)
    job = eng.store([1, 2], [0, 1])
    assert eng.in_flight == 0 and not eng._thread.is_alive()  # no copy thread at all
    (res,) = eng.poll()
    assert (res.job_id, res.success, res.bytes) == (job, True, 2 * layout.bytes_per_block)
    eng.close()


@pytest.mark.parametrize("scattered", [False, True])
def test_cpu_engine_moves_exactly_the_blocks_named_adjacent_or_scattered(scattered):
    # Adjacent blocks, or scattered ones in descending slot order (how engines recycle blocks):
    # exactly the blocks named move, nothing else.
    ts = [torch.randn(64, 2, 8, 6) for _ in range(2)]
    layout = BlockLayout.per_layer(ts)
    pool = kv.HostPool(64 * 4096, layout.bytes_per_block)
    n = 18
    blocks = list(range(0, 2 * n, 2)) if scattered else list(range(10, 10 + n))
    slots = list(range(n)) if not scattered else list(range(n - 1, -1, -1))
    eng = CpuTransferEngine(layout, pool, inline=True)
    want = [[t[b].clone() for b in blocks] for t in ts]
    eng.wait([eng.store(blocks, slots)])
    before = [t.clone() for t in ts]
    dst = list(range(40, 40 + n))
    eng.wait([eng.load(slots, dst)])
    for li, t in enumerate(ts):
        assert all(torch.equal(t[d], w) for d, w in zip(dst, want[li], strict=True))
        untouched = [b for b in range(64) if b not in dst]
        assert torch.equal(t[untouched], before[li][untouched])


# ---- bad input is refused before anything is copied ------------------------------------------


def plain_engine(inline: bool, num_slots: int = 4) -> tuple[CpuTransferEngine, torch.Tensor, torch.Tensor]:
    x = torch.arange(8 * 64, dtype=torch.float32).reshape(8, 64)
    pool = kv.HostPool(num_slots * 4096, 4096)
    eng = CpuTransferEngine(BlockLayout.per_layer([x]), pool, inline=inline)
    return eng, x, torch.frombuffer(pool, dtype=torch.uint8)


@pytest.mark.parametrize("inline", [False, True])
def test_store_naming_one_host_slot_twice_is_refused_before_copying(inline):
    eng, x, host = plain_engine(inline)
    with eng:
        # Two blocks into slot 2: one of them would be lost, while the job claimed both.
        with pytest.raises(kv.InvalidArgumentError, match=r"`slots`: host slots \[2\] named more than once"):
            eng.store([0, 1], [2, 2])
        assert eng.in_flight == 0 and eng.poll() == [] and not host.any()
        # Reading one slot into several blocks, or one block into several slots, loses nothing.
        assert eng.wait([eng.store([3, 3], [0, 1])])[0].success
        assert eng.wait([eng.load([0, 0], [5, 6])])[0].success
        assert torch.equal(x[5], x[3]) and torch.equal(x[6], x[3])


def test_store_sub_blocks_may_share_a_slot_but_not_a_position():
    ts = tensors(5)
    layout = sub_layout(ts, 2)
    pool = kv.HostPool(4 * 4096, layout.slot_extent)
    host = torch.frombuffer(pool, dtype=torch.uint8)
    with CpuTransferEngine(layout, pool, inline=True) as eng:
        # Different sub-blocks of one slot are different bytes: allowed.
        assert eng.wait([eng.store([1, 2], [0, 0], sub_blocks=[0, 1])])[0].success
        host.zero_()
        for subs in ([1, 1], [0, 0], None):  # [0, 0] and None both mean sub-block 0 for both
            with pytest.raises(kv.InvalidArgumentError, match=r"sub-block\) positions \[\(0, \d\)\] named more"):
                eng.store([3, 4], [0, 0], sub_blocks=subs)
        assert eng.in_flight == 0 and eng.poll() == [] and not host.any()


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"sub_blocks": [0, 1.0]}, "sub_blocks"),  # int() would have taken 1.0 (and 0.9 as 0)
        ({"sub_blocks": [True, 0]}, "sub_blocks"),
        ({"regions": [0.0]}, "regions"),
        ({"regions": [False]}, "regions"),
    ],
)
def test_non_integer_sub_blocks_and_regions_are_refused(kwargs, arg):
    layout = sub_layout(tensors(6), 2)
    pool = kv.HostPool(4 * 4096, layout.slot_extent)
    with CpuTransferEngine(layout, pool, inline=True) as eng:
        with pytest.raises(kv.InvalidArgumentError, match=f"`{arg}`: .*must be integers"):
            eng.store([1, 2], [0, 1], **kwargs)
        assert eng.poll() == [] and not torch.frombuffer(pool, dtype=torch.uint8).any()


@pytest.mark.parametrize("field", ["bytes_per_block", "block_stride_bytes", "offset_bytes"])
@pytest.mark.parametrize("bad", [256.5, 16.0, True])
def test_region_integer_fields_refuse_floats_and_bools(field, bad):
    x = torch.zeros(8, 256, dtype=torch.uint8)
    fields = {"bytes_per_block": 16, "block_stride_bytes": 256, "offset_bytes": 0, field: bad}
    with pytest.raises(kv.InvalidArgumentError, match=f"`{field}`: must be an integer, got {type(bad).__name__}"):
        Region(x, **fields)


def test_region_integer_fields_take_integer_scalars_as_ints():
    import numpy as np

    x = torch.zeros(8, 256, dtype=torch.uint8)
    r = Region(x, np.int64(16), torch.tensor(256), offset_bytes=np.uint16(8))
    assert (r.bytes_per_block, r.block_stride_bytes, r.offset_bytes) == (16, 256, 8)
    assert all(type(v) is int for v in (r.bytes_per_block, r.block_stride_bytes, r.offset_bytes))
    assert BlockLayout([r]).bytes_per_block == 16
    # rows_of names the argument the caller passed, not the one it derives from it.
    with pytest.raises(kv.InvalidArgumentError, match="`offset_bytes`"):
        Region.rows_of(x, offset_bytes=0.5)
    with pytest.raises(kv.InvalidArgumentError, match="`bytes_per_block`"):
        Region.rows_of(x, bytes_per_block=16.7)


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"host_offsets": [0, 256.5]}, "host_offsets"),
        ({"blocks_per_slot": 2, "sub_block_strides": [128.9, 64]}, "sub_block_strides"),
        ({"blocks_per_slot": 2.0}, "blocks_per_slot"),
        ({"blocks_per_slot": True}, "blocks_per_slot"),
    ],
)
def test_layout_offsets_and_strides_refuse_non_integers(kwargs, arg):
    regions = [Region.rows_of(t) for t in tensors(7)]
    with pytest.raises(kv.InvalidArgumentError, match=f"`{arg}`"):
        BlockLayout(regions, **kwargs)


# ---- close() ----------------------------------------------------------------------------------


class GateEngine(CpuTransferEngine):
    """The real CPU engine, whose copies wait (on whatever thread runs them) until the test
    opens the gate; `entered` says a copy has started."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def copy_now(self, *args, **kwargs):
        self.entered.set()
        if not self.gate.wait(120):  # opened by the test; a bound only against a hang
            raise RuntimeError("gate never opened")
        super().copy_now(*args, **kwargs)


def wait_until(cond) -> None:
    """Poll `cond` (a state change in another thread); a bound only so a bug cannot hang the suite."""
    deadline = time.monotonic() + 60
    while not cond():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.001)


@pytest.mark.parametrize("inline", [False, True])
def test_engine_refuses_jobs_after_close_and_close_is_idempotent(inline):
    eng, _, host = plain_engine(inline)
    eng.close()
    # Before: the threaded engine returned a job id no thread would ever run (wait() hung).
    with pytest.raises(kv.ClosedError, match=r"closed: cpu transfer engine; store\(\) after close"):
        eng.store([0], [0])
    with pytest.raises(kv.ClosedError, match=r"load\(\) after close"):
        eng.load([0], [1])
    assert eng.in_flight == 0 and eng.poll() == [] and not host.any()
    eng.close()
    # Bad arguments are still named as such, closed or not.
    with pytest.raises(kv.InvalidArgumentError, match="slots"):
        eng.store([0], [99])


@pytest.mark.parametrize("inline", [False, True])
def test_jobs_submitted_before_close_finish_and_later_ones_are_refused(inline):
    x = torch.arange(8 * 64, dtype=torch.float32).reshape(8, 64)
    pool = kv.HostPool(4 * 4096, 4096)
    eng = GateEngine(BlockLayout.per_layer([x]), pool, inline=inline)
    jobs: list[int] = []
    if inline:
        # The store call itself copies (on its own thread here): close() must wait for it.
        submitter = threading.Thread(target=lambda: jobs.append(eng.store([1], [0])))
        submitter.start()
    else:
        # The first job is copying on the engine's thread, the second queued behind it.
        jobs += [eng.store([1], [0]), eng.store([2], [1])]
    assert eng.entered.wait(60)
    closer = threading.Thread(target=eng.close)
    closer.start()
    wait_until(lambda: eng._closed)
    with pytest.raises(kv.ClosedError):
        eng.store([3], [2])
    eng.gate.set()
    closer.join()
    if inline:
        submitter.join()
    res = eng.wait(jobs)
    assert len(res) == len(jobs) == (1 if inline else 2)
    assert all(r.success for r in res), res
    assert eng.in_flight == 0
    host = torch.frombuffer(pool, dtype=torch.uint8).view(4, 4096)
    for slot, block in enumerate([1] if inline else [1, 2]):
        assert host[slot, :256].numpy().tobytes() == x[block].numpy().tobytes()
    assert not host[2:].any()  # the refused store copied nothing


class NeverFinishes(TransferEngine):
    """An engine whose copies never complete (a stream that hangs, a lost callback)."""

    name = "stuck"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.held: list = []  # submitted jobs, never completed

    def _submit(self, job, block_ids, slots, after_stream):
        self.held.append(job)


def test_close_reports_jobs_it_could_not_finish_as_failed():
    eng = NeverFinishes(BlockLayout.per_layer([torch.zeros(8, 64)]), kv.HostPool(4 * 4096, 4096))
    job = eng.store([0], [0])
    assert eng.in_flight == 1
    eng.close()
    # The job is reported failed, once, with the reason (before, wait() never returned; the
    # timeout only keeps a regression from hanging the suite).
    (res,) = eng.wait([job], timeout=10)
    assert not res.success and res.bytes == 0 and "closed before this job finished" in res.error
    assert eng.in_flight == 0 and eng.poll() == []


def test_a_second_close_returns_only_once_the_first_has_finished_the_jobs():
    """close() promises that the engine's jobs are finished when it returns (the caller then
    frees the pool or the KV memory); a second close() from another thread while the first is
    still draining returned at once, with a copy still running."""
    x = torch.arange(8 * 64, dtype=torch.float32).reshape(8, 64)
    eng = GateEngine(BlockLayout.per_layer([x]), kv.HostPool(4 * 4096, 4096))
    job = eng.store([1], [0])
    assert eng.entered.wait(60)
    first = threading.Thread(target=eng.close)
    first.start()
    wait_until(lambda: eng._closed)
    second_done = threading.Event()
    second = threading.Thread(target=lambda: (eng.close(), second_done.set()))
    # The second close() is seen to wait for the first (rather than given a fixed time to
    # return, which a slow machine could outlast without it having got that far).
    second_waits = threading.Event()
    wait = eng._progress.wait

    def observed_wait(*args, **kwargs):
        if threading.current_thread() is second:
            second_waits.set()
        return wait(*args, **kwargs)

    eng._progress.wait = observed_wait
    second.start()
    wait_until(lambda: second_waits.is_set() or second_done.is_set())
    assert not second_done.is_set(), "close() returned while a job was still copying"
    eng.gate.set()
    first.join(60)
    second.join(60)
    assert second_done.is_set()
    assert [r.success for r in eng.wait([job], timeout=60)] == [True]


def test_a_close_interrupted_while_waiting_for_a_submission_leaves_the_next_close_to_finish():
    """Ctrl-C in a close() that waits for a store/load still handing its job over: that close()
    did not shut the engine down, so the next one must (it hung for good, waiting for the first
    one to finish, and the copy thread was never stopped)."""
    x = torch.zeros(8, 64)
    eng = CpuTransferEngine(BlockLayout.per_layer([x]), kv.HostPool(4 * 4096, 4096))
    with eng._lock:
        eng._submitting = 1  # a submission between the closed check and its hand-over

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    wait = eng._progress.wait
    eng._progress.wait = interrupted
    with pytest.raises(KeyboardInterrupt):
        eng.close()
    eng._progress.wait = wait
    with pytest.raises(kv.ClosedError):
        eng.store([0], [0])  # still refusing new jobs
    with eng._lock:
        eng._submitting = 0
        eng._progress.notify_all()
    second = threading.Thread(target=eng.close, daemon=True)
    second.start()
    second.join(60)
    assert not second.is_alive(), "the second close() never returned"
    assert not eng._thread.is_alive(), "the engine was never shut down"
