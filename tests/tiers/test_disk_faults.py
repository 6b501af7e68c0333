"""Fault-injection matrix for the disk tier, run once per I/O engine.

Every case checks two things: no wrong byte is ever returned (``support.disk.read`` compares
every block reported ok with its expected payload), and the tier keeps serving afterwards
(a fresh write and read round trip succeeds).
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
from support import child_env
from support.disk import (
    BLOCK,
    ENGINES,
    Host,
    assert_back_to,
    call_once_the_gil_is_asked_for,
    make_tier,
    payload,
    read,
    require_engine,
    stride,
    tier_threads_and_fds,
    write,
)

from kvtier_rs._core import DiskIoError, DiskTier, IndexFailedError, InvalidArgumentError, _inject_spawn_failure


@pytest.fixture(params=ENGINES)
def engine(request):
    require_engine(request.param)
    return request.param


def slab_paths(path):
    return sorted(p for p in path.iterdir() if p.name.startswith("slab-"))


def still_serving(tier: DiskTier, host: Host) -> None:
    key = b"after-" + uuid.uuid4().hex.encode()
    _, res = write(tier, host, [key], first_slot=0)
    assert res.success, "the tier stopped accepting writes after a fault"
    assert read(tier, host, [key], first_slot=1) == {key: payload(key)}


def find_block(path, key_payload: bytes):
    """Locate a payload in the slab files by content (tests know what they wrote)."""
    for p in slab_paths(path):
        data = p.read_bytes()
        off = data.find(key_payload[:4096])
        if off >= 0:
            return p, off
    raise AssertionError("payload not found in any slab")


def flip(p, offset: int) -> None:
    with open(p, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


@pytest.mark.parametrize("where", ["payload", "header"])
def test_flipped_byte_is_a_miss(tmp_path, engine, where):
    host = Host(8)
    with make_tier(tmp_path, engine) as tier:
        keys = [1, 2, 3]
        write(tier, host, keys)
        p, off = find_block(tmp_path, payload(2))
        flip(p, off + (5000 if where == "payload" else -(-BLOCK // 4096) * 4096 + 50))
        got = read(tier, host, keys)
        assert set(got) == {1, 3}
        stats = tier.stats()
        assert stats["checksum_failures"] == 1
        # The damaged block's slot was freed and the key forgotten.
        assert tier.contains([2]) == [False]
        assert len(tier) == 2
        still_serving(tier, host)


def test_flipped_byte_found_again_after_restart(tmp_path, engine):
    """A damaged slot whose header survived is recovered but still never served."""
    host = Host(4)
    with make_tier(tmp_path, engine) as tier:
        write(tier, host, [10, 11])
    p, off = find_block(tmp_path, payload(11))
    flip(p, off + 123)
    with make_tier(tmp_path, engine) as tier:
        assert read(tier, host, [10, 11]) == {10: payload(10)}
        still_serving(tier, host)


def test_truncated_slab_gives_misses(tmp_path, engine):
    host = Host(8)
    with make_tier(tmp_path, engine, blocks=4, num_files=1) as tier:
        keys = [1, 2, 3, 4]
        write(tier, host, keys)
        (slab,) = slab_paths(tmp_path)
        os.truncate(slab, stride() * 2 + 1234)
        got = read(tier, host, keys)
        # Slots are handed out in key order: keys 3 and 4 sat in the cut-off part.
        assert set(got) == {1, 2}
        assert tier.stats()["short_reads"] == 2
        still_serving(tier, host)
    # Reopen after truncation: the file is sized again, the cut-off blocks are gone.
    with make_tier(tmp_path, engine, blocks=4, num_files=1) as tier:
        assert set(read(tier, host, [1, 2, 3, 4])) == {1, 2}


def test_deleted_slab_gives_misses_and_a_fresh_file(tmp_path, engine):
    host = Host(8)
    with make_tier(tmp_path, engine, blocks=8, num_files=2) as tier:
        keys = list(range(8))
        write(tier, host, keys)
        victim = slab_paths(tmp_path)[0]
        victim.unlink()
        got = read(tier, host, keys)
        # The first slab's blocks are misses; the second slab's are intact.
        assert len(got) == 4
        assert tier.stats()["slabs_lost"] == 1
        assert victim.exists(), "a fresh slab file should replace the deleted one"
        assert oct(victim.stat().st_mode & 0o777) == oct(0o600)
        still_serving(tier, host)
    with make_tier(tmp_path, engine, blocks=8, num_files=2) as tier:
        got = read(tier, host, list(range(8)))
        assert len(got) == 4


def test_missing_slab_at_reopen(tmp_path, engine):
    host = Host(8)
    with make_tier(tmp_path, engine, blocks=8, num_files=2) as tier:
        write(tier, host, list(range(8)))
    slab_paths(tmp_path)[1].unlink()
    with make_tier(tmp_path, engine, blocks=8, num_files=2) as tier:
        assert len(tier) == 4
        assert len(read(tier, host, list(range(8)))) == 4
        still_serving(tier, host)


def test_injected_read_error_is_a_miss(tmp_path, engine):
    host = Host(4)
    with make_tier(tmp_path, engine) as tier:
        write(tier, host, [1, 2])
        tier._inject_fault("eio_read", 1)
        got = read(tier, host, [1, 2])
        assert len(got) == 1
        assert tier.stats()["read_errors"] == 1
        still_serving(tier, host)


def test_a_read_delay_holds_reads_back_and_then_they_serve_as_before(tmp_path, engine):
    # The slow device of the SLO guard's end-to-end tests: the delayed read still returns the
    # right bytes, and the count runs out.
    host = Host(4)
    with make_tier(tmp_path, engine) as tier:
        write(tier, host, [1, 2])
        tier._inject_fault("read_delay_ms:1", 1)
        assert read(tier, host, [1, 2]) == {1: payload(1), 2: payload(2)}
        still_serving(tier, host)
        with pytest.raises(InvalidArgumentError, match="read_delay_ms:<ms>"):
            tier._inject_fault("read_delay_ms:soon", 1)


def test_a_fault_named_in_the_environment_is_armed_at_open(tmp_path, monkeypatch, engine):
    from kvtier_rs.tiers.disk import FAULT_ENV, open_disk_tier

    host = Host(4)
    with make_tier(tmp_path / "w", engine) as tier:
        write(tier, host, [1, 2])
    monkeypatch.setenv(FAULT_ENV, "eio_read*1")
    with open_disk_tier(tmp_path / "w", 16 * stride(BLOCK), BLOCK, engine=engine, queue_depth=4) as tier:
        assert len(read(tier, host, [1, 2])) == 1 and tier.stats()["read_errors"] == 1
    monkeypatch.setenv(FAULT_ENV, "read_delay_ms:soon")
    with pytest.raises(InvalidArgumentError, match=rf"{FAULT_ENV}='read_delay_ms:soon': .*read_delay_ms:<ms>"):
        open_disk_tier(tmp_path / "w", 16 * stride(BLOCK), BLOCK, engine=engine)
    monkeypatch.setenv(FAULT_ENV, "eio_read*many")
    with pytest.raises(InvalidArgumentError, match="the count after"):
        open_disk_tier(tmp_path / "w", 16 * stride(BLOCK), BLOCK, engine=engine)


def test_injected_enospc_stops_admission_keeps_reads(tmp_path, engine):
    host = Host(8)
    with make_tier(tmp_path, engine, full_retry_s=3600) as tier:
        write(tier, host, [1, 2])
        tier._inject_fault("enospc", 1)
        _, res = write(tier, host, [3])
        assert res.failed_keys == [3]
        assert tier.disk_full
        ticket, res = write(tier, host, [4])
        assert ticket.refused == [4] and res.ok_keys == []
        assert tier.stats()["refused_disk_full"] == 1
        assert read(tier, host, [1, 2, 3]) == {1: payload(1), 2: payload(2)}


def test_injected_enospc_retries_after_backoff(tmp_path, engine):
    host = Host(4)
    with make_tier(tmp_path, engine, full_retry_s=0.0) as tier:
        tier._inject_fault("enospc", 1)
        _, res = write(tier, host, [1])
        assert not res.success
        # With no back-off the next write is tried (and succeeds) at once.
        _, res = write(tier, host, [2])
        assert res.success
        still_serving(tier, host)


def test_injected_enospc_marks_the_tier_full_with_the_longest_retry(tmp_path, engine):
    # full_retry_s accepts up to 2**64 ns (584 years). `now + full_retry` wrapped once the
    # tier's clock passed 2**64 ns - full_retry (10 ms here), and this (release) build then
    # never marked the tier full.
    host = Host(4)
    with make_tier(tmp_path, engine, full_retry_s=18446744073.7) as tier:
        time.sleep(0.05)
        tier._inject_fault("enospc", 1)
        _, res = write(tier, host, [1])
        assert res is not None and not res.success
        assert tier.disk_full


@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB tmpfs: too small for the tier's preallocation, so writes meet real ENOSPC."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(
            "SKIPPED LOUDLY: cannot mount a size-limited tmpfs here (need root and CAP_SYS_ADMIN): " + r.stderr.strip()
        )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_real_enospc_on_a_full_filesystem(small_fs, engine):
    host = Host(8)
    path = small_fs / "tier"
    # 64 slots of ~16 KiB = 1 MiB per file, 4 files = 4 MiB on a 2 MiB filesystem.
    with make_tier(path, engine, blocks=256, full_retry_s=3600) as tier:
        assert not tier.preallocated
        assert any("not preallocated" in n for n in tier.notes)
        written = []
        for i in range(0, 256, 8):
            keys = list(range(i, i + 8))
            _, res = write(tier, host, keys)
            written += res.ok_keys
            if tier.disk_full:
                break
        assert tier.disk_full, "filling a 2 MiB filesystem never hit ENOSPC"
        assert tier.stats()["enospc"] >= 1
        assert written, "nothing fitted at all"
        ticket, _ = write(tier, host, [10_000])
        assert ticket.refused == [10_000]
        # Reads keep working for everything that was written.
        sample = written[:8]
        assert read(tier, host, sample) == {k: payload(k) for k in sample}


@pytest.fixture
def small_ext4(tmp_path):
    """A 32 MiB ext4 filesystem on a loop device: unlike tmpfs, ext4 keeps what a fallocate
    allocated before it ran out of space."""
    img, mnt = tmp_path / "fs.img", tmp_path / "ext4"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(32 << 20)
    steps = (["mkfs.ext4", "-q", "-F", str(img)], ["mount", "-o", "loop", str(img), str(mnt)])
    for cmd in steps:
        try:
            r = subprocess.run(cmd, capture_output=True, text=True)
        except FileNotFoundError as e:
            pytest.skip(f"SKIPPED LOUDLY: cannot build a small ext4 filesystem here ({e})")
        if r.returncode != 0:
            why = f"{' '.join(cmd)}: {r.stderr.strip()}"
            pytest.skip(f"SKIPPED LOUDLY: cannot build a small ext4 filesystem here: {why}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_tier_larger_than_the_free_space_leaves_the_space_free(small_ext4, engine):
    def free_bytes() -> int:
        st = os.statvfs(small_ext4)
        return st.f_bavail * st.f_frsize

    before = free_bytes()
    host = Host(8)
    # 256 MiB of slabs on a 32 MiB filesystem.
    with make_tier(small_ext4 / "tier", engine, blocks=256 * (1 << 20) // stride(BLOCK)) as tier:
        assert not tier.preallocated
        assert any("free on its filesystem" in n for n in tier.notes), tier.notes
        assert free_bytes() > before - (1 << 20), "opening the tier took the filesystem's free space"
        _, res = write(tier, host, [1, 2])
        assert read(tier, host, [1, 2]) == {1: payload(1), 2: payload(2)}, res


def test_an_open_refused_for_a_slab_too_large_leaves_nothing_that_refuses_the_next(tmp_path):
    """A slab larger than the filesystem allows (EFBIG, here through RLIMIT_FSIZE in a child)
    fails the open; the corrected open of the same, never-used directory must then work, with
    nothing to say about earlier slabs."""
    code = textwrap.dedent(
        """
        import resource, signal, sys
        from kvtier_rs._core import DiskIoError, DiskTier
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            DiskTier(sys.argv[1], 64 << 20, 4096, engine="pool", num_files=1)
        except DiskIoError as e:
            print("REFUSED", e)
        tier = DiskTier(sys.argv[1], 512 << 10, 4096, engine="pool", num_files=1)
        print("OPENED", tier.notes)
        tier.close()
        """
    )
    d = tmp_path / "tier"
    out = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=120)
    assert "REFUSED" in out.stdout and "File too large" in out.stdout, out.stdout + out.stderr
    assert "OPENED" in out.stdout, out.stderr
    assert "was missing" not in out.stdout, out.stdout


def test_buffered_fallback_is_reported(tmp_path, engine):
    host = Host(4)
    with make_tier(tmp_path, engine, direct="off") as tier:
        assert tier.io_mode == "buffered"
        assert tier.stats()["direct_io"] == 0
        write(tier, host, [1])
        assert read(tier, host, [1]) == {1: payload(1)}


def test_tmpfs_runs_in_whatever_mode_it_accepts(engine):
    """/dev/shm is tmpfs: O_DIRECT only on recent kernels; either way the tier works and says
    which mode it is in."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("SKIPPED LOUDLY: no /dev/shm on this machine, the tmpfs case cannot run")
    path = f"/dev/shm/kvtier-test-{uuid.uuid4().hex}"
    host = Host(4)
    try:
        with make_tier(path, engine) as tier:
            assert tier.io_mode in ("direct", "buffered")
            if tier.io_mode == "buffered":
                assert any("O_DIRECT refused" in n for n in tier.notes)
            write(tier, host, [1, 2])
            assert read(tier, host, [1, 2]) == {1: payload(1), 2: payload(2)}
    finally:
        subprocess.run(["rm", "-rf", path], check=False)


