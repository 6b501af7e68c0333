"""`RemoteTier` against a real 3-primary cluster: blocks written through from host slots come
back byte for byte into other slots, spread over every shard, are written once however many
replicas offer them, expire when a TTL is set, and are seen only by tiers of the same namespace
and prefix."""

from __future__ import annotations

import pytest
from support.valkey import (
    BLOCK,
    FakeClock,
    bkeys,
    block_payload,
    keys_on_node,
    plain_client,
    read,
    wait_result,
    write,
)

from kvtier_rs._core import ClosedError
from kvtier_rs.tiers.remote import BreakerState, CircuitBreaker, store_key


def test_blocks_written_from_slots_read_back_identical_into_other_slots(cluster, tiers, host) -> None:
    tier = tiers(cluster)
    keys = bkeys(20)
    ticket, res = write(tier, host, keys, first_slot=0)
    assert ticket.keys == keys and not ticket.skipped and not ticket.refused and not ticket.evicted
    assert res.kind == "write" and res.success and res.ok_keys == keys and res.bytes == 20 * BLOCK
    got, slots = read(tier, host, keys, first_slot=40)
    assert got.kind == "read" and got.success and got.ok_keys == keys and not got.failed_keys
    assert got.bytes == 20 * BLOCK
    assert [host.get(s) for s in slots] == [block_payload(k) for k in keys]
    st = tier.stats()
    assert (st["writes_ok"], st["bytes_written"], st["hits"], st["bytes_read"]) == (20, 20 * BLOCK, 20, 20 * BLOCK)
    assert st["jobs_in_flight"] == 0 and st["write_bytes_in_flight"] == 0


def test_int_block_keys_round_trip_too(cluster, tiers, host) -> None:
    # The staging contract's keys are ints or bytes; the disk tier takes both.
    tier = tiers(cluster)
    keys = [7, 2**63 + 5, 0]
    _, res = write(tier, host, keys)
    assert res.success and res.ok_keys == keys
    got, slots = read(tier, host, keys, first_slot=10)
    assert got.success
    assert [host.get(s) for s in slots] == [block_payload(k) for k in keys]


def test_blocks_spread_over_every_primary(cluster, tiers, host) -> None:
    tier = tiers(cluster)
    _, res = write(tier, host, bkeys(60))
    assert res.success
    sizes = [int(c.dbsize()) for c in cluster.node_clients()]
    assert len(sizes) == 3 and all(n > 0 for n in sizes) and sum(sizes) == 60


def test_the_store_keys_are_prefix_namespace_and_block_key(cluster, tiers, host) -> None:
    tier = tiers(cluster, prefix="kvx")
    keys = bkeys(6)
    write(tier, host, keys)
    stored = {k for i in range(3) for k in keys_on_node(cluster, i)}
    assert stored == {store_key("kvx", tier.format.namespace, k) for k in keys}


def test_contains_answers_from_writes_and_probes_and_absent_answers_expire(cluster, tiers, host) -> None:
    clock = FakeClock()
    tier = tiers(cluster, clock=clock, absent_ttl_s=2.0, present_ttl_s=60.0)
    keys, missing = bkeys(4), bkeys(2, b"m")
    assert tier.contains(keys) == [False] * 4 and tier.known(keys[0]) is None
    write(tier, host, keys)
    assert tier.contains(keys) == [True] * 4 and tier.lookup_prefix([*keys, *missing]) == 4
    tier.forget()
    assert tier.contains(keys) == [False] * 4 and tier.known(keys[0]) is None

    assert tier.probe([*keys, *missing]) is True
    assert tier.wait_idle(120)
    assert tier.contains([*keys, *missing]) == [True] * 4 + [False] * 2
    assert [tier.known(k) for k in missing] == [False, False]
    assert tier.probe([*keys, *missing]) is False  # all known: nothing asked
    st = tier.stats()
    assert st["probes"] == 1 and st["probe_keys"] == 6 and st["probe_errors"] == 0

    # Another replica writes a missing block: this one learns it once the absent answer expires.
    other = tiers(cluster)
    write(other, host, missing[:1], first_slot=20)
    clock.advance(1.9)
    assert tier.known(missing[0]) is False and tier.probe(missing) is False
    clock.advance(0.2)
    assert tier.known(missing[0]) is None and tier.known(keys[0]) is True
    assert tier.probe(missing) is True and tier.wait_idle(120)
    assert [tier.known(k) for k in missing] == [True, False]
    clock.advance(61)
    assert tier.known(keys[0]) is None and tier.contains(keys) == [False] * 4


