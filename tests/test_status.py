"""`kvtier status --dir ROOT` and `disk_status`: what a disk tier holds, read without changing
anything, also while another tier (this process or another) holds the directory open."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
from _disk_util import BLOCK, Host, make_tier, read, stride, write

from kvtier_rs._core import DirectoryLockedError, DiskIoError, InvalidArgumentError, disk_status
from kvtier_rs.cli import main


def snapshot(root) -> dict:
    """Every file's mode, size, mtime and content hash, and the directory's own mtime."""
    out = {".": os.stat(root).st_mtime_ns}
    for name in sorted(os.listdir(root)):
        st = os.stat(root / name)
        with open(root / name, "rb") as f:
            digest = hashlib.blake2b(f.read()).hexdigest()
        out[name] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return out


def test_status_of_an_open_tier_changes_nothing_and_keeps_it_locked(tmp_path):
    root = tmp_path / "t"
    host = Host(8)
    with make_tier(root, "pool", blocks=8, num_files=2) as tier:
        write(tier, host, [1, 2, 3, b"k4"])
        before = snapshot(root)
        s = disk_status(root)
        assert snapshot(root) == before
        assert (s["blocks"], s["bytes"], s["damaged_slots"]) == (4, 4 * BLOCK, 0)
        assert s["capacity_blocks"] == 8 and s["num_files"] == 2 and s["block_bytes"] == BLOCK
        assert s["blocks"] + s["free_slots"] + s["damaged_slots"] + s["stale_copies"] == 8
        assert (s["min_generation"], s["max_generation"]) == (1, 4)
        # The tier still owns the directory and still serves.
        with pytest.raises(DirectoryLockedError):
            make_tier(root, "pool", blocks=8, num_files=2)
        assert set(read(tier, host, [1, 2, 3, b"k4"])) == {1, 2, 3, b"k4"}
        # The CLI, from another process, while this one holds the tier open.
        r = subprocess.run(
            [sys.executable, "-m", "kvtier_rs.cli", "status", "--dir", str(root), "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["blocks"] == 4
        assert out["open_by"]["state"] in ("open", "unknown")  # unknown where /proc/locks is absent
        if out["open_by"]["state"] == "open":
            assert out["open_by"]["pid"] == os.getpid()
        assert snapshot(root) == before


def test_damaged_and_stale_slots_are_counted(tmp_path, capsys):
    root = tmp_path / "t"
    host = Host(8)
    with make_tier(root, "pool", blocks=4, num_files=1) as tier:
        write(tier, host, [1, 2, 3])
    slab = root / "slab-000.kvt"
    # Flip a header byte of slot 1, and a payload byte of slot 2 (only --verify sees that).
    with open(slab, "r+b") as f:
        for off in (stride() + (-(-BLOCK // 4096) * 4096) + 60, 2 * stride() + 500):
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0x40]))
    before = snapshot(root)
    s = disk_status(root)
    assert (s["blocks"], s["damaged_slots"], s["free_slots"]) == (2, 1, 1)
    v = disk_status(root, verify=True)
    assert (v["blocks"], v["damaged_slots"], v["verified_payloads"]) == (1, 2, True)
    assert main(["status", "--dir", str(root)]) == 0
    text = capsys.readouterr().out
    assert "damaged slots:   1" in text and "blocks:          2" in text
    assert main(["status", "--dir", str(root), "--verify"]) == 0
    assert "damaged slots:   2" in capsys.readouterr().out
    assert snapshot(root) == before
    # Reopening agrees with the scan: the damaged slot is dropped, the rest served.
    with make_tier(root, "pool", blocks=4, num_files=1) as tier:
        assert tier.stats()["recovery_discarded"] == 1
        assert len(tier) == 2


def test_not_a_tier_directory_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(DiskIoError, match="kvtier-disk.meta"):
        disk_status(tmp_path)
    with pytest.raises(DiskIoError, match="not a directory"):
        disk_status(tmp_path / "missing")
    with pytest.raises(InvalidArgumentError, match="path"):
        disk_status("")
    assert os.listdir(tmp_path) == []  # nothing created
    assert main(["status", "--dir", str(tmp_path)]) == 2
    assert "kvtier status: error" in capsys.readouterr().err
    assert main(["status", "--dir", str(tmp_path / "nope")]) == 2
    assert not (tmp_path / "nope").exists()


def test_missing_slab_is_named(tmp_path):
    root = tmp_path / "t"
    with make_tier(root, "pool", blocks=4, num_files=2):
        pass
    os.remove(root / "slab-001.kvt")
    with pytest.raises(DiskIoError, match="slab-001.kvt"):
        disk_status(root)
    assert not (root / "slab-001.kvt").exists()
