"""The Python face of the core: validation at construction, key identity, zero-copy views of
the host pool, single-key and batch forms, and thread safety with the GIL released."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import kvtier_rs as kv
from kvtier_rs.checks import invalid_argument
from kvtier_rs.options import OptionReader


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"capacity": 0}, "capacity"),
        ({"capacity": -5}, "capacity"),
        ({"capacity": 8, "policy": "mru"}, "policy"),
        ({"capacity": 8, "admission": "sometimes"}, "admission"),
        ({"capacity": 8, "admission": "uses:0"}, "admission"),
        ({"capacity": 8, "tier": "tape"}, "tier"),
        ({}, "capacity"),
    ],
)
def test_index_rejects_bad_arguments_naming_them(kwargs, arg):
    with pytest.raises(kv.InvalidArgumentError, match=f"`{arg}`") as e:
        kv.BlockIndex(**kwargs)
    assert e.value.arg == arg


def test_a_core_invalid_argument_carries_its_arg_and_reason():
    with pytest.raises(kv.InvalidArgumentError) as e:
        kv.BlockIndex(capacity=0)
    assert (e.value.arg, e.value.reason) == ("capacity", "must be positive, got 0")
    assert str(e.value) == "invalid argument `capacity`: must be positive, got 0"


def test_a_python_invalid_argument_carries_its_arg_and_reason():
    with pytest.raises(kv.InvalidArgumentError) as e:
        kv.TierConfig(capacity_bytes="1KiB", block_bytes="1MiB")
    assert (e.value.arg, e.value.reason) == ("capacity_bytes", "1024 bytes cannot hold one block of 1048576 bytes")
    assert str(e.value) == "invalid argument `capacity_bytes`: 1024 bytes cannot hold one block of 1048576 bytes"
    made = invalid_argument("port", "must be an int in 0..65535, got -1")
    assert isinstance(made, kv.InvalidArgumentError)
    assert (made.arg, made.reason) == ("port", "must be an int in 0..65535, got -1")
    assert str(made) == "invalid argument `port`: must be an int in 0..65535, got -1"


def test_the_option_reader_gives_the_cores_reason_under_the_users_key():
    reader = OptionReader("kvtier config")
    with pytest.raises(kv.InvalidArgumentError) as e, reader.naming({"capacity": "cpu_blocks"}):
        kv.BlockIndex(capacity=0)
    assert (e.value.arg, e.value.reason) == ("cpu_blocks", "must be positive, got 0")
    assert str(e.value) == "kvtier config['cpu_blocks']: must be positive, got 0"
    # An argument the block does not map passes unchanged.
    with pytest.raises(kv.InvalidArgumentError) as e, reader.naming({"policy": "cpu_policy"}):
        kv.BlockIndex(capacity=0)
    assert str(e.value) == "invalid argument `capacity`: must be positive, got 0"
    # The core's parser and Python's, their reasons under the key.
    with pytest.raises(kv.InvalidArgumentError) as e:
        reader.admission("cpu_admission", "uses:0")
    assert e.value.arg == "cpu_admission" and e.value.reason.startswith('"uses:0" is not an admission rule; expected')
    assert str(e.value) == f"kvtier config['cpu_admission']: {e.value.reason}"
    with pytest.raises(kv.InvalidArgumentError) as e:
        reader.size("cpu_bytes", "3 parsecs")
    assert str(e.value) == "kvtier config['cpu_bytes']: '3 parsecs' is not a byte size (e.g. 4096, '64MiB', '2GB')"


@pytest.mark.parametrize(
    ("total", "slot", "arg"),
    [(0, 4096, "total_bytes"), (-1, 4096, "total_bytes"), (4096, 0, "slot_bytes"), (4096, 8192, "total_bytes")],
)
def test_pool_rejects_bad_sizes(total, slot, arg):
    with pytest.raises(kv.InvalidArgumentError, match=f"`{arg}`"):
        kv.HostPool(total, slot)


@pytest.mark.parametrize(("slot", "stride"), [(1, 4096), (4096, 4096), (4097, 8192), (5000, 8192), (1 << 40, 1 << 40)])
def test_pool_stride_is_the_pools_own_rounding(slot, stride):
    # One rule sizes pools and the Python side's capacity checks (TierConfig, the vLLM spec).
    assert kv.HostPool.stride_for(slot) == stride
    if stride <= 1 << 16:
        assert kv.HostPool(3 * stride + 100, slot).num_slots == 3
        assert kv.TierConfig(capacity_bytes=3 * stride + 100, block_bytes=slot).num_blocks == 3


@pytest.mark.parametrize("bad", [0, -4096])
def test_pool_stride_refuses_bad_sizes(bad):
    with pytest.raises(kv.InvalidArgumentError, match="`slot_bytes`"):
        kv.HostPool.stride_for(bad)


def test_config_validates_before_allocating():
    with pytest.raises(kv.InvalidArgumentError, match="capacity_bytes"):
        kv.TierConfig(capacity_bytes="1KiB", block_bytes="1MiB")
    with pytest.raises(kv.InvalidArgumentError, match="block_bytes"):
        kv.TierConfig(capacity_bytes="1GiB", block_bytes="lots")
    with pytest.raises(kv.InvalidArgumentError, match="policy"):
        kv.TierConfig(capacity_bytes="1GiB", block_bytes=4096, policy="random")
    assert kv.TierConfig(capacity_bytes="1MiB", block_bytes=5000).num_blocks == 128


def test_errors_share_one_base_class():
    for exc in (kv.InvalidArgumentError, kv.NoSpaceError, kv.NotReadyError, kv.NotPinnedError):
        assert issubclass(exc, kv.KvTierError)


@pytest.mark.parametrize("bad", [3.5, "abc", None, b"", b"x" * 65, bytearray(b"ab"), (1, 2)])
def test_bad_keys_are_clear_errors(bad):
    ix = kv.BlockIndex(4)
    with pytest.raises(kv.InvalidArgumentError, match="`key`"):
        ix.prepare_store([bad])


def test_single_key_instead_of_sequence_is_an_error():
    ix = kv.BlockIndex(4)
    with pytest.raises(kv.InvalidArgumentError, match="`keys`"):
        ix.lookup_prefix(b"abc")


def test_keys_are_kept_exactly():
    ix = kv.BlockIndex(8)
    distinct = [7, b"\x07", 2**64 - 1, -1, 2**100, b"\x00" * 36, b"\x00" * 35, b"\x01" + b"\x00" * 63]
    out = ix.prepare_store(distinct)
    assert list(out.keys) == distinct, "every key is distinct; none may be confused with another"
    ix.complete_store(distinct)
    assert sorted(map(repr, (k for k, *_ in ix.entries()))) == sorted(map(repr, distinct))
    assert ix.contains([7, b"\x07", 8]) == [True, True, False]
    with pytest.raises(kv.InvalidArgumentError, match="128 bits"):
        ix.lookup_prefix([2**200])


def test_pool_views_are_zero_copy_and_page_aligned():
    pool = kv.HostPool(1 << 20, 5000)
    assert pool.slot_bytes == 8192 and pool.num_slots == 128 and pool.ptr % 4096 == 0
    arr = np.frombuffer(pool, dtype=np.uint8)
    t = torch.frombuffer(pool, dtype=torch.uint8)
    mv = memoryview(pool)
    assert not mv.readonly and mv.nbytes == pool.nbytes
    off = pool.slot_offset(3)
    arr[off : off + 10] = 42
    assert bytes(mv[off : off + 10]) == b"*" * 10
    assert int(t[off + 9]) == 42
    assert arr.ctypes.data == pool.ptr == t.data_ptr()


def test_pool_copy_spans_moves_exactly_the_spans_and_checks_every_one_first():
    pool = kv.HostPool(2 * 4096, 4096)
    arr = np.frombuffer(pool, dtype=np.uint8)
    src = np.arange(100, dtype=np.uint8)
    spans = np.array([[4096, 10, 5], [0, 90, 10]], dtype=np.int64)
    assert pool.copy_spans(src, spans, into_pool=True) == 15
    assert list(arr[4096:4101]) == list(range(10, 15)) and list(arr[:10]) == list(range(90, 100))
    assert not arr[10:4096].any() and not arr[4101:].any()
    out = np.zeros(20, dtype=np.uint8)
    pool.copy_spans(out, np.array([[4096, 3, 5]], dtype=np.int64), into_pool=False)
    assert list(out[3:8]) == list(range(10, 15)) and not out[:3].any() and not out[8:].any()
    # Every span is checked before any byte moves.
    with pytest.raises(kv.InvalidArgumentError, match="span 1"):
        pool.copy_spans(out, np.array([[0, 0, 4], [8190, 0, 4]], dtype=np.int64), into_pool=False)
    assert not out[:3].any()
    with pytest.raises(kv.InvalidArgumentError, match="span 0"):
        pool.copy_spans(out, np.array([[0, 18, 4]], dtype=np.int64), into_pool=True)
    with pytest.raises(kv.InvalidArgumentError, match="negative"):
        pool.copy_spans(out, np.array([[0, -1, 4]], dtype=np.int64), into_pool=True)
    with pytest.raises(kv.InvalidArgumentError, match="rows of 3"):
        pool.copy_spans(out, np.array([0, 1], dtype=np.int64), into_pool=True)
    with pytest.raises(kv.InvalidArgumentError, match="int64"):
        pool.copy_spans(out, [[0, 0, 1]], into_pool=True)
    with pytest.raises(kv.InvalidArgumentError, match="read-only"):
        pool.copy_spans(b"x" * 20, np.array([[0, 0, 1]], dtype=np.int64), into_pool=False)
    with pytest.raises(kv.InvalidArgumentError, match="C-contiguous"):
        pool.copy_spans(out[::2], np.array([[0, 0, 1]], dtype=np.int64), into_pool=True)


def test_importing_the_index_does_not_import_numpy():
    # HostTier (numpy) loads on first use; the index alone stays light to import.
    code = "import sys, kvtier_rs; assert 'numpy' not in sys.modules; kvtier_rs.HostTier; assert 'numpy' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert "HostTier" in dir(kv)


def test_host_tier_round_trip_and_eviction():
    tier = kv.HostTier(kv.TierConfig(capacity_bytes=4 * 4096, block_bytes=4096, policy="lru"))
    payload = {i: bytes([i]) * 4096 for i in range(6)}
    tier.store([0, 1, 2, 3], [payload[i] for i in range(4)])
    out = tier.store([4, 5], [payload[4], payload[5]])
    assert list(out.evicted) == [3, 2], "the tail of the chain goes first"
    assert tier.read([0, 1, 4, 5]) == [payload[i] for i in (0, 1, 4, 5)]
    with pytest.raises(kv.NotReadyError):
        tier.read([2])


def test_host_tier_store_checks_payloads_before_touching_the_index():
    tier = kv.HostTier(kv.TierConfig(capacity_bytes=4 * 4096, block_bytes=4096, policy="lru"))
    with pytest.raises(kv.InvalidArgumentError, match="payloads: 1 payloads for 2 keys"):
        tier.store([0, 1], [bytes(4096)])
    with pytest.raises(kv.InvalidArgumentError, match=r"payloads: the payload for key 1 is 10 bytes, blocks are 4096"):
        tier.store([0, 1], [bytes(4096), bytes(10)])
    assert len(tier.index) == 0 and tier.index.stats()["stores_prepared"] == 0, "bad input changed nothing"


def test_single_key_forms_match_batch_semantics():
    ix = kv.BlockIndex(2, manual_clock=True)
    slot = ix.prepare_store_one(b"a")
    assert slot is not None and ix.state(b"a") == ("writing", 0, slot)
    assert not ix.lookup_one(b"a")
    assert ix.complete_store_one(b"a")
    assert ix.lookup_one(b"a")
    assert ix.prepare_store_one(b"a") is None, "already present"
    assert ix.pin_one(b"a") == slot
    assert not ix.remove_one(b"a"), "pinned blocks are not removed"
    ix.unpin_one(b"a")
    with pytest.raises(kv.NotPinnedError):
        ix.unpin_one(b"a")
    ix.touch_one(b"a")
    assert ix.remove_one(b"a")
    with pytest.raises(kv.InvalidArgumentError, match="manual_clock"):
        kv.BlockIndex(2).advance_clock(1.0)


def test_priority_bounds_and_durations_are_validated():
    ix = kv.BlockIndex(4, policy="priority")
    with pytest.raises(kv.InvalidArgumentError, match="priority"):
        ix.prepare_store([1], priority=101)
    with pytest.raises(kv.InvalidArgumentError, match="duration_s"):
        ix.prepare_store([1], priority=80, duration_s=-1.0)
    with pytest.raises(kv.InvalidArgumentError, match="duration_s"):
        ix.prepare_store([1], priority=80, duration_s=1e300)  # beyond the u64 nanosecond clock
    with pytest.raises(kv.InvalidArgumentError, match="seconds"):
        kv.BlockIndex(2, manual_clock=True).advance_clock(1e300)


def test_pool_backs_only_one_index():
    pool = kv.HostPool(1 << 16, 4096)
    kv.BlockIndex(pool=pool)
    with pytest.raises(kv.InvalidArgumentError, match="pool"):
        kv.BlockIndex(pool=pool)


def test_concurrent_batches_from_threads_keep_invariants():
    ix = kv.BlockIndex(256, policy="arc")
    errors: list[BaseException] = []

    def writer(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(400):
                start = int(rng.integers(0, 2000))
                keys = list(range(start, start + 16))
                out = ix.prepare_store(keys)
                ix.complete_store(out.keys, bool(rng.integers(0, 5)))
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(2000):
                start = int(rng.integers(0, 2000))
                keys = list(range(start, start + 16))
                n = ix.lookup_prefix(keys)
                if n:
                    try:
                        ix.pin_for_load(keys[:n])
                    except kv.NotReadyError:
                        continue  # evicted between lookup and pin: a miss, as it should be
                    ix.unpin(keys[:n])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    threads += [threading.Thread(target=reader, args=(10 + i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    entries = ix.entries()
    assert len(entries) == len(ix) <= 256
    assert len({slot for *_, slot in entries}) == len(entries)
    assert all(pins == 0 for _, _, pins, _ in entries)
    s = ix.stats()
    assert s["pins"] == s["unpins"]


def test_lookup_result_returns_the_callers_objects():
    ix = kv.BlockIndex(4)
    hit, pending, miss = object(), object(), object()
    with pytest.raises(kv.InvalidArgumentError, match="set_lookup_results"):
        ix.lookup_result(b"a")
    ix.set_lookup_results(hit, pending, miss)
    with pytest.raises(kv.InvalidArgumentError, match="already set"):
        ix.set_lookup_results(hit, pending, miss)
    assert ix.lookup_result(b"a") is miss
    ix.prepare_store([b"a"])
    assert ix.lookup_result(b"a", "any request context") is pending
    ix.complete_store([b"a"])
    assert ix.lookup_result(b"a") is hit
    assert ix.stats()["hit_blocks"] == 1 and ix.stats()["lookups"] == 3


def test_capacity_beyond_what_an_index_or_this_machine_holds_is_refused():
    with pytest.raises(kv.InvalidArgumentError, match=r"`capacity`: 4294967296 blocks is more than the 2147483647"):
        kv.BlockIndex(2**32)  # was a PanicException from the slot allocator's assert
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    too_many = min(ram // 128 + 1, 2**31 - 1)
    if too_many * 128 <= ram:
        pytest.skip(f"SKIPPED LOUDLY: this machine's {ram} bytes of memory would hold an index of 2^31 blocks")
    with pytest.raises(kv.InvalidArgumentError, match=r"`capacity`: .* GiB of index memory, more than this machine's"):
        kv.BlockIndex(too_many)  # was an abort (allocation failure) or a PanicException


def test_a_refused_index_leaves_its_pool_free():
    pool = kv.HostPool(4 * 4096, 4096)
    with pytest.raises(kv.InvalidArgumentError, match="5 does not match the pool's 4 slots"):
        kv.BlockIndex(5, pool=pool)
    assert kv.BlockIndex(pool=pool).capacity == 4


@pytest.mark.parametrize("spec", ["uses:256", "uses:1000"])
def test_uses_beyond_the_sketchs_counters_is_refused(tmp_path, spec):
    # The sketch counts to 255: a higher threshold was accepted and then admitted nothing.
    with pytest.raises(kv.InvalidArgumentError, match=r"uses:K\" \(1..=255\)"):
        kv.BlockIndex(4, admission=spec)
    with pytest.raises(kv.InvalidArgumentError, match="admission"):
        kv.DiskTier(str(tmp_path / "d"), 1 << 20, 4096, admission=spec)
    ix = kv.BlockIndex(4, admission="uses:255")
    offers = next(i for i in range(1, 300) if ix.prepare_store([b"k"]).keys)
    assert offers == 255


def test_the_cores_admission_for_tiers_without_an_index_decides_as_an_index_tier():
    from kvtier_rs._core import Admission

    a, ix = Admission("USES:3"), kv.BlockIndex(4, admission="uses:3")
    assert a.rule == "uses:3"
    for key in (b"a", 7):
        assert [a.offer(key) for _ in range(3)] == [bool(ix.prepare_store([key]).keys) for _ in range(3)]
        assert a.offer(key), "admitted from the K-th offer on"
    a.record_use(b"b")
    a.record_use(b"b")
    assert a.offer(b"b"), "uses served elsewhere count"
    a.clear()
    assert not a.offer(b"a")
    p = Admission("priority:50")
    assert p.offer(b"x", 50) and not p.offer(b"x", 49)
    assert Admission("always").offer(b"x", 0)
    for call, arg in (
        (lambda: Admission("sometimes"), "admission"),
        (lambda: p.offer(b"x", 101), "priority"),
        (lambda: a.offer("text"), "key"),
        (lambda: Admission("uses:2", 0), "expected_keys"),
        (lambda: Admission("uses:2", 1 << 40), "expected_keys"),
    ):
        with pytest.raises(kv.InvalidArgumentError) as ei:
            call()
        assert ei.value.arg == arg


@pytest.mark.parametrize("keys", [bytearray(b"\x01\x02"), memoryview(b"\x01"), "ab"])
def test_bytes_like_objects_are_not_sequences_of_keys(keys):
    # Iterating a bytearray or memoryview yields ints: it used to store int keys 1 and 2.
    ix = kv.BlockIndex(4)
    ix.prepare_store([1, 2])
    ix.complete_store([1, 2])
    for call in (ix.prepare_store, ix.contains, ix.lookup_prefix, ix.remove, ix.touch, ix.pin_for_load):
        with pytest.raises(kv.InvalidArgumentError, match=r"`keys`: expected a sequence of keys, got a"):
            call(keys)
    assert sorted(k for k, *_ in ix.entries()) == [1, 2]


def test_a_repeated_key_shares_its_first_occurrences_fate():
    refusing = kv.BlockIndex(4, admission="uses:2")
    out = refusing.prepare_store([b"a", b"a"])
    assert (out.keys, out.refused, out.skipped) == ([], [b"a", b"a"], [])
    assert refusing.stats()["store_skipped"] == 0
    admitting = kv.BlockIndex(4)
    out = admitting.prepare_store([b"a", b"b", b"a"])
    assert (out.keys, out.skipped, out.refused) == ([b"a", b"b"], [b"a"], [])


@pytest.mark.parametrize("container", [list, tuple, iter, lambda ks: ks * 100])
def test_lookup_prefix_stops_at_the_first_miss_whatever_holds_the_keys(container):
    ix = kv.BlockIndex(4)
    ix.prepare_store([b"h"])
    ix.complete_store([b"h"])
    # Keys after the first miss are not looked at, so not checked either ...
    assert ix.lookup_prefix(container([b"h", b"miss", 1.5])) == 1
    # ... but an invalid key the walk reaches is an error.
    with pytest.raises(kv.InvalidArgumentError, match="key"):
        ix.lookup_prefix(container([b"h", 1.5, b"miss"]) if container is not iter else iter([b"h", 1.5]))


def test_the_manual_clock_does_not_wrap():
    ix = kv.BlockIndex(2, manual_clock=True)
    ix.advance_clock(1.8e10)
    with pytest.raises(kv.InvalidArgumentError, match=r"would pass 2\^64 ns"):
        ix.advance_clock(1e9)
