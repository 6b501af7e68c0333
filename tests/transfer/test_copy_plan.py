"""The CUDA engine's copy plan, executed on CPU memory with memmove: the address arithmetic
(regions, strides, host offsets, coalesced runs, 2-D pieces and their 1-D flattening) must move
exactly the bytes the CPU engine moves. The GPU itself is exercised by benches/gpu_check.py."""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

import kvtier_rs as kv
from kvtier_rs.transfer import BlockLayout, Region
from kvtier_rs.transfer.cuda import copy_plan, flatten_1d


def layouts(rng):
    ts = [torch.randn(16, 2, 8, 12) for _ in range(3)]
    yield BlockLayout.per_layer(ts), ts
    kvs = [torch.randn(2, 16, 4, 3, 8).half() for _ in range(2)]
    yield BlockLayout.kv_split(kvs), kvs
    pool = torch.randn(16, 4, 2, 8, 6)
    per = pool[0].numel() * 4 // 4
    yield BlockLayout([Region.rows_of(pool, offset_bytes=i * per, bytes_per_block=per) for i in range(4)]), [pool]


def block_bytes(layout, b):
    return b"".join(r.byte_rows()[b].numpy().tobytes() for r in layout.regions)


def run_2d(pieces):
    for dst, dp, src, sp, width, height in pieces:
        for row in range(height):
            ctypes.memmove(dst + row * dp, src + row * sp, width)


def run_1d(pieces):
    for d, s, n in zip(*flatten_1d(pieces), strict=True):
        ctypes.memmove(d, s, n)


@pytest.mark.parametrize("runner", [run_2d, run_1d])
def test_copy_plan_moves_exactly_the_blocks(runner):
    rng = random.Random(3)
    for layout, tensors in layouts(rng):
        pool = kv.HostPool(16 * (-(-layout.bytes_per_block // 4096) * 4096), layout.bytes_per_block)
        host = torch.frombuffer(pool, dtype=torch.uint8).view(pool.num_slots, pool.slot_bytes)
        src = [3, 4, 5, 9, 0, 1]  # two runs plus a single, out of order
        slots = [7, 8, 9, 2, 14, 15]
        want = [block_bytes(layout, b) for b in src]
        runner(copy_plan(layout, pool.ptr, pool.slot_bytes, "d2h", src, slots))
        for s, w in zip(slots, want, strict=True):
            assert host[s, : layout.bytes_per_block].numpy().tobytes() == w
        for t in tensors:
            t.zero_()
        dst = [10, 11, 12, 2, 6, 13]
        runner(copy_plan(layout, pool.ptr, pool.slot_bytes, "h2d", dst, slots))
        assert [block_bytes(layout, b) for b in dst] == want
        assert all(not any(block_bytes(layout, b)) for b in set(range(16)) - set(dst))


def test_adjacent_blocks_become_one_piece_per_region():
    layout, _ = next(layouts(random.Random(0)))
    pool = kv.HostPool(16 * 4096 * 2, layout.bytes_per_block)
    pieces = copy_plan(layout, pool.ptr, pool.slot_bytes, "d2h", [4, 5, 6, 7], [0, 1, 2, 3])
    assert len(pieces) == len(layout.regions)
    assert all(height == 4 for *_, height in pieces)


def test_region_subset_moves_only_those_regions():
    layout, tensors = next(layouts(random.Random(0)))  # 3 per-layer regions
    pool = kv.HostPool(16 * 8192, layout.bytes_per_block)
    host = torch.frombuffer(pool, dtype=torch.uint8).view(pool.num_slots, pool.slot_bytes)
    run_2d(copy_plan(layout, pool.ptr, pool.slot_bytes, "d2h", [2], [0]))
    want = block_bytes(layout, 2)
    for t in tensors:
        t.zero_()
    run_2d(copy_plan(layout, pool.ptr, pool.slot_bytes, "h2d", [5], [0], regions=[1]))
    got = [r.byte_rows()[5].numpy().tobytes() for r in layout.regions]
    off, n = layout.host_offsets[1], layout.regions[1].bytes_per_block
    assert got[1] == want[off : off + n]
    assert not any(got[0]) and not any(got[2])
    assert host[0, : layout.bytes_per_block].numpy().tobytes() == want
