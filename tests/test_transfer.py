"""Transfer layouts with several device blocks per host slot (vLLM's blocks_per_chunk) and
explicit, padded host offsets: the CPU engine and the CUDA engine's copy plan (replayed with
memmove on CPU memory) must put every byte at the same place, and read it back from there."""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

import kvtier_rs as kv
from kvtier_rs.transfer import BlockLayout, CpuTransferEngine, Region
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


def expected_host(layout: BlockLayout, ts, block_ids, slots, subs, slot_bytes, num_slots) -> bytes:
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