# Writes the killed writer keeps in flight at once (the I/O engine's queue depth).
WRITER_QUEUE_DEPTH = 4

WRITER = textwrap.dedent(
    """
    import sys, time
    from support.disk import Host, make_tier, payload
    tier = make_tier(sys.argv[1], sys.argv[2], blocks=64, queue_depth=int(sys.argv[3]))
    host = Host(8)
    print("ready", flush=True)
    i = 0
    while True:
        keys = [i * 8 + j for j in range(8)]
        for s, k in enumerate(keys):
            host.put(s, payload(k))
        t = tier.submit_write(keys, host.pool, list(range(8)))
        tier.wait(t.job_id)
        i += 1
        if i % 4 == 0:
            print("progress", i, flush=True)
    """
)


@pytest.mark.parametrize("verify", [False, True])
def test_sigkill_mid_burst_then_reopen(tmp_path, engine, verify):
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path), engine, str(WRITER_QUEUE_DEPTH)],
        env=child_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        # Let it get well into the burst (eviction included: 64 slots, 8 per batch).
        for _ in range(3):
            line = proc.stdout.readline()
            assert line.startswith("progress"), line
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    host = Host(64)
    # The dead process's lock died with it.
    with make_tier(tmp_path, engine, blocks=64, verify_on_open=verify) as tier:
        recovered = [k for k in range(2000) if tier.contains([k])[0]]
        assert recovered, "nothing recovered after the kill"
        assert len(recovered) <= 64
        got = read(tier, host, recovered)
        if verify:
            # Full verification at open dropped anything torn, so every recovered block reads.
            assert len(got) == len(recovered)
        else:
            # A slot being rewritten when the writer died keeps its old, valid header over a
            # partly new payload: a miss when read (never wrong bytes: `read` checks every one).
            # One per write in flight at once.
            torn = len(recovered) - len(got)
            assert torn <= WRITER_QUEUE_DEPTH, f"{torn} slots failed, more than the writes in flight"
        assert not any(p.name.startswith(".") for p in tmp_path.iterdir()), "temporary files leaked"
        still_serving(tier, host)


