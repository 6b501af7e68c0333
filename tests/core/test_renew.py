"""`renew`: a later claim of blocks already in a tier overrides their retention priority and
duration (TensorRT-LLM's "a later claim with a new priority always overrides the old one"),
which `prepare_store` cannot do since it leaves present keys alone. The priority policy moves a
renewed block to its new level as the most recent there and restarts or clears its expiry; the
other policies' order ignores the hint, and a renewal is not a use."""

from __future__ import annotations

import pytest
from support.disk import Host, make_tier, write

import kvtier_rs as kv


def ready(ix: kv.BlockIndex, keys: list, **hint) -> None:
    out = ix.prepare_store(keys, **hint)
    assert out.keys == keys, "stored anew"
    assert ix.complete_store(keys) == len(keys)


def evicted_by(ix: kv.BlockIndex, keys: list) -> list:
    out = ix.prepare_store(keys)
    ix.complete_store(out.keys)
    return out.evicted


def priority_index(capacity: int) -> kv.BlockIndex:
    return kv.BlockIndex(capacity, policy="priority", manual_clock=True)


def test_a_renewed_priority_overrides_the_stored_one():
    ix = priority_index(2)
    ready(ix, [b"kept"], priority=80)
    ready(ix, [b"default"])
    # A store leaves a present key, and its priority, alone.
    assert ix.prepare_store([b"kept"], priority=10).skipped == [b"kept"]
    assert ix.renew([b"kept"], priority=10) == 1
    assert evicted_by(ix, [b"new"]) == [b"kept"], "now at 10, below the default-level block"
    assert ix.stats()["renewals"] == 1


def test_a_renewal_with_a_duration_falls_back_to_35_when_the_clock_passes_it():
    ix = priority_index(2)
    ready(ix, [b"default"])
    ready(ix, [b"kept"], priority=80)  # for good, until renewed
    assert ix.renew([b"kept"], priority=80, duration_s=2.0) == 1
    ix.advance_clock(1.5)
    assert evicted_by(ix, [b"a"]) == [b"default"], "still at 80"
    ix.advance_clock(0.5)
    # Back at 35, where it ranks by its renewal: before b"a", stored after it.
    assert evicted_by(ix, [b"b"]) == [b"kept"]


def test_a_renewal_restarts_the_duration_from_the_renewal():
    ix = priority_index(2)
    ready(ix, [b"kept"], priority=80, duration_s=1.0)
    ready(ix, [b"mid"], priority=50)
    ix.advance_clock(0.5)
    assert ix.renew_one(b"kept", priority=80, duration_s=1.0)
    ix.advance_clock(0.75)  # past the first duration, not the renewed one
    assert evicted_by(ix, [b"a"]) == [b"mid"], "b'kept' still at 80"
    ix.advance_clock(0.25)
    assert evicted_by(ix, [b"b"]) == [b"kept"], "back at 35, and renewed before b'a' was stored"


def test_a_renewal_without_a_duration_clears_the_earlier_one():
    ix = priority_index(2)
    ready(ix, [b"kept"], priority=80, duration_s=1.0)
    assert ix.renew([b"kept"], priority=80) == 1
    ready(ix, [b"default"])
    ix.advance_clock(100.0)
    assert evicted_by(ix, [b"a"]) == [b"default"], "b'kept' stays at 80 for good"
    assert evicted_by(ix, [b"b"]) == [b"a"]


def test_a_renewed_chain_keeps_its_head_the_more_recent():
    # Applied tail-first like a store: at the new level the tail goes before the head.
    ix = priority_index(3)
    ready(ix, [b"head", b"mid", b"tail"])
    assert ix.renew([b"head", b"mid"], priority=10) == 2
    assert evicted_by(ix, [b"x", b"y"]) == [b"mid", b"head"]


def test_absent_keys_are_ignored_and_each_present_key_counts_once():
    ix = priority_index(8)
    ready(ix, [0, 1, 2])
    ix.prepare_store([b"writing"])
    ix.pin_for_load([1])
    assert ix.renew([0, 99, 0, b"writing", 1, b"absent"], priority=90) == 3
    assert ix.renew([99]) == 0 and ix.renew([]) == 0
    assert ix.renew_one(2) is True and ix.renew_one(98) is False
    assert len(ix) == 4 and ix.stats()["renewals"] == 4
    assert ix.stats()["evictions"] == 0 and ix.stats()["touches"] == 0, "a renewal is not a use"
    assert ix.complete_store([b"writing"]) == 1, "a renewed block being written completes as usual"
    # A long batch (the GIL is released) renews the same way.
    assert ix.renew([0, 1, 2, b"writing"] * 100, priority=5) == 4


