"""`kvtier status --dir ROOT` and `disk_status`: what a disk tier holds, read without changing
anything, also while another tier (this process or another) holds the directory open."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
from support.disk import BLOCK, Host, make_tier, payload, read, stride, write

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


def set_meta(root, **fields) -> None:
    path = root / "kvtier-disk.meta"
    lines = path.read_text().splitlines()
    path.write_text("".join(f"{k}={fields.get(k, v)}\n" for k, v in (line.split("=", 1) for line in lines)))


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"block_bytes": 10**15}, "block_bytes=1000000000000000 is outside"),
        ({"block_bytes": 2**64 - 1}, "block_bytes=18446744073709551615 is outside"),
        ({"num_files": 0}, "num_files=0 is outside"),
        ({"slots_per_file": 10**12}, "slots_per_file=1000000000000 is outside"),
    ],
)
def test_implausible_metadata_is_refused_by_status_and_open_alike(tmp_path, fields, why):
    root = tmp_path / "t"
    make_tier(root, "pool", blocks=4, num_files=2).close()
    set_meta(root, **fields)
    before = snapshot(root)
    with pytest.raises(DiskIoError, match=f"damaged metadata \\(.*{why}"):
        disk_status(root, verify=True)
    assert snapshot(root) == before
    with pytest.raises(DiskIoError, match=f"damaged metadata \\(.*{why}"):
        make_tier(root, "pool", blocks=4)
    after = snapshot(root)
    # The tier took its lock (writing its pid into the lock file) before it read the metadata.
    for files in (before, after):
        del files["kvtier-disk.lock"]
    assert after == before, "the tier refused without touching metadata or slabs"


@pytest.mark.parametrize("line", ["block_bytes=5", "block_bytes=12000", "num_files=2"])
def test_metadata_with_a_repeated_key_is_refused_by_status_and_open_alike(tmp_path, line):
    """A second `block_bytes=` line (appended, or a line duplicated) was ignored: status and open
    both took the first value. A tier writes each key once, so the file is damaged."""
    root = tmp_path / "t"
    make_tier(root, "pool", blocks=4, num_files=2).close()
    with open(root / "kvtier-disk.meta", "a") as f:
        f.write(line + "\n")
    before = snapshot(root)
    key = line.split("=")[0]
    want = f"kvtier-disk.meta.*damaged metadata \\({key}= is given more than once\\)"
    with pytest.raises(DiskIoError, match=want):
        disk_status(root)
    with pytest.raises(DiskIoError, match=want):
        make_tier(root, "pool", blocks=4)
    after = snapshot(root)
    for files in (before, after):
        del files["kvtier-disk.lock"]
    assert after == before, "the tier refused without touching metadata or slabs"


def test_slots_past_the_end_of_short_slabs_are_counted_not_read(tmp_path):
    # Metadata claiming 100M slots a file over files of 4 slots: the scan reads only what the
    # files hold (it used to read every claimed slot, which never finished).
    root = tmp_path / "t"
    host = Host(4)
    with make_tier(root, "pool", blocks=8, num_files=2) as tier:
        write(tier, host, [1, 2])
    set_meta(root, slots_per_file=100_000_000)
    s = disk_status(root)
    assert s["capacity_blocks"] == 200_000_000 and s["blocks"] == 2
    assert s["missing_slots"] == 200_000_000 - 8
    assert s["blocks"] + s["free_slots"] + s["damaged_slots"] + s["stale_copies"] + s["missing_slots"] == 200_000_000


def test_truncated_slab_status_agrees_with_a_reopen(tmp_path):
    root = tmp_path / "t"
    host = Host(8)
    with make_tier(root, "pool", blocks=8, num_files=1) as tier:
        write(tier, host, list(range(8)))
    data = -(-BLOCK // 4096) * 4096
    # Cut 200 bytes into slot 5's header page (its fields survive), dropping slots 6 and 7.
    os.truncate(root / "slab-000.kvt", 5 * stride() + data + 200)
    s = disk_status(root)
    assert (s["blocks"], s["damaged_slots"], s["missing_slots"]) == (6, 0, 2)
    with make_tier(root, "pool", blocks=8, num_files=1) as tier:
        assert len(tier) == 6
        assert read(tier, host, list(range(6))) == {k: payload(k) for k in range(6)}


def test_a_slab_that_is_not_a_regular_file_is_refused_at_once(tmp_path):
    root = tmp_path / "t"
    make_tier(root, "pool", blocks=4, num_files=2).close()
    os.remove(root / "slab-001.kvt")
    os.mkfifo(root / "slab-001.kvt")  # opening it for reading would wait for a writer
    with pytest.raises(DiskIoError, match="slab-001.kvt: not a regular file"):
        disk_status(root)


def test_an_open_tier_shows_as_open_after_its_lock_file_is_deleted(tmp_path, capsys):
    root = tmp_path / "t"
    with make_tier(root, "pool", blocks=4, num_files=1):
        (root / "kvtier-disk.lock").unlink()
        assert main(["status", "--dir", str(root)]) == 0
        assert f"open by pid {os.getpid()}" in capsys.readouterr().out
    assert main(["status", "--dir", str(root)]) == 0
    assert "in use:          not open" in capsys.readouterr().out


def test_status_text_reports_missing_slots(tmp_path, capsys):
    root = tmp_path / "t"
    make_tier(root, "pool", blocks=8, num_files=1).close()
    os.truncate(root / "slab-000.kvt", 3 * stride())
    assert main(["status", "--dir", str(root)]) == 0
    assert "missing slots:   5 (past the end of slab files shorter" in capsys.readouterr().out


def test_a_disk_root_reports_each_tier_directory_under_it(tmp_path, capsys):
    # The vLLM adapter makes a tier directory per model under its disk root; `--dir` given that
    # root reports each, and marks those of an earlier format (never read by this kvtier).
    # Before: the root is not a tier directory, so status refused it.
    current, dp1, earlier = "tiny_llama_f2_0123456789ab", "tiny_llama_dp1_f2_abcdef012345", "tiny_llama_0123456789ab"
    host = Host(4)
    with make_tier(tmp_path / current, "pool", blocks=4, num_files=1) as tier:
        write(tier, host, [1, 2])
    make_tier(tmp_path / dp1, "pool", blocks=8, num_files=2).close()
    with make_tier(tmp_path / earlier, "pool", blocks=4, num_files=1) as tier:
        write(tier, host, [3])
    (tmp_path / "notes").mkdir()  # neither a tier nor reported
    (tmp_path / "README").write_text("x")
    before = {name: snapshot(tmp_path / name) for name in (current, dp1, earlier)}

    assert main(["status", "--dir", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["root"] == str(tmp_path)
    by_name = {t["name"]: t for t in out["tiers"]}
    assert list(by_name) == sorted([current, dp1, earlier])
    assert {n: t["earlier_format"] for n, t in by_name.items()} == {current: False, dp1: False, earlier: True}
    assert (by_name[current]["blocks"], by_name[dp1]["blocks"], by_name[earlier]["blocks"]) == (2, 0, 1)
    assert by_name[dp1]["capacity_blocks"] == 8 and by_name[current]["path"] == str(tmp_path / current)
    assert all(t["open_by"]["state"] in ("closed", "unknown") for t in out["tiers"])

    assert main(["status", "--dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"disk root {tmp_path}: 3 tier directories\n")
    assert f"earlier format (never read by this kvtier; remove to free the space): {earlier}\n" in text
    for name in (current, dp1, earlier):
        assert f"disk tier {tmp_path / name}\n" in text
    assert text.count("format:          earlier") == 1
    assert "notes" not in text and "README" not in text
    # Read-only, as for one tier.
    assert {name: snapshot(tmp_path / name) for name in (current, dp1, earlier)} == before
    # A tier directory itself is reported as before (its JSON unchanged: no "tiers").
    assert main(["status", "--dir", str(tmp_path / current), "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert "tiers" not in one and one["blocks"] == 2
    assert main(["status", "--dir", str(tmp_path / earlier)]) == 0
    assert "format:          earlier" in capsys.readouterr().out


def test_a_disk_root_with_an_unreadable_tier_reports_the_others(tmp_path, capsys):
    good, bad = "m_f2_0123456789ab", "m_f2_abcdef012345"
    make_tier(tmp_path / good, "pool", blocks=4, num_files=1).close()
    make_tier(tmp_path / bad, "pool", blocks=4, num_files=2).close()
    os.remove(tmp_path / bad / "slab-001.kvt")
    assert main(["status", "--dir", str(tmp_path), "--json"]) == 2
    captured = capsys.readouterr()
    tiers = {t["name"]: t for t in json.loads(captured.out)["tiers"]}
    assert tiers[good]["capacity_blocks"] == 4
    assert "slab-001.kvt" in tiers[bad]["error"]
    assert captured.err == "kvtier status: error: 1 of 2 tier directories could not be read\n"
    assert main(["status", "--dir", str(tmp_path)]) == 2
    assert "slab-001.kvt" in capsys.readouterr().out


@pytest.mark.parametrize("content", ["empty", "no tiers"])
def test_a_root_without_tier_directories_is_a_one_line_error(tmp_path, capsys, content):
    if content == "no tiers":
        (tmp_path / "m_f2_0123456789ab").mkdir()  # named like one, but holds no tier
        (tmp_path / "file").write_text("x")
    before = sorted(os.listdir(tmp_path))
    assert main(["status", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"kvtier status: error: --dir {tmp_path}: not a disk tier directory (no kvtier-disk.meta), "
        "and no tier directory under it\n"
    )
    assert sorted(os.listdir(tmp_path)) == before