def test_concurrent_readers_and_writers(tmp_path, engine):
    """Writer threads churn keys (with evictions) while reader threads read: every block a
    reader is told is ok must be byte-exact."""
    tier = make_tier(tmp_path, engine, blocks=32, queue_depth=8)
    n_threads = 4
    hosts = [Host(8) for _ in range(n_threads)]
    errors: list[BaseException] = []
    served = [0] * n_threads
    stop = threading.Event()
    # All four start together, so the readers read while the writers write however the OS
    # schedules the threads' starts.
    started = threading.Barrier(n_threads)

    def writer(t: int) -> None:
        try:
            started.wait()
            host = hosts[t]
            for i in range(12):
                keys = [(t, i, j) for j in range(4)]
                keys = [hash_key(k) for k in keys]
                for s, k in enumerate(keys):
                    host.put(s, payload(k))
                ticket = tier.submit_write(keys, host.pool, [0, 1, 2, 3])
                res = tier.wait(ticket.job_id, timeout=60)
                assert res is not None
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    def reader(t: int) -> None:
        try:
            started.wait()
            host = hosts[t]
            # Until the writers are done, and at least until a hit (the last blocks written
            # stay): a reader the OS kept waiting still reads something.
            deadline = time.monotonic() + 60
            while not stop.is_set() or (served[t] == 0 and time.monotonic() < deadline):
                keys = [hash_key((w, i, j)) for w in (0, 1) for i in range(12) for j in range(1)]
                for start in range(0, len(keys), 8):
                    chunk = keys[start : start + 8]
                    served[t] += len(read(tier, host, chunk))
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    ws = [threading.Thread(target=writer, args=(t,)) for t in (0, 1)]
    rs = [threading.Thread(target=reader, args=(t,)) for t in (2, 3)]
    for th in ws + rs:
        th.start()
    for th in ws:
        th.join(timeout=120)
    stop.set()
    for th in rs:
        th.join(timeout=120)
    assert not errors, errors[0]
    assert all(served[t] > 0 for t in (2, 3)), "a reader never got a hit; the test exercised nothing"
    still_serving(tier, hosts[0])
    tier.close()


