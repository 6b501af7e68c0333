"""The bounded block-event stream: sequence numbers, ordering, overflow accounting, and the
events the orchestrator publishes as blocks move."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import kvtier_rs as kv
from kvtier_rs._core import DiskTier, InvalidArgumentError
from kvtier_rs.orchestrator import TierOrchestrator
from kvtier_rs.tiers.events import EventStream
from kvtier_rs.transfer import BlockLayout, CpuTransferEngine


def test_sequence_numbers_are_consecutive_and_drain_keeps_order():
    ev = EventStream(capacity=8)
    for i in range(5):
        ev.publish("stored", "cpu", [i, i + 100])
    assert ev.publish("removed", "cpu", []) is None  # an empty batch is no event
    got = ev.drain(3)
    assert [e.seq for e in got] == [1, 2, 3]
    assert [e.keys for e in got] == [(0, 100), (1, 101), (2, 102)]
    assert [e.seq for e in ev.drain()] == [4, 5]
    assert ev.drain() == [] and ev.dropped == 0
    assert ev.publish("promoted", "disk", [7]).seq == 6


def test_overflow_drops_the_oldest_and_counts_them():
    ev = EventStream(capacity=4)
    for i in range(10):
        ev.publish("stored", "cpu", [i])
    assert ev.dropped == 6
    assert len(ev) == 4
    got = ev.drain()
    assert [e.seq for e in got] == [7, 8, 9, 10]
    assert [e.keys[0] for e in got] == [6, 7, 8, 9]
    # Drained events are not counted as dropped when the ring fills again.
    for i in range(4):
        ev.publish("removed", "disk", [i], reason="evicted")
    assert ev.dropped == 6
    ev.publish("removed", "disk", [99], reason="evicted")
    assert ev.dropped == 7
    st = ev.stats()
    assert st["published"] == {"stored": 10, "removed": 5, "promoted": 0, "bypassed": 0, "restored": 0}
    assert st["queued"] == 4 and st["last_seq"] == 15


def test_cursor_consumers_read_without_taking_and_see_their_gaps():
    ev = EventStream(capacity=4)
    for i in range(3):
        ev.publish("stored", "cpu", [i])
    a = ev.since(0)
    assert [e.seq for e in a] == [1, 2, 3]
    assert [e.seq for e in ev.since(1, max_events=1)] == [2]
    assert len(ev) == 3  # nothing taken
    for i in range(3, 9):
        ev.publish("stored", "cpu", [i])
    # A consumer whose cursor is at 3 lost 4 and 5 (overwritten): it can tell exactly.
    later = ev.since(3)
    assert [e.seq for e in later] == [6, 7, 8, 9]
    assert ev.missed_since(3) == 2
    assert ev.missed_since(8) == 0
    assert ev.since(9) == [] and ev.since(100) == []


def test_bad_arguments_name_the_argument():
    with pytest.raises(InvalidArgumentError, match="capacity"):
        EventStream(0)
    ev = EventStream(2)
    with pytest.raises(InvalidArgumentError, match="kind"):
        ev.publish("moved", "cpu", [1])
    with pytest.raises(InvalidArgumentError, match="tier"):
        ev.publish("stored", "gpu", [1])
    with pytest.raises(InvalidArgumentError, match="max_events"):
        ev.drain(-1)
    with pytest.raises(InvalidArgumentError, match="seq"):
        ev.since(-1)


def test_concurrent_publishers_and_a_drainer_lose_nothing_but_what_is_counted():
    ev = EventStream(capacity=64)
    got = []
    stop = threading.Event()

    def consumer():
        while not stop.is_set() or len(ev):
            got.extend(ev.drain(16))

    c = threading.Thread(target=consumer)
    c.start()
    pubs = [
        threading.Thread(target=lambda t=t: [ev.publish("stored", "cpu", [(t, i)]) for i in range(2000)])
        for t in range(3)
    ]
    for p in pubs:
        p.start()
    for p in pubs:
        p.join()
    stop.set()
    c.join()
    seqs = [e.seq for e in got]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert len(got) + ev.dropped == 6000 == ev.last_seq


def test_orchestrator_publishes_stored_removed_promoted(tmp_path):
    tensors = [torch.randn(32, 2, 16, 64)]
    layout = BlockLayout.per_layer(tensors)
    host = kv.HostTier(kv.TierConfig(4 * 8192, layout.bytes_per_block))
    disk = DiskTier(str(tmp_path / "d"), 4 * (8192 + 4096), host.pool.slot_bytes, admission="always", engine="pool")
    ev = EventStream(capacity=64)
    o = TierOrchestrator(host, CpuTransferEngine(layout, host.pool), disk=disk, events=ev)
    a = [b"a0", b"a1", b"a2"]
    o.offload(a, [0, 1, 2])
    o.drain()
    assert [(e.kind, e.tier, e.keys) for e in ev.drain()] == [("stored", "cpu", tuple(a)), ("stored", "disk", tuple(a))]
    # Two more blocks: the CPU tier (4 slots) evicts a's tail first; the disk (4 slots) too.
    b = [b"b0", b"b1"]
    o.offload(b, [3, 4])
    o.drain()
    got = [(e.kind, e.tier, e.keys, e.reason) for e in ev.drain()]
    assert got[0] == ("removed", "cpu", (b"a2",), "evicted")
    assert ("stored", "cpu", tuple(b), None) in got
    assert ("removed", "disk", (b"a2",), "evicted") in got
    assert got[-1] == ("stored", "disk", tuple(b), None)
    # A load from CPU, then from disk (after dropping the CPU copies).
    o.load(a[:2], [5, 6], request_id="cpu")
    o.drain()
    assert [(e.kind, e.tier, e.keys) for e in ev.drain()] == [("promoted", "cpu", tuple(a[:2]))]
    host.index.remove(b)
    o.load(b, [7, 8], request_id="disk")
    o.drain()
    got = [(e.kind, e.tier, e.keys) for e in ev.drain()]
    assert ("stored", "cpu", tuple(b)) in got  # staged up from disk: a CPU copy exists again
    assert got[-1] == ("promoted", "disk", tuple(b))
    seqs = [e.seq for e in ev.since(0)]
    assert seqs == []  # all drained
    assert ev.dropped == 0


def test_a_guard_trip_and_recovery_are_tier_events(tmp_path):
    """The SLO guard's trip and the tier's return to service reach routers as events with no
    keys (the tier is what changed), once each."""
    from kvtier_rs.orchestrator.guard import GuardRule

    tensors = [torch.randn(8, 2, 16, 64)]
    layout = BlockLayout.per_layer(tensors)
    host = kv.HostTier(kv.TierConfig(4 * 8192, layout.bytes_per_block))
    ev = EventStream(capacity=64)
    rule = GuardRule(p99_ms=10, recover_s=0.05, min_samples=1)
    o = TierOrchestrator(host, CpuTransferEngine(layout, host.pool), events=ev, guards={"cpu": rule})
    o.offload([b"x"], [0])
    o.drain()
    ev.drain()
    o.guards["cpu"].trip_hung(0.5)  # as when every CPU load in flight stalled
    assert o.plan([b"x"]).refused == {"cpu": {"guard": 1}}
    o.plan([b"x"])  # still bypassed: no second event
    got = [(e.kind, e.tier, e.keys) for e in ev.drain()]
    assert got == [("bypassed", "cpu", ())]
    deadline = time.monotonic() + 0.1
    while time.monotonic() < deadline:  # at least the cool-down (a slow machine waits longer)
        time.sleep(0.01)
    assert o.plan([b"x"]).load_cpu == 1
    got = [(e.kind, e.tier, e.keys, e.reason) for e in ev.drain()]
    assert got == [("restored", "cpu", (), "cool-down over")]
    assert o.stats()["events"]["published"]["bypassed"] == 1


def test_no_stream_means_no_events(tmp_path):
    tensors = [torch.randn(8, 2, 16, 64)]
    layout = BlockLayout.per_layer(tensors)
    host = kv.HostTier(kv.TierConfig(4 * 8192, layout.bytes_per_block))
    o = TierOrchestrator(host, CpuTransferEngine(layout, host.pool))
    o.offload([b"x"], [0])
    o.drain()
    assert o.events is None and o.stats()["events"] is None


@pytest.mark.parametrize("single", [b"\x01\x02", "ab", 7])
def test_publish_refuses_a_single_key_where_a_batch_is_expected(single):
    """publish(kind, tier, b"\\x01\\x02") published the keys (1, 2): a digest passed where a batch
    is expected became one int key per byte (a str, one key per character), and consumers
    indexing those keys were told of blocks that do not exist."""
    ev = EventStream(4)
    with pytest.raises(InvalidArgumentError, match="`keys`: expected a sequence of keys, got a single key"):
        ev.publish("stored", "cpu", single)
    assert ev.last_seq == 0 and len(ev) == 0


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda ev: ev.since(0, max_events=-1), "max_events"),
        (lambda ev: ev.since(0, max_events="2"), "max_events"),
        (lambda ev: ev.since(0, max_events=1.5), "max_events"),
        (lambda ev: ev.since(True), "seq"),
        (lambda ev: ev.drain(True), "max_events"),
        (lambda ev: ev.missed_since(-5), "seq"),
        (lambda ev: ev.missed_since("a"), "seq"),
        (lambda ev: ev.missed_since(1.5), "seq"),
    ],
)
def test_cursor_and_count_arguments_are_checked_everywhere(call, name):
    """since() checked seq but not max_events (-1 silently returned nothing, "2" was a TypeError);
    missed_since() checked nothing (-5 answered 6 missed when none were); bools passed as ints."""
    ev = EventStream(8)
    for i in range(5):
        ev.publish("stored", "cpu", [i])
    with pytest.raises(InvalidArgumentError, match=f"`{name}`"):
        call(ev)
    assert len(ev) == 5