def test_a_read_miss_is_learned_as_absent(cluster, tiers, host) -> None:
    tier = tiers(cluster, clock=FakeClock())
    got, slots = read(tier, host, bkeys(3, b"none"), first_slot=0)
    assert not got.success and got.failed_keys == bkeys(3, b"none") and got.bytes == 0
    assert tier.stats()["miss_absent"] == 3
    assert [tier.known(k) for k in bkeys(3, b"none")] == [False] * 3
    assert all(host.get(s) == bytes([0xEE]) * BLOCK for s in slots)


def test_a_block_another_replica_stored_is_not_overwritten(cluster, tiers, host) -> None:
    first, second = tiers(cluster), tiers(cluster)
    key = bkeys(1, b"nx")
    write(first, host, key, first_slot=0)
    # The second replica has other bytes for the block (it cannot know the store has it).
    host.put(1, b"\x55" * BLOCK)
    ticket = second.submit_write(key, host.pool, [1])
    assert ticket.keys == key
    res = wait_result(second, ticket.job_id)
    assert res.success and res.ok_keys == key
    st = second.stats()
    assert st["writes_skipped_present"] == 1 and st["writes_ok"] == 0 and st["bytes_written"] == 0
    assert second.contains(key) == [True]
    got, slots = read(second, host, key, first_slot=2)
    assert got.success and host.get(slots[0]) == block_payload(key[0])
    # And a replica that knows the block is there does not even send it.
    again = second.submit_write(key, host.pool, [1])
    assert again.skipped == key and again.keys == [] and second.stats()["writes_skipped_present"] == 2
    assert wait_result(second, again.job_id).success


def test_admission_uses_2_stores_a_block_on_its_second_offer(cluster, tiers, host) -> None:
    tier = tiers(cluster, admission="uses:2")
    keys = bkeys(3, b"adm")
    t1, r1 = write(tier, host, keys)
    assert t1.keys == [] and t1.refused == keys and r1.success and r1.ok_keys == []
    assert cluster.dbsize() == 0 and tier.stats()["writes_refused_admission"] == 3
    t2, r2 = write(tier, host, keys[:2])
    assert t2.keys == keys[:2] and r2.ok_keys == keys[:2]
    assert cluster.dbsize() == 2


def test_admission_by_priority(cluster, tiers, host) -> None:
    tier = tiers(cluster, admission="priority:50")
    low, high = bkeys(2, b"lo"), bkeys(2, b"hi")
    t1, _ = write(tier, host, low, priority=35)
    t2, r2 = write(tier, host, high, first_slot=10, priority=50)
    assert t1.refused == low and t2.keys == high and r2.ok_keys == high
    assert cluster.dbsize() == 2


def test_a_write_past_the_backlog_limit_is_dropped_and_counted(cluster, tiers, host) -> None:
    tier = tiers(cluster, max_write_bytes=2 * BLOCK)
    big = bkeys(3, b"big")
    # The leading blocks that fit go; the rest are dropped, never queued.
    ticket, res = write(tier, host, big)
    assert ticket.keys == big[:2] and ticket.refused == big[2:] and res.ok_keys == big[:2]
    assert tier.stats()["writes_dropped_backlog"] == 1 and cluster.dbsize() == 2
    assert tier.stats()["write_bytes_in_flight"] == 0
    # With a write in flight, only what is left of the limit.
    more = bkeys(3, b"more")
    first = tier.submit_write(more[:1], host.pool, [0])
    second = tier.submit_write(more[1:], host.pool, [1, 2])
    assert first.keys == more[:1] and second.keys == more[1:2] and second.refused == more[2:]
    wait_result(tier, first.job_id)
    wait_result(tier, second.job_id)
    assert tier.stats()["writes_dropped_backlog"] == 2


def test_a_ttl_sets_an_expiry_and_none_sets_none(cluster, tiers, host) -> None:
    with_ttl, without = tiers(cluster, ttl_s=300.0, prefix="ttl"), tiers(cluster, prefix="nottl")
    write(with_ttl, host, bkeys(2))
    write(without, host, bkeys(2))
    rc = plain_client(cluster)
    try:
        ttls = [rc.ttl(with_ttl._store_key(k)) for k in bkeys(2)]
        assert all(250 <= t <= 300 for t in ttls), ttls
        assert [rc.ttl(without._store_key(k)) for k in bkeys(2)] == [-1, -1]
    finally:
        rc.close()


