"""The per-key lookups (`lookup_one`, `lookup_result`, `lookup_prefix`) are CPython method
descriptors with a fast path for exact `bytes` keys and a fallback through pyo3 for everything
else (rust/py/fast_calls.rs). These tests drive both paths over the same index and check that
they answer, count and fail identically, and that the fast path leaks no references."""

from __future__ import annotations

import inspect
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier_rs as kv


class KeyBytes(bytes):
    """A bytes subclass: equal to its bytes value as a key, but never taken by the fast path."""


HIT, PENDING, MISS = object(), object(), object()


def make_index(ready: list[bytes], writing: list[bytes]) -> kv.BlockIndex:
    ix = kv.BlockIndex(64)
    ix.set_lookup_results(HIT, PENDING, MISS)
    if ready:
        ix.prepare_store(ready)
        ix.complete_store(ready)
    if writing:
        ix.prepare_store(writing)
    return ix


def expected_state(ix: kv.BlockIndex, key) -> str | None:
    # `state` is an ordinary pyo3 method: an independent reading of the same index.
    s = ix.state(key)
    return None if s is None else s[0]


def lookup_counters(ix: kv.BlockIndex) -> tuple[int, int, int]:
    s = ix.stats()
    return s["lookups"], s["lookup_keys"], s["hit_blocks"]


keys_st = st.lists(st.binary(min_size=1, max_size=64), min_size=1, max_size=12, unique=True)


@settings(max_examples=150, deadline=None)
@given(keys=keys_st, data=st.data())
def test_fast_and_fallback_paths_agree(keys, data):
    n_ready = data.draw(st.integers(0, len(keys)))
    n_writing = data.draw(st.integers(0, len(keys) - n_ready))
    ready, writing = keys[:n_ready], keys[n_ready : n_ready + n_writing]
    fast, slow = make_index(ready, writing), make_index(ready, writing)
    probes = keys + data.draw(st.lists(st.binary(min_size=1, max_size=64), max_size=4))
    for k in probes:
        state = expected_state(fast, k)
        want = {"ready": HIT, "writing": PENDING, None: MISS}[state]
        # bytes subclass (fallback) vs exact bytes (fast path), one and two arguments.
        assert fast.lookup_one(k) is (state == "ready")
        assert slow.lookup_one(KeyBytes(k)) is (state == "ready")
        assert fast.lookup_result(k) is want
        assert slow.lookup_result(KeyBytes(k), "ctx") is want
    order = data.draw(st.permutations(probes))
    n = fast.lookup_prefix(list(order))
    assert n == slow.lookup_prefix([KeyBytes(k) for k in order])
    assert n == slow.lookup_prefix(tuple(order)), "a tuple goes through the fallback"
    assert all(expected_state(fast, k) == "ready" for k in order[:n])
    assert n == len(order) or expected_state(fast, order[n]) != "ready"
    # The fallback count included one extra lookup_prefix call (the tuple).
    f, s = lookup_counters(fast), lookup_counters(slow)
    assert (s[0] - f[0], s[1] - f[1], s[2] - f[2]) == (1, min(n + 1, len(order)), n)


def test_int_keys_take_the_fallback_with_the_same_answers():
    ix = make_index([], [])
    ix.prepare_store([1, 2**70, -5])
    ix.complete_store([1, 2**70])
    assert ix.lookup_one(1) and ix.lookup_one(2**70) and not ix.lookup_one(-5)
    assert ix.lookup_result(-5) is PENDING and ix.lookup_result(7) is MISS
    assert ix.lookup_prefix([1, 2**70, -5]) == 2
    assert ix.lookup_prefix([b"\x01", 1]) == 0, "the int 1 and b'\\x01' are different keys"
    assert ix.lookup_prefix([1, b"\x01"]) == 1