def hash_key(t: tuple) -> bytes:
    return "k-{}-{}-{}".format(*t).encode()


def test_no_call_blocks_while_io_is_queued(tmp_path, engine):
    """submit_* return job ids; results arrive through poll()."""
    host = Host(16)
    with make_tier(tmp_path, engine, blocks=32) as tier:
        keys = list(range(16))
        for s, k in enumerate(keys):
            host.put(s, payload(k))
        t = tier.submit_write(keys, host.pool, list(range(16)))
        results = []
        deadline = time.monotonic() + 60
        while not results and time.monotonic() < deadline:
            results = tier.poll()
        assert [r.job_id for r in results] == [t.job_id]
        assert sorted(results[0].ok_keys) == keys
        assert results[0].bytes == 16 * BLOCK
        assert tier.poll() == []


def test_a_panic_in_the_tier_index_disables_it_until_a_restart(tmp_path, engine):
    host = Host(8)
    with make_tier(tmp_path, engine, blocks=4) as tier:
        write(tier, host, [1, 2, 3, 4])
        tier._inject_fault("store_panic")
        # The write that must evict panics inside the index: raised as an ordinary KvTierError.
        with pytest.raises(IndexFailedError, match="injected fault"):
            write(tier, host, [5, 6], first_slot=4)
        assert tier.stats()["failed"] == 1
        assert tier.lookup_prefix([1, 2, 3, 4]) == 0
        assert read(tier, host, [1, 2]) == {}, "a failed index reads nothing"
        with pytest.raises(IndexFailedError):
            write(tier, host, [7], first_slot=4)
        assert tier.remove([3]) == []
    # Nothing of the failure is on disk: reopening rebuilds the index from the slot headers.
    # The store that panicked wrote nothing, so even the two blocks it evicted are still
    # intact in their slots and come back; `read` checks every byte.
    with make_tier(tmp_path, engine, blocks=4) as tier:
        assert tier.stats()["failed"] == 0
        assert set(read(tier, host, [1, 2, 3, 4])) == {1, 2, 3, 4}
        still_serving(tier, host)


