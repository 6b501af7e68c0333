"""An internal error (a panic inside the index) disables the index instead of leaving it to run
on from state no invariant covers: lookups miss, stores and pins raise IndexFailedError (an
ordinary KvTierError, not pyo3's BaseException-derived PanicException), other writes do nothing,
and the data path around it keeps serving by recomputing. The panic is a real one, injected
mid-store after the store's evictions (`_inject_fault("store_panic")`)."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import kvtier_rs as kv
from kvtier_rs.metrics.collector import KvTierCollector
from kvtier_rs.orchestrator import TierOrchestrator
from kvtier_rs.transfer import BlockLayout, CpuTransferEngine


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


def failed_index() -> tuple[kv.BlockIndex, list[bytes]]:
    """A full 5-block index (4 ready blocks, one being written) whose next evicting store
    panicked; returns it and its ready keys."""
    ix = kv.BlockIndex(5)
    resident = keys("a", 4)
    ix.prepare_store(resident)
    ix.complete_store(resident)
    ix.prepare_store([b"writing"])
    ix._inject_fault("store_panic")
    with pytest.raises(kv.IndexFailedError, match="injected fault"):
        ix.prepare_store(keys("b", 2))
    return ix, resident


def test_the_failure_is_an_ordinary_kvtier_error():
    assert issubclass(kv.IndexFailedError, kv.KvTierError)
    assert issubclass(kv.IndexFailedError, Exception)


def test_a_failed_index_misses_refuses_stores_and_pins_and_says_why():
    ix, resident = failed_index()
    assert ix.failure is not None and "injected fault" in ix.failure
    assert ix.stats()["failed"] == 1
    # Reads: every path answers "absent", the per-key fast calls included.
    assert ix.lookup_prefix(resident) == 0
    assert not any(ix.lookup_one(k) for k in resident)
    ix.set_lookup_results("hit", "pending", "miss")
    assert {ix.lookup_result(k) for k in resident + [b"writing"]} == {"miss"}
    assert ix.contains(resident) == [False] * 4
    assert ix.state(resident[0]) is None
    assert ix.entries() == []
    # Stores and pins are refused with the reason.
    for call in (
        lambda: ix.prepare_store(keys("c", 1)),
        lambda: ix.prepare_store_one(b"c"),
        lambda: ix.pin_for_load(resident[:1]),
        lambda: ix.pin_one(resident[0]),
    ):
        with pytest.raises(kv.IndexFailedError, match="disabled after an internal error: panic: injected fault"):
            call()
    # The block being written at the failure never becomes readable.
    assert ix.complete_store([b"writing"]) == 0
    assert ix.complete_store_one(b"writing") is False
    assert ix.lookup_one(b"writing") is False
    # The other writes change nothing and raise nothing (callers clean up through them).
    assert ix.remove(resident) == []
    assert ix.clear() == 0
    ix.unpin(resident)
    ix.touch(resident)
    ix.record_use(resident)
    assert ix.lookup_prefix(resident) == 0 and ix.stats()["failed"] == 1


def test_a_healthy_index_reports_no_failure():
    ix = kv.BlockIndex(4)
    assert ix.failure is None
    assert ix.stats()["failed"] == 0


def test_an_unknown_fault_kind_is_a_clear_error():
    with pytest.raises(kv.InvalidArgumentError, match="kind"):
        kv.BlockIndex(4)._inject_fault("segfault")


def test_the_data_path_keeps_serving_and_an_inflight_load_stays_byte_identical():
    gpu = torch.arange(10 * 256, dtype=torch.float32).reshape(10, 256)
    layout = BlockLayout.per_layer([gpu])
    host = kv.HostTier(kv.TierConfig(6 * 4096, layout.bytes_per_block))
    orch = TierOrchestrator(host, CpuTransferEngine(layout, host.pool))
    chain = keys("chain", 4)
    want = gpu[:4].clone()
    orch.offload(chain, [0, 1, 2, 3])
    orch.offload(keys("filler", 2), [4, 5])
    orch.drain()
    # A load in flight when the index fails: its pins hold, nothing is written any more, so
    # its copies still deliver the stored bytes. The store that panics evicts the fillers.
    orch.load(chain, [6, 7, 8, 9], request_id="before")
    host.index._inject_fault("store_panic")
    with pytest.raises(kv.IndexFailedError):
        host.index.prepare_store(keys("other", 2))
    (res,) = orch.drain()
    assert res.loaded == 4 and torch.equal(gpu[6:], want)
    # From now on: offloads are turned away and counted, plans miss, loads recompute.
    ticket = orch.offload(keys("next", 2), [0, 1])
    assert ticket.job_id is None and ticket.stored == [] and not ticket.no_space
    plan = orch.plan(chain)
    assert (plan.cpu_hits, plan.misses) == (0, 4)
    res = orch.load(chain, [], request_id="after")
    assert res.loaded == 0
    cpu = orch.stats()["tiers"]["cpu"]
    assert cpu["store_index_failed"] == 2
    assert cpu["index"]["failed"] == 1
    # ... and the scrape says the tier's index has failed.
    assert KvTierCollector(orch).snapshot()["kvtier_index_failed"] == {("cpu",): 1}


def make_failure_machine(policy: str):  # noqa: C901 - a state machine: one rule per operation
    """Random stores (some left open), pins, unpins, completions and lookups, with the store
    panic armed at a random point: it fires at the next store that evicts, whatever the
    index holds then. From the failure on, every operation must keep the closed contract, and
    no block may be readable again."""
    chain_keys = st.lists(st.integers(0, 23), min_size=1, max_size=4)

    class FailureMachine(RuleBasedStateMachine):
        @initialize(capacity=st.sampled_from([2, 4, 8]))
        def setup(self, capacity):
            self.ix = kv.BlockIndex(capacity, policy=policy)
            self.seen: set[int] = set()
            self.open: list[list[int]] = []  # prepared, not completed
            self.pins: list[list[int]] = []
            self.failed = False

        def _failed_now(self) -> bool:
            if self.ix.failure is not None and not self.failed:
                self.failed = True
                event("the index failed")
            return self.failed

        @rule(keys=chain_keys, leave_open=st.booleans(), ok=st.booleans())
        def store(self, keys, leave_open, ok):
            was_failed = self.failed
            try:
                out = self.ix.prepare_store(keys)
            except kv.NoSpaceError:
                assert not was_failed
                return
            except kv.IndexFailedError:
                assert self._failed_now(), "IndexFailedError from a healthy index"
                return
            assert not was_failed, "a failed index accepted a store"
            self.seen.update(keys)
            if leave_open:
                self.open.append(list(out.keys))
            else:
                self.ix.complete_store(out.keys, ok)

        @rule()
        def arm(self):
            self.ix._inject_fault("store_panic")

        @rule(data=st.data())
        def complete_open(self, data):
            if not self.open:
                return
            keys = self.open.pop(data.draw(st.integers(0, len(self.open) - 1)))
            done = self.ix.complete_store(keys, data.draw(st.booleans()))
            if self.failed:
                assert done == 0

        @rule(keys=chain_keys)
        def pin(self, keys):
            try:
                self.ix.pin_for_load(keys)
            except kv.NotReadyError:
                assert not self.failed
                return
            except kv.IndexFailedError:
                assert self._failed_now()
                return
            assert not self.failed
            self.pins.append(keys)

        @rule()
        def unpin(self):
            if self.pins:
                self.ix.unpin(self.pins.pop())  # never raises, failed or not

        @rule(keys=chain_keys)
        def touch_remove_clear(self, keys):
            self.ix.touch(keys)
            removed = self.ix.remove(keys)
            cleared = self.ix.clear() if keys[0] == 0 else 0
            if self.failed:
                assert removed == [] and cleared == 0

        @invariant()
        def closed_once_failed(self):
            if not hasattr(self, "ix") or not self._failed_now():
                return
            assert self.ix.stats()["failed"] == 1
            assert self.ix.entries() == []
            seen = sorted(self.seen)
            assert not any(self.ix.lookup_one(k) for k in seen)
            assert self.ix.lookup_prefix(seen) == 0
            assert self.ix.contains(seen) == [False] * len(seen)

    FailureMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
    return FailureMachine


TestFailureLru = make_failure_machine("lru").TestCase
TestFailureArc = make_failure_machine("arc").TestCase
TestFailurePriority = make_failure_machine("priority").TestCase
