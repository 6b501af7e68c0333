"""The CPU tier's host memory shared by an engine's processes, and its seals: what one process
writes another reads, a geometry that disagrees or a rank that never mapped the region is
refused, the name does not outlive start-up, and the disk stager neither persists a slot nor
publishes a promotion that is not sealed for its block."""

from __future__ import annotations

import multiprocessing as mp
import os
from dataclasses import dataclass

import numpy as np
import pytest

from kvtier_rs._core import BlockIndex, DiskTier, HostPool, InvalidArgumentError, KvTierError
from kvtier_rs.orchestrator.disk_stager import DiskStager
from kvtier_rs.tiers.shared_region import SharedHostRegion, seal_of, seals_of

ROW = 8192


def region(tmp_path, rank, *, rows=4, ranks=2, name="e.region", **kw) -> SharedHostRegion:
    kw.setdefault("rank_bytes", ROW // max(ranks, 1))
    return SharedHostRegion(name, rows=rows, row_bytes=ROW, ranks=ranks, rank=rank, directory=tmp_path, **kw)


def _worker(directory, rank, ready, go):
    """A worker process: maps the region, writes its part of row 2 and seals it."""
    from pathlib import Path

    r = SharedHostRegion(
        "e.region", rows=4, row_bytes=ROW, ranks=2, rank_bytes=ROW // 2, rank=rank, directory=Path(directory)
    )
    part = memoryview(r.pool)[2 * ROW + rank * (ROW // 2) :][: ROW // 2]
    part[:] = bytes([rank + 1]) * (ROW // 2)
    r.seals.seal([2], seals_of([b"block"]), rank)
    ready.set()
    go.wait(60)
    del part
    r.close()


def test_what_each_worker_process_writes_the_scheduler_reads(tmp_path):
    ctx = mp.get_context("spawn")
    ready, go = [ctx.Event(), ctx.Event()], ctx.Event()
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), r, ready[r], go)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        assert all(e.wait(120) for e in ready), "the workers did not map the region"
        sched = region(tmp_path, None)
        sched.require_attached("test")
        row = bytes(memoryview(sched.pool)[2 * ROW : 3 * ROW])
        assert row == b"\x01" * (ROW // 2) + b"\x02" * (ROW // 2)
        assert sched.seals.matches([2], seals_of([b"block"])).tolist() == [True], "every rank sealed row 2"
        assert sched.seals.matches([1], seals_of([b"block"])).tolist() == [False]
        sched.unlink()
        assert list(tmp_path.iterdir()) == [], "the name is dropped once every rank mapped it"
    finally:
        go.set()
        for p in procs:
            p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    sched.close()


def test_a_rank_that_never_mapped_the_region_is_refused(tmp_path):
    w0 = region(tmp_path, 0)
    sched = region(tmp_path, None)
    with pytest.raises(KvTierError, match=r"worker rank\(s\) \[1\] of 2 have not mapped .*one machine"):
        sched.require_attached("KvtierOffloadingSpec")
    for r in (sched, w0):
        r.close()


def test_a_rank_recorded_by_a_dead_process_does_not_count(tmp_path):
    # A file left by an engine killed during start-up, reused under the same engine id.
    ctx = mp.get_context("fork")
    child = ctx.Process(target=lambda: region(tmp_path, 0).attach(0))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    sched = region(tmp_path, None, ranks=2)
    assert sched.attached_pids() == [0, 0]
    sched.attach(1)
    assert sched.attached_pids() == [0, os.getpid()]
    with pytest.raises(KvTierError, match=r"\[0\] of 2"):
        sched.require_attached("test")
    sched.close()


def test_a_process_with_another_geometry_is_refused_naming_the_setting(tmp_path):
    first = region(tmp_path, 0, rows=4)
    with pytest.raises(InvalidArgumentError, match=r"`total_bytes`: .*created by another process.*\(1, 4, 8192"):
        region(tmp_path, None, rows=5)
    first.close()
    assert list(tmp_path.iterdir()) == [], "the creator drops the name when it closes"


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"rows": 0}, "cannot hold one slot"),
        ({"rows": 2**32 + 1}, "more than 2\\^32 slots"),
        ({"ranks": 0}, "`ranks`"),
    ],
)
def test_bad_geometry_is_refused_before_anything_is_created(tmp_path, kw, match):
    with pytest.raises(InvalidArgumentError, match=match):
        region(tmp_path, None, **kw)
    assert list(tmp_path.iterdir()) == []


def test_a_region_larger_than_its_filesystem_is_a_clear_error(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    rows = free // ROW + 1024
    with pytest.raises(InvalidArgumentError, match=r"`total_bytes`: the CPU tier needs \d+ bytes of shared memory"):
        region(tmp_path, None, rows=rows)
    assert list(tmp_path.iterdir()) == [], "nothing is left behind"


def test_seals_are_per_rank_and_cleared_for_new_blocks(tmp_path):
    r = region(tmp_path, None)
    s = r.seals
    s.seal([0, 1], seals_of([b"a", b"b"]), 0)
    assert s.matches([0, 1], seals_of([b"a", b"b"]), 0).tolist() == [True, True]
    assert s.matches([0, 1], seals_of([b"a", b"b"])).tolist() == [False, False], "rank 1 has not sealed"
    s.seal([0], seals_of([b"a"]))
    assert s.matches([0], seals_of([b"a"])).tolist() == [True]
    s.clear([0])
    assert s.matches([0], seals_of([b"a"]), 0).tolist() == [False]
    assert seal_of(b"a") != seal_of(b"b") and seal_of(7) != 0
    r.close()


@dataclass(frozen=True)
class _Host:
    index: BlockIndex
    pool: HostPool
    block_bytes: int


def test_the_disk_stager_writes_and_publishes_only_sealed_slots(tmp_path):
    r = region(tmp_path, 0, rows=4, ranks=1, name="s.region")
    index = BlockIndex(4, tier="cpu", block_bytes=ROW)
    host = _Host(index, r.pool, ROW)
    disk = DiskTier(str(tmp_path / "disk"), 16 * (ROW + 4096), ROW, admission="always", engine="pool")
    stager = DiskStager(host, disk, seals=r.seals)
    out = index.prepare_store([b"sealed", b"unsealed"])
    rows = np.frombuffer(r.pool, dtype=np.uint8).reshape(4, ROW)
    for slot, byte in zip(out.slots, (7, 9), strict=True):
        rows[slot] = byte
    index.complete_store(list(out.keys), True)
    r.seals.seal([out.slots[0]], seals_of([b"sealed"]), 0)  # what a worker does after its copy
    # Only the sealed slot is persisted; the other is unpinned and counted.
    assert stager.write_through([b"sealed", b"unsealed"]) == 1
    stager.drain(30)
    assert disk.contains([b"sealed", b"unsealed"]) == [True, False]
    assert stager.counters.writes_dropped_unsealed == 1
    assert index.state(b"unsealed")[:2] == ("ready", 0), "no pin is left on the refused block"
    # A promotion seals its row once the read has verified.
    evicted = index.prepare_store([b"x1", b"x2", b"x3", b"x4"], admitted=True)
    index.complete_store(list(evicted.keys), False)
    job = stager.promote([b"sealed"])
    assert job is not None
    [done] = stager.drain(30)
    assert done.ok_prefix == 1
    slot = index.pin_for_load([b"sealed"])[0]
    assert r.seals.matches([slot], seals_of([b"sealed"])).tolist() == [True]
    assert (rows[slot] == 7).all()
    del rows
    index.unpin([b"sealed"])
    disk.close()
    r.close()
