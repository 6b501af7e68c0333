"""The orchestrator's DiskStager on a real disk tier, called directly: pins it takes on CPU blocks
are all given back, a disk tier it cannot stage through is refused at construction, and poll()
handles every result even after the disk tier was closed."""

from __future__ import annotations

import pytest

import kvtier_rs as kv
from kvtier_rs._core import DiskTier
from kvtier_rs.orchestrator.disk_stager import DiskStager
from kvtier_rs.tiers.events import EventStream

BLOCK = 8192


def host_tier(blocks: int, block: int = BLOCK) -> kv.HostTier:
    return kv.HostTier(kv.TierConfig(capacity_bytes=blocks * block, block_bytes=block))


def disk_tier(path, block: int = BLOCK) -> DiskTier:
    data = -(-block // 4096) * 4096
    return DiskTier(str(path), 16 * (data + 4096), block, admission="always", engine="pool")


def test_write_through_with_a_key_listed_twice_leaves_no_pin_behind(tmp_path):
    host = host_tier(4)
    host.store([b"a", b"b"], [bytes([1]) * BLOCK, bytes([2]) * BLOCK])
    with disk_tier(tmp_path / "d") as disk:
        stager = DiskStager(host, disk)
        assert stager.write_through([b"a", b"a", b"b"]) == 2
        stager.drain(30)
        assert stager.write_backlog == 0
        assert disk.contains([b"a", b"b"]) == [True, True]
        assert host.index.state(b"a") == ("ready", 0, 0), "the repeated key is still pinned"
        # Every CPU slot can be reused: none is held by a pin that nothing will release.
        out = host.index.prepare_store([b"f", b"g", b"h", b"i"])
        assert sorted(out.evicted) == [b"a", b"b"]


def test_a_disk_whose_blocks_do_not_fit_the_host_slots_is_refused_at_construction(tmp_path):
    # 12000-byte disk blocks need 12288-byte host slots (rounded to 4 KiB); these are 8192.
    host = host_tier(4)
    with disk_tier(tmp_path / "d", block=12_000) as disk:
        with pytest.raises(kv.InvalidArgumentError, match=r"disk: .*12288 B.*host pool's slots are 8192 B"):
            DiskStager(host, disk)


def test_poll_after_the_disk_tier_was_closed_handles_every_result(tmp_path):
    host = host_tier(4)
    disk = disk_tier(tmp_path / "d")
    stager = DiskStager(host, disk, events=EventStream())
    # Two promotions of blocks the disk does not hold: both reads fail (misses).
    jobs = [stager.promote([b"missing-1"]), stager.promote([b"missing-2"])]
    assert None not in jobs
    assert disk.wait_idle(30)
    disk.close()
    done = stager.poll()
    assert sorted(d.job_id for d in done) == sorted(jobs)
    assert all(d.ok_prefix == 0 for d in done)
    assert stager.reads_in_flight == 0
    # The CPU slots reserved for the reads were given back, not left "writing" for good.
    assert host.index.state(b"missing-1") is None
    assert host.index.state(b"missing-2") is None
    removed = [e for e in stager.events.drain(100) if e.kind == "removed"]
    assert sorted(k for e in removed for k in e.keys) == [b"missing-1", b"missing-2"]