@pytest.mark.parametrize("other", [{"salt": "tenant-2"}, {"prefix": "other"}, {"identity": "another-model"}])
def test_a_tier_of_another_namespace_or_prefix_neither_sees_nor_reads_the_blocks(cluster, tiers, host, other) -> None:
    mine, theirs = tiers(cluster), tiers(cluster, **other)
    keys = bkeys(4, b"ns")
    write(mine, host, keys)
    assert theirs.probe(keys) and theirs.wait_idle(120)
    assert [theirs.known(k) for k in keys] == [False] * 4
    got, slots = read(theirs, host, keys, first_slot=10)
    assert got.failed_keys == keys and theirs.stats()["miss_absent"] == 4
    assert all(host.get(s) == bytes([0xEE]) * BLOCK for s in slots)
    # Its own write of the same blocks lands beside them, not over them.
    _, res = write(theirs, host, keys, first_slot=20)
    assert theirs.stats()["writes_ok"] == 4 and cluster.dbsize() == 8 and res.success


def test_slot_stride_is_the_payload_in_pages_plus_a_header_page(cluster, tiers) -> None:
    assert tiers(cluster).slot_stride == 2 * 4096 + 4096  # 6000 bytes round up to 2 pages


def test_a_closed_tier_refuses_work_and_holds_nothing(cluster, tiers, host) -> None:
    tier = tiers(cluster)
    write(tier, host, bkeys(1))
    tier.close()
    tier.close()  # idempotent
    assert tier.contains(bkeys(1)) == [False] and tier.probe(bkeys(1)) is False
    with pytest.raises(ClosedError):
        tier.submit_read(bkeys(1), host.pool, [0])
    with pytest.raises(ClosedError):
        tier.submit_write(bkeys(1), host.pool, [0])


@pytest.mark.parametrize("why", ["known-present", "admission", "backlog"])
def test_a_write_that_sends_nothing_does_not_swallow_the_breakers_probe(cluster, tiers, host, why) -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failures=1, cooldown_s=1.0, max_cooldown_s=1.0, clock=clock)
    kw = {"admission": "uses:2"} if why == "admission" else {}
    if why == "backlog":
        kw["max_write_bytes"] = BLOCK - 1  # less than one block: nothing fits
    tier = tiers(cluster, clock=clock, breaker=breaker, **kw)
    known = bkeys(1, b"known")
    if why == "known-present":
        write(tier, host, known)
    breaker.failed()  # as after a failed operation: open for 1 s
    assert breaker.state is BreakerState.OPEN
    clock.advance(1.0)
    # Past the cool-down, an offer that goes nowhere near the store...
    offer = known if why != "backlog" else bkeys(2, b"big")
    t = tier.submit_write(offer, host.pool, list(range(len(offer))))
    assert t.keys == []
    wait_result(tier, t.job_id)
    # ...must leave the probe to an operation that does: the next write goes to the store.
    tier.max_write_bytes = 4 * BLOCK  # (room for it, in the backlog case)
    fresh = bkeys(1, b"fresh")
    if why == "admission":
        tier.submit_write(fresh, host.pool, [5])  # its first offer
    ticket, res = write(tier, host, fresh, first_slot=5)
    assert ticket.keys == fresh and res.ok_keys == fresh, tier.stats()
    assert breaker.state is BreakerState.CLOSED


def test_a_block_key_too_long_for_the_format_is_refused_not_left_to_the_deadline(cluster, tiers, host) -> None:
    tier = tiers(cluster, clock=FakeClock())  # a deadline that never passes: only a report ends a job
    long_key, good = b"L" * 2000, bkeys(1, b"fine")
    ticket = tier.submit_write([long_key, *good], host.pool, [0, 1])
    assert long_key in ticket.refused and ticket.keys == good
    res = wait_result(tier, ticket.job_id, timeout=60)
    assert res.ok_keys == good and tier.stats()["deadline_exceeded"] == 0
    assert tier.stats()["writes_failed"] == 1 and tier.stats()["writes_refused_admission"] == 0