def test_a_panic_in_a_write_completion_fails_the_index_and_the_job_still_finishes(tmp_path, engine):
    host = Host(8)
    with make_tier(tmp_path, engine, blocks=8) as tier:
        write(tier, host, [1, 2])
        # The block lands on disk, then its completion panics on the I/O thread, inside the
        # index update: contained there, so the thread lives and the job finishes, not ok.
        tier._inject_fault("completion_panic", 1)
        _, res = write(tier, host, [3], first_slot=2)
        assert res is not None, "the job never finished"
        assert (res.ok_keys, res.failed_keys) == ([], [3])
        assert tier.wait_idle(timeout=30)
        s = tier.stats()
        assert s["failed"] == 1 and s["blocks_written"] == 3
        assert tier.lookup_prefix([1, 2, 3]) == 0
        with pytest.raises(IndexFailedError, match="a write's completion panicked"):
            write(tier, host, [4], first_slot=3)


@pytest.mark.parametrize(
    "engine, after", [("pool", 0), ("pool", 5), ("pool", 7), ("io_uring", 0), ("io_uring", 1), ("io_uring", 2)]
)
def test_a_thread_the_os_refuses_fails_the_open_with_an_error_not_a_panic(tmp_path, engine, after):
    """Under a pids limit the OS refuses threads: DiskTier() raised pyo3's PanicException (not
    an Exception) and left the threads it had started running (a half-started io_uring engine
    also its ring and eventfd). One slot, so the recovery scan starts no thread: the refused
    one is the engine's (pool: 8 threads; io_uring: 3)."""
    require_engine(engine)
    before = tier_threads_and_fds()
    _inject_spawn_failure(after)
    try:
        with pytest.raises(DiskIoError, match=r"start an I/O thread for .*queue_depth \(8\)"):
            DiskTier(str(tmp_path / "t"), stride(), BLOCK, num_files=1, engine=engine, queue_depth=8)
    finally:
        _inject_spawn_failure(None)
    assert_back_to(before, f"{engine}: spawn {after} refused")
    with make_tier(tmp_path / "t", engine, blocks=1, num_files=1) as tier:
        still_serving(tier, Host(2))


