"""Recency that kvtier's vLLM manager gives a finished request's chunks, against vLLM 0.32's own
CPU manager: a request's own stores are not reuse (ARC), and the replay follows the positions
the scheduler recorded for each key, per KV-cache group, so a prefix's head is evicted last.

Each scenario drives both managers the way vLLM's scheduler does (lookup, prepare_load,
complete_load, prepare_store, complete_store, on_request_finished) and checks what a later
store evicts: kvtier must evict what vLLM's own manager evicts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import pytest
from support.vllm import engine as E

E.require_vllm()

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    OffloadingManager,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402

from kvtier_rs import BlockIndex  # noqa: E402
from kvtier_rs.integrations.vllm.manager import KvtierOffloadingManager  # noqa: E402

Manager = Callable[[int, str], OffloadingManager]


def key(i: int, group: int = 0) -> bytes:
    """A vLLM-shaped OffloadKey: a 32-byte sha256 block hash plus a 4-byte group index."""
    return make_offload_key(hashlib.sha256(i.to_bytes(8, "little")).digest(), group)


def kvtier(n: int, policy: str) -> OffloadingManager:
    return KvtierOffloadingManager(BlockIndex(n, policy=policy))


def vllm_cpu(n: int, policy: str) -> OffloadingManager:
    return CPUOffloadingManager(n, cache_policy=policy)


def request(name: str, positions: dict[bytes, int] | None = None) -> ReqContext:
    """A request's context, with the end-token position the scheduler records for each key."""
    c = ReqContext(req_id=name)
    for k, end_token in (positions or {}).items():
        c.set_offload_key_position(k, end_token)
    return c


def load(mg: OffloadingManager, keys: Sequence[bytes], c: ReqContext) -> None:
    """Lookups that hit, then the load job, as the scheduler and the worker report it."""
    assert [mg.lookup(k, c) for k in keys] == [LookupResult.HIT] * len(keys)
    mg.prepare_load(keys, c)
    mg.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
    mg.complete_load(keys, c)


def store(mg: OffloadingManager, keys: Sequence[bytes], c: ReqContext) -> list[bytes]:
    """One store job of `keys` (all new); returns the keys it evicted."""
    out = mg.prepare_store(keys, c)
    assert out is not None and list(out.keys_to_store) == list(keys)
    mg.complete_store(out.keys_to_store, c)
    return list(out.evicted_keys)


def run_request(
    mg: OffloadingManager,
    name: str,
    *,
    loads: Sequence[bytes] = (),
    stores: Sequence[Sequence[bytes]] = (),
    positions: dict[bytes, int] | None = None,
) -> list[bytes]:
    """A whole request: its load, its store jobs in the order given, its end; returns the keys
    its stores evicted."""
    c = request(name, positions)
    mg.on_new_request(c)
    if loads:
        load(mg, loads, c)
    evicted = [k for batch in stores for k in store(mg, batch, c)]
    mg.on_request_finished(c)
    return evicted


def both(scenario: Callable[[Manager], list[bytes]]) -> list[bytes]:
    """What `scenario` evicts on kvtier's manager, checked to be what vLLM's own evicts."""
    expected = scenario(vllm_cpu)
    assert scenario(kvtier) == expected
    return expected


# ---- a request's own stores are not reuse (ARC) ----------------------------------------------


def test_arc_keeps_a_reused_chunk_over_chunks_stored_once():
    r, s1, s2, new = key(1), key(2), key(3), key(4)

    def scenario(make: Manager) -> list[bytes]:
        mg = make(3, "arc")
        run_request(mg, "a", stores=[[r]])
        run_request(mg, "b", loads=[r])  # a real reuse: r becomes frequent
        run_request(mg, "c", stores=[[s1, s2]])  # stored once: they stay recent-only
        evicted = run_request(mg, "d", stores=[[new]])
        c = request("probe")
        assert mg.lookup(r, c) is LookupResult.HIT
        return evicted

    # The tail of the chain stored once goes first, not the chunk another request reused.
    assert both(scenario) == [s2]


def test_arc_reading_back_its_own_store_is_not_reuse():
    q, r, new = key(1), key(2), key(3)

    def scenario(make: Manager) -> list[bytes]:
        mg = make(2, "arc")
        run_request(mg, "x", stores=[[q]])
        run_request(mg, "y", loads=[q])  # q is reused by another request
        # A request that stores r, is preempted, and loads r back when it resumes.
        c = request("a")
        mg.on_new_request(c)
        store(mg, [r], c)
        load(mg, [r], c)
        mg.on_request_finished(c)
        return run_request(mg, "d", stores=[[new]])

    assert both(scenario) == [r]


# ---- replay in prefix order, by recorded position and per group -----------------------------


K1, K2, K3 = key(1), key(2), key(3)


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize(
    "store_jobs",
    [
        # The tail's store comes first (a sliding-window backfill, a handoff), then the head's.
        [[K3], [K1, K2]],
        # One chunk a step, head first: the tail is the last inserted.
        [[K1], [K2], [K3]],
    ],
    ids=["tail-first", "chunk-per-step"],
)
def test_out_of_order_stores_keep_the_prefix_head_longest(policy, store_jobs):
    positions = {K1: 32, K2: 64, K3: 96}

    def scenario(make: Manager) -> list[bytes]:
        mg = make(3, policy)
        run_request(mg, "a", stores=store_jobs, positions=positions)
        return run_request(mg, "b", stores=[[key(10)]]) + run_request(mg, "c", stores=[[key(11)]])

    # Tail first, then the middle: the head, which every lookup of the prefix needs, stays.
    assert both(scenario) == [K3, K2]


# Two KV-cache groups of a two-chunk prefix, and the end-token position of each chunk.
G0 = [key(1, 0), key(2, 0)]
G1 = [key(1, 1), key(2, 1)]
GROUP_POSITIONS = {G0[0]: 32, G0[1]: 64, G1[0]: 32, G1[1]: 64}


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_hybrid_groups_keep_every_group_s_head_over_any_tail(policy):
    g0, g1, positions = G0, G1, GROUP_POSITIONS

    def scenario(make: Manager) -> list[bytes]:
        mg = make(4, policy)
        # vLLM offers a request's new chunks ordered by group: group 0's, then group 1's.
        run_request(mg, "a", stores=[g0 + g1], positions=positions)
        return run_request(mg, "b", stores=[[key(10), key(11)]])

    # Both tails go before either head: group 1's head outlives group 0's tail.
    assert both(scenario) == [g1[1], g0[1]]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_reused_chunks_of_hybrid_groups_rank_by_position(policy):
    g0, g1, positions = G0, G1, GROUP_POSITIONS

    def scenario(make: Manager) -> list[bytes]:
        mg = make(4, policy)
        run_request(mg, "a", stores=[g0 + g1], positions=positions)
        # Another request of the same prefix loads it all (prepare_load: by group, then chunk).
        run_request(mg, "b", loads=g0 + g1, positions=positions)
        return run_request(mg, "c", stores=[[key(10), key(11)]])

    assert both(scenario) == [g1[1], g0[1]]