@pytest.mark.parametrize("bad", ["str", b"", b"x" * 65, 3.0, bytearray(b"ab"), None, 2**200])
def test_bad_keys_raise_the_same_error_on_every_entry_point(bad):
    ix = make_index([b"a"], [])
    with pytest.raises(kv.InvalidArgumentError) as store_err:
        ix.prepare_store([bad])
    for call in (
        lambda: ix.lookup_one(bad),
        lambda: ix.lookup_result(bad),
        lambda: ix.lookup_result(bad, None),
        lambda: ix.lookup_prefix([b"a", bad]),
    ):
        with pytest.raises(kv.InvalidArgumentError) as err:
            call()
        assert str(err.value) == str(store_err.value)
    # After a miss the walk stops: later keys are not examined (as before the fast path).
    assert ix.lookup_prefix([b"missing", bad]) == 0


def test_long_and_non_list_batches():
    keys = [i.to_bytes(4, "little") for i in range(600)]
    ix = kv.BlockIndex(1024)
    ix.prepare_store(keys)
    ix.complete_store(keys)
    assert ix.lookup_prefix(keys) == 600, "long lists walk with the GIL released"
    assert ix.lookup_prefix(keys[:300] + [b"gone"] + keys[300:]) == 300
    assert ix.lookup_prefix(iter(keys[:10])) == 10
    assert ix.lookup_prefix([]) == 0
    with pytest.raises(kv.InvalidArgumentError, match="single key"):
        ix.lookup_prefix(b"abc")


def test_call_shapes():
    ix = make_index([b"a"], [])
    with pytest.raises(TypeError):
        ix.lookup_result()
    with pytest.raises(TypeError):
        ix.lookup_result(b"a", None, None)
    with pytest.raises(TypeError, match="keyword"):
        ix.lookup_result(b"a", context=None)
    with pytest.raises(TypeError):
        ix.lookup_one()
    with pytest.raises(TypeError):
        ix.lookup_one(b"a", b"b")
    with pytest.raises(TypeError):
        kv.BlockIndex.lookup_one(object(), b"a")
    assert str(inspect.signature(kv.BlockIndex.lookup_result)) == "(self, key, context=None, /)"
    assert str(inspect.signature(ix.lookup_one)) == "(key, /)"
    assert "longest prefix" in kv.BlockIndex.lookup_prefix.__doc__


def test_unset_results_fail_on_the_fast_path_too():
    ix = kv.BlockIndex(4)
    with pytest.raises(kv.InvalidArgumentError, match="set_lookup_results"):
        ix.lookup_result(b"a")


def test_no_reference_leaks():
    ix = make_index([b"r"], [b"w"])
    before = [sys.getrefcount(o) for o in (HIT, PENDING, MISS)]
    results = [ix.lookup_result(k, None) for k in (b"r", b"w", b"m") * 1000]
    assert results.count(HIT) == results.count(PENDING) == results.count(MISS) == 1000
    del results
    assert [sys.getrefcount(o) for o in (HIT, PENDING, MISS)] == before
    key = b"r" * 3
    before = sys.getrefcount(key)
    for _ in range(1000):
        ix.lookup_one(key)
        ix.lookup_prefix([key])
    assert sys.getrefcount(key) == before


def test_one_key_lookups_from_many_threads_are_all_counted():
    """The one-key and short lookups count in the index's serial counters (no thread-local),
    relying on the GIL to serialize them: threads switching as often as the interpreter allows
    must still lose no count. Long batches, which release the GIL, count in their thread's
    stripe; both add up in stats()."""
    import sys
    import threading

    keys = [f"k{i}".encode() for i in range(300)]
    ix = kv.BlockIndex(512)
    ix.set_lookup_results(HIT, PENDING, MISS)
    ix.prepare_store(keys)
    ix.complete_store(keys)
    before = lookup_counters(ix)
    per_thread, threads = 3000, 4

    def work(t: int) -> None:
        for i in range(per_thread):
            ix.lookup_one(keys[(t + i) % 300])
            ix.lookup_result(b"absent")
            ix.lookup_prefix(keys[:3])
        ix.lookup_prefix(keys)  # 300 keys: the GIL is released for this walk

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        ts = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        sys.setswitchinterval(old)
    lookups, examined, hits = (a - b for a, b in zip(lookup_counters(ix), before, strict=True))
    calls = threads * per_thread
    assert lookups == 3 * calls + threads
    assert examined == calls * (1 + 1 + 3) + threads * 300
    assert hits == calls * (1 + 0 + 3) + threads * 300