def test_a_transient_io_uring_enter_error_is_retried(tmp_path):
    """EAGAIN from io_uring_enter (the kernel could not allocate requests, e.g. under memory
    pressure) panicked the ring thread, and every job after it hung."""
    require_engine("io_uring")
    host = Host(4)
    with make_tier(tmp_path, "io_uring") as tier:
        write(tier, host, [1])
        tier._inject_fault("enter_eagain", 3)
        _, res = write(tier, host, [2], first_slot=1)
        assert res is not None and res.success
        assert read(tier, host, [1, 2]) == {1: payload(1), 2: payload(2)}
        assert tier.stats()["engine_errno"] == 0


def test_a_failed_io_uring_enter_fails_every_job_and_close_returns(tmp_path):
    require_engine("io_uring")
    host = Host(4)
    with make_tier(tmp_path, "io_uring") as tier:
        write(tier, host, [1])
        tier._inject_fault("enter_eio", 1)
        _, res = write(tier, host, [2], first_slot=1)
        assert res is not None and res.failed_keys == [2]
        assert tier.stats()["engine_errno"] == errno.EIO
        # Later jobs fail at once: a read is a miss (never stale bytes), a write fails.
        assert read(tier, host, [1]) == {}
        _, res = write(tier, host, [3], first_slot=2)
        assert res is not None and res.failed_keys == [3]
        assert tier.wait_idle(10) and tier.running_jobs == 0
    # Closed without hanging; what was written before the failure is intact.
    with make_tier(tmp_path, "pool") as tier:
        assert read(tier, host, [1]) == {1: payload(1)}


