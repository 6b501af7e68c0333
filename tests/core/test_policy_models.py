"""Every policy, through the real Rust index, against the plain-Python reference models.

The state machine drives a `BlockIndex` and an `IndexModel` with the same operations (stores
of key chains, failed stores, lookups, pins, unpins, touches, refreshes, renewals, removals, clears, clock
moves)
and requires identical outcomes after every step: the same victims in the same order, the
same resident keys with the same states and pin counts, the same errors. Invariants checked
on the Rust side alone: never over capacity, slots unique, counters consistent.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from support.models import IndexModel, NoSpace, NotPinned, NotReady

import kvtier_rs as kv

# Bytes keys of the lengths engines use (vLLM: 36 bytes) next to small ints, so both kinds mix.
BYTES_KEYS = [b"a", b"b", b"\x00" * 36, b"\x01" * 64]
PRIORITIES = st.sampled_from([35, 0, 10, 60, 100])


def make_machine(policy: str, min_priority: int | None = None, key_domain: int = 30, long_runs: bool = False):  # noqa: C901 - a state machine: one rule per operation
    keys = st.integers(min_value=0, max_value=key_domain - 1) | st.sampled_from(BYTES_KEYS)
    chains = st.lists(keys, min_size=1, max_size=5)

    class IndexVersusModel(RuleBasedStateMachine):
        @initialize(capacity=st.sampled_from([1, 2, 3, 5, 8, 12, 20, 30]))
        def setup(self, capacity):
            admission = "always" if min_priority is None else f"priority:{min_priority}"
            self.ix = kv.BlockIndex(capacity, policy=policy, admission=admission, manual_clock=True)
            self.model = IndexModel(capacity, policy, min_priority)
            self.slots_exact = True
            self.stats = {"evictions": 0, "refused": 0, "renewals": 0}

        @rule(keys=chains, priority=PRIORITIES, duration=st.sampled_from([None, 0.5, 2.0]), ok=st.booleans())
        def store(self, keys, priority, duration, ok):
            duration_ns = None if duration is None else int(duration * 1e9)
            try:
                placed, skipped, refused, evicted = self.model.prepare_store(keys, priority, duration_ns)
            except NoSpace:
                with pytest.raises(kv.NoSpaceError):
                    self.ix.prepare_store(keys, priority=priority, duration_s=duration)
                return
            out = self.ix.prepare_store(keys, priority=priority, duration_s=duration)
            assert list(out.keys) == [k for k, _ in placed]
            assert list(out.evicted) == evicted, "eviction order differs from the model"
            assert list(out.skipped) == skipped
            assert list(out.refused) == refused
            if self.slots_exact:
                assert list(out.slots) == [s for _, s in placed]
            self.stats["evictions"] += len(evicted)
            self.stats["refused"] += len(set(refused))  # the counter counts distinct keys
            assert self.ix.complete_store(out.keys, ok) == self.model.complete_store(out.keys, ok)

        @rule(ops=st.lists(st.tuples(st.sampled_from(["store", "touch", "refresh"]), chains), max_size=25))
        def burst(self, ops):
            # Runs of stores, touches and refreshes: where policies differ from one another (ghost
            # hits, promotions, frequency decay) only shows after many of them in a row.
            for op, keys in ops:
                if op == "store":
                    self.store(keys, 35, None, True)
                else:
                    getattr(self, op)(keys)

        if long_runs:

            @rule(hot=chains, rounds=st.integers(40, 160), offset=st.integers(0, key_domain - 1))
            def churn(self, hot, rounds, offset):
                # A hot chain used every round among a stream of other keys: enough evictions,
                # at enough different ages, for a policy that learns from them to do so.
                for r in range(rounds):
                    self.touch(hot)
                    self.store(hot if r % 7 == 0 else [(offset + r) % key_domain], 35, None, True)

        @rule(keys=chains)
        def begin_store_left_open(self, keys):
            # A store whose completion never arrives: its blocks stay unreadable and unevictable.
            try:
                placed, *_, evicted = self.model.prepare_store(keys)
            except NoSpace:
                with pytest.raises(kv.NoSpaceError):
                    self.ix.prepare_store(keys)
                return
            out = self.ix.prepare_store(keys)
            assert list(out.evicted) == evicted
            self.stats["evictions"] += len(evicted)

        @rule(keys=chains, ok=st.booleans())
        def complete(self, keys, ok):
            assert self.ix.complete_store(keys, ok) == self.model.complete_store(keys, ok)

        @rule(keys=chains)
        def lookup(self, keys):
            assert self.ix.lookup_prefix(keys) == self.model.lookup_prefix(keys)
            # The engines' per-key walk (chained through the previous answer's slot).
            for k in keys:
                ready = self.model.lookup_prefix([k]) == 1
                assert self.ix.lookup_one(k) is ready
                if not ready:
                    break

        @rule(keys=chains)
        def pin(self, keys):
            try:
                slots = self.model.pin_for_load(keys)
            except NotReady:
                with pytest.raises(kv.NotReadyError):
                    self.ix.pin_for_load(keys)
                return
            got = self.ix.pin_for_load(keys)
            if self.slots_exact:
                assert got == slots

        @rule(keys=chains)
        def unpin(self, keys):
            try:
                self.model.unpin(keys)
            except NotPinned:
                with pytest.raises(kv.NotPinnedError):
                    self.ix.unpin(keys)
                return
            self.ix.unpin(keys)

        @rule(keys=chains)
        def touch(self, keys):
            self.ix.touch(keys)
            self.model.touch(keys)

        @rule(keys=chains)
        def refresh(self, keys):
            self.ix.refresh(keys)
            self.model.refresh(keys)

        @rule(keys=chains, priority=PRIORITIES, duration=st.sampled_from([None, 0.5, 2.0]), one=st.booleans())
        def renew(self, keys, priority, duration, one):
            # A later claim of blocks already present overrides their priority and duration.
            duration_ns = None if duration is None else int(duration * 1e9)
            want = self.model.renew(keys[:1] if one else keys, priority, duration_ns)
            if one:
                assert self.ix.renew_one(keys[0], priority=priority, duration_s=duration) is (want == 1)
            else:
                assert self.ix.renew(keys, priority=priority, duration_s=duration) == want
            self.stats["renewals"] += want

        @rule(keys=chains, roll=st.integers(0, 2))
        def remove(self, keys, roll):
            if roll:
                return
            assert list(self.ix.remove(keys)) == self.model.remove(keys)

        @rule(roll=st.integers(0, 9))
        def clear(self, roll):
            if roll:  # keep clears rare so that state builds up between them
                return
            assert self.ix.clear() == self.model.clear()
            self.slots_exact = False  # the core frees slots in map order, the model in key order

        @rule(seconds=st.sampled_from([0.25, 1.0, 3.0]))
        def advance(self, seconds):
            self.ix.advance_clock(seconds)
            self.model.now += int(seconds * 1e9)

        @invariant()
        def same_contents(self):
            if not hasattr(self, "ix"):
                return
            rust = {k: (state, pins) for k, state, pins, _ in self.ix.entries()}
            model = {k: (e["state"], e["pins"]) for k, e in self.model.entries.items()}
            assert rust == model
            assert len(self.ix) <= self.ix.capacity
            slots = [slot for *_, slot in self.ix.entries()]
            assert len(set(slots)) == len(slots), "two blocks share a slot"
            s = self.ix.stats()
            assert s["resident_blocks"] == len(model)
            assert s["evictions"] == self.stats["evictions"]
            assert s["store_refused"] == self.stats["refused"]
            assert s["renewals"] == self.stats["renewals"]
            assert s["pinned_blocks"] == sum(1 for _, p in model.values() if p > 0)

    IndexVersusModel.TestCase.settings = settings(max_examples=120, stateful_step_count=60, deadline=None)
    return IndexVersusModel


TestFifo = make_machine("fifo").TestCase
TestLru = make_machine("lru").TestCase
TestArc = make_machine("arc", key_domain=16).TestCase
TestPriority = make_machine("priority").TestCase
TestS3Fifo = make_machine("s3fifo", key_domain=40).TestCase
# Long runs of stores, so that the learned densities are rebuilt (every 64 evictions) and used.
TestHitDensity = make_machine("lhd", key_domain=60, long_runs=True).TestCase
TestLruWithPriorityAdmission = make_machine("lru", min_priority=30).TestCase


@pytest.mark.parametrize("side", ["index", "model"])
def test_fifo_by_hand_an_extension_leaves_with_its_chain(side):
    # Capacity 4, stores of chains given head first, inserted tail first:
    #   [H, T]     -> queue T, H              (T first in: the tail leaves first)
    #   [X]        -> queue T, H, X
    #   [H, T, U]  -> U extends the stored chain: it takes the chain's place, just ahead of T
    #                 (the present block before it), not the back: queue U, T, H, X.
    #                 H and T are hits and do not move.
    #   [Y] evicts U, [Z] evicts T, [W] evicts H: the chain leaves in the order it arrived,
    #   its extension first, and the extension never outlives its prefix.
    # Without the rule U went to the back (queue T, H, X, U) and the same stores evicted T, H, X,
    # leaving U cached behind a missing prefix.
    H, T, X, U, Y, Z, W = 1, 2, 3, 4, 5, 6, 7
    if side == "index":
        ix = kv.BlockIndex(4, policy="fifo", admission="always")

        def store(keys):
            out = ix.prepare_store(keys)
            ix.complete_store(out.keys, True)
            return list(out.evicted)
    else:
        ix = IndexModel(4, "fifo")

        def store(keys):
            *_, evicted = ix.prepare_store(keys)
            ix.complete_store(keys, True)
            return evicted

    assert store([H, T]) == []
    assert store([X]) == []
    assert store([H, T, U]) == []
    assert ix.lookup_prefix([H, T, U]) == 3
    assert store([Y]) == [U]
    assert ix.lookup_prefix([H, T, U]) == 2
    assert store([Z]) == [T]
    assert store([W]) == [H]
    assert ix.lookup_prefix([X]) == 1