BAD_HINTS = [
    ({"priority": 101}, kv.InvalidArgumentError, "priority"),
    ({"priority": -1}, kv.InvalidArgumentError, "priority"),
    ({"priority": 80, "duration_s": -1.0}, kv.InvalidArgumentError, "duration_s"),
    ({"priority": 80, "duration_s": float("nan")}, kv.InvalidArgumentError, "duration_s"),
    ({"priority": 80, "duration_s": 1e300}, kv.InvalidArgumentError, "duration_s"),
    ({"priority": "high"}, TypeError, "priority"),
    ({"priority": 80, "duration_s": "1s"}, TypeError, "duration_s"),
]


def error_of(call) -> tuple[type, str, list[str]]:
    with pytest.raises(Exception) as info:
        call()
    return type(info.value), str(info.value), getattr(info.value, "__notes__", [])


@pytest.mark.parametrize(("hint", "kind", "arg"), BAD_HINTS)
def test_bad_hints_give_the_same_errors_as_prepare_store(hint, kind, arg):
    ix = priority_index(4)
    ready(ix, [1])
    err = error_of(lambda: ix.renew([1], **hint))
    assert err == error_of(lambda: ix.prepare_store([1], **hint))
    assert err == error_of(lambda: ix.renew_one(1, **hint)) == error_of(lambda: ix.prepare_store_one(1, **hint))
    assert err[0] is kind and arg in err[1] + " ".join(err[2])
    assert ix.stats()["renewals"] == 0, "a refused renewal changes nothing"


@pytest.mark.parametrize(
    "keys", [[1.5], [1, "k"], [bytearray(b"k")], [b""], [b"x" * 65], [2**127], b"ab", 7, "ab", None]
)
def test_bad_keys_give_the_same_errors_as_prepare_store(keys):
    ix = priority_index(4)
    ready(ix, [1])
    err = error_of(lambda: ix.renew(keys, priority=80))
    assert err == error_of(lambda: ix.prepare_store(keys, priority=80))
    assert issubclass(err[0], kv.InvalidArgumentError | TypeError)
    assert ix.stats()["renewals"] == 0


@pytest.mark.parametrize("key", [1.5, bytearray(b"k"), b"", None])
def test_a_bad_single_key_gives_the_same_error_as_prepare_store_one(key):
    ix = priority_index(4)
    assert error_of(lambda: ix.renew_one(key, priority=80)) == error_of(lambda: ix.prepare_store_one(key, priority=80))


@pytest.mark.parametrize("policy", ["lru", "fifo", "arc", "s3fifo"])
def test_a_renewal_changes_no_order_where_the_policy_ignores_the_hint(policy):
    def victims(renew: bool) -> list:
        ix = kv.BlockIndex(4, policy=policy)
        ready(ix, [0, 1, 2, 3])  # tail first: 3 is the least recent
        ix.touch([1])
        if renew:
            assert ix.renew([3, 2], priority=100) == 2
            assert ix.renew_one(0, priority=0, duration_s=1.0)
        return [evicted_by(ix, [10 + i]) for i in range(4)]

    assert victims(renew=True) == victims(renew=False)


def test_under_lru_a_renewal_does_not_count_as_a_use():
    ix = kv.BlockIndex(3, policy="lru")
    ready(ix, [b"a", b"b", b"c"])  # LRU first: c, b, a
    assert ix.renew([b"c"], priority=100) == 1
    assert evicted_by(ix, [b"d"]) == [b"c"], "a touch would have kept b'c'"


def test_a_failed_index_renews_nothing_and_raises_nothing():
    ix = kv.BlockIndex(2, policy="priority")
    ready(ix, [1, 2])
    ix._inject_fault("store_panic")
    with pytest.raises(kv.IndexFailedError):
        ix.prepare_store([3])
    assert ix.renew([1, 2], priority=90) == 0
    assert ix.renew_one(1, priority=90) is False
    with pytest.raises(kv.InvalidArgumentError, match="priority"):
        ix.renew([1], priority=101)
    assert ix.stats()["renewals"] == 0


def test_the_disk_tier_renews_through_its_index(tmp_path):
    host = Host(4)
    tier = make_tier(tmp_path, "pool", blocks=2, num_files=1, policy="priority")
    try:
        write(tier, host, [b"kept"])
        write(tier, host, [b"default"], first_slot=1)
        assert tier.renew([b"kept", b"absent"], priority=100) == 1
        assert tier.stats()["renewals"] == 1
        ticket, _ = write(tier, host, [b"new"], first_slot=2)
        assert ticket.evicted == [b"default"], "b'kept' was renewed at 100"
        with pytest.raises(kv.InvalidArgumentError, match="priority"):
            tier.renew([b"kept"], priority=101)
    finally:
        tier.close()
    with pytest.raises(kv.ClosedError):
        tier.renew([b"kept"])