def test_an_io_uring_enter_fault_needs_the_io_uring_engine(tmp_path):
    with make_tier(tmp_path, "pool") as tier:
        with pytest.raises(InvalidArgumentError, match="`fault`"):
            tier._inject_fault("enter_eio", 1)


def ctrl_c_scenario(tmp_path, how: str) -> None:
    """The scenario of the Ctrl-C test below, run by it in a fresh interpreter."""
    require_engine("io_uring")
    # A process started in the background by a non-interactive shell (`make test &`, nohup)
    # inherits SIGINT ignored, and Python then leaves it ignored: Ctrl-C could never reach the
    # wait. What is checked is that kvtier's waits honour Python's own handling, so install it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    host = Host(4)
    with make_tier(tmp_path, "io_uring") as tier:
        tier._inject_fault("enter_eagain", 1_000_000)
        host.put(0, payload(1, host.block))
        job = tier.submit_write([1], host.pool, [0]).job_id
        in_call: list = []
        running: list = []
        abandoned: list = []

        def interrupt() -> None:
            running.append(True)
            while not in_call:  # no call in the loop (see call_once_the_gil_is_asked_for)
                if abandoned:
                    return
            os.kill(os.getpid(), signal.SIGINT)

        sender = threading.Thread(target=interrupt)
        sender.start()
        try:
            while not running:
                time.sleep(0)
            with pytest.raises(KeyboardInterrupt):
                call_once_the_gil_is_asked_for(
                    functools.partial(tier.wait, job) if how == "wait" else tier.wait_idle, sender, in_call
                )
        finally:
            abandoned.append(True)
            sender.join()
        assert tier.running_jobs == 1, "interrupted while the job was still in flight"
        result = tier.wait(job, timeout=30)  # the job itself went on, and ends failed
        assert result is not None and result.failed_keys == [1]


@pytest.mark.parametrize("how", ["wait", "wait_idle"])
def test_ctrl_c_interrupts_a_wait_for_a_job_that_is_not_done(tmp_path, how):
    """wait() and wait_idle() released the GIL for their whole length: Ctrl-C (SIGINT) could
    not interrupt them until the job finished. The job here stays in flight for seconds (the
    ring retries a transient io_uring_enter error for 5 s, then fails it); the interrupt is sent
    from inside the wait (by a thread that gets the GIL when the wait releases it).

    Run in a fresh interpreter: the check rests on Python's SIGINT handling and on which thread
    gets the GIL when the wait releases it, and threads or a signal handler left by earlier tests
    in this process must not take part."""
    require_engine("io_uring")
    code = (
        "import pathlib, sys\n"
        "from tiers.test_disk_faults import ctrl_c_scenario\n"
        "ctrl_c_scenario(pathlib.Path(sys.argv[1]), sys.argv[2])\n"
        "print('scenario passed')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), how], capture_output=True, text=True, timeout=300, env=child_env()
    )
    assert r.returncode == 0 and "scenario passed" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
