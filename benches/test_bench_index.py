"""pytest-benchmark benches of the index through Python: `pytest benches/` (or `make bench`).

Same operations as the criterion benches (benches/rust/index.rs), plus the Python call.
Timings are reported, never asserted; each bench checks its result so a broken call fails.
"""

from __future__ import annotations

import itertools

import pytest

import kvtier_rs as kv

CAPACITY = 8192
BATCH = 32


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") * 4 + b"\x00" * 4


@pytest.fixture(params=["lru", "arc", "s3fifo", "lhd"])
def filled(request):
    ix = kv.BlockIndex(CAPACITY, policy=request.param)
    keys = [key(i) for i in range(CAPACITY)]
    ix.prepare_store(keys)
    ix.complete_store(keys)
    return ix, keys


def test_lookup_one(benchmark, filled):
    ix, keys = filled
    assert benchmark(ix.lookup_one, keys[123])


def test_lookup_prefix_batch(benchmark, filled):
    ix, keys = filled
    assert benchmark(ix.lookup_prefix, keys[:BATCH]) == BATCH


def test_touch_batch(benchmark, filled):
    ix, keys = filled
    benchmark(ix.touch, keys[:BATCH])
    assert ix.stats()["touches"] >= BATCH


def test_store_evict_one(benchmark, filled):
    ix, _ = filled
    counter = itertools.count(CAPACITY)

    def store_one():
        k = key(next(counter))
        slot = ix.prepare_store_one(k)
        ix.complete_store_one(k)
        return slot

    assert benchmark(store_one) is not None


def test_store_evict_batch(benchmark, filled):
    ix, _ = filled
    counter = itertools.count(CAPACITY, BATCH)

    def store_batch():
        base = next(counter)
        ks = [key(base + j) for j in range(BATCH)]
        out = ix.prepare_store(ks)
        ix.complete_store(out.keys)
        return out

    assert len(benchmark(store_batch).keys) == BATCH
