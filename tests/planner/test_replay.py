"""The Rust replay engine against the independent Python model (tests/support/planner_reference.py),
exact to the token, on slices of the shared traces and on random chained traces; plus the
properties theory gives (opt dominates online policies, the ceiling bounds all, monotone curves).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import planner_reference as ref  # noqa: E402
from support.traces import SHARED_TRACES as TRACES
from support.traces import needs_traces

from kvtier_rs._core import InvalidArgumentError, ReplayTrace, replay_sweep, replay_tiers
from kvtier_rs.planner.plan import build_trace
from kvtier_rs.planner.traces import read_trace


def requests_of(data):
    out = []
    for r in range(data.n_requests):
        a, b = data.offsets[r], data.offsets[r + 1]
        out.append((list(data.keys[a:b]), data.input_tokens[r]))
    return out


def rust(trace, policy, cap, *, warmup=0.5, mode="tree", admission="always"):
    return replay_sweep(trace, [(policy, cap, admission)], warmup=warmup, mode=mode)[0]


SLICES = [
    ("mooncake_conversation_trace.jsonl", 700, [40, 150, 600, 2000]),
    ("mooncake_synthetic_trace.jsonl", 350, [30, 120, 500, 1500]),
    ("weka_kvcachetester_trace_0001.json", None, [200, 800, 1500]),
    ("weka_kvcachetester_trace_0146.json", None, [50, 150]),
]


@needs_traces
@pytest.mark.parametrize("name,limit,caps", SLICES)
@pytest.mark.parametrize("mode", ["tree", "flat"])
def test_rust_equals_reference_on_shared_trace_slices(name, limit, caps, mode):
    data = read_trace(TRACES / name, limit=limit)
    reqs = requests_of(data)
    trace = build_trace(data)
    ceiling = rust(trace, "ceiling", 0, mode=mode)
    expected_ceiling = ref.replay(reqs, data.block_size, "ceiling", 0, mode=mode)
    assert ceiling["hit_tokens"] == expected_ceiling["hit_tokens"]
    for policy in ["fifo", "lru", "arc", "s3fifo", "lhd", "opt"]:
        for cap in caps:
            got = rust(trace, policy, cap, mode=mode)
            want = ref.replay(reqs, data.block_size, policy, cap, mode=mode)
            key = (policy, cap, mode)
            assert got["hit_tokens"] == want["hit_tokens"], key
            assert (got["hit_blocks"], got["total_tokens"]) == (want["hit_blocks"], want["total_tokens"]), key
            assert got["all_hit_blocks"] == want["all_hit_blocks"], key
            assert [tuple(e) for e in got["hit_histogram"]] == want["hit_histogram"], key
            assert (got["insertions"], got["evictions"]) == (want["insertions"], want["evictions"]), key
            assert (got["underfilled"], got["filled_at_request"]) == (want["underfilled"], want["filled_at_request"]), (
                key
            )
            assert got["hit_tokens"] <= ceiling["hit_tokens"], key


@needs_traces
def test_admission_threshold_equals_reference():
    data = read_trace(TRACES / "mooncake_conversation_trace.jsonl", limit=1000)
    reqs, trace = requests_of(data), build_trace(data)
    for policy in ["lru", "arc"]:
        for k in (2, 3):
            got = rust(trace, policy, 300, admission=f"uses:{k}")
            want = ref.replay(reqs, data.block_size, policy, 300, admit_after=k)
            assert (got["hit_tokens"], got["insertions"]) == (want["hit_tokens"], want["insertions"])


@needs_traces
def test_multitier_equals_reference():
    data = read_trace(TRACES / "mooncake_synthetic_trace.jsonl", limit=600)
    reqs, trace = requests_of(data), build_trace(data)
    tiers = [("gpu", 60, "lru", "always"), ("cpu", 400, "arc", "always"), ("disk", 3000, "lru", "uses:2")]
    got = replay_tiers(trace, tiers)
    want = ref.replay_tiers(reqs, data.block_size, [(n, c, p, 1 if a == "always" else 2) for n, c, p, a in tiers])
    assert {t["name"]: t["served_tokens"] for t in got["tiers"]} == want["served"]
    assert got["miss_tokens"] == want["miss_tokens"]
    assert got["total_tokens"] == want["total_tokens"]


@needs_traces
def test_multitier_split_across_replicas_equals_reference():
    data = read_trace(TRACES / "mooncake_conversation_trace.jsonl", limit=900)
    reqs, trace = requests_of(data), build_trace(data)
    tiers = [("cpu", 150, "lru", "always"), ("disk", 400, "arc", "uses:2"), ("remote", 1500, "lru", "always")]
    split = [r % 3 for r in range(len(reqs))]
    got = replay_tiers(trace, tiers, warmup=0.3, replicas=split, shared=["remote"])
    want = ref.replay_tiers(
        reqs,
        data.block_size,
        [(n, c, p, 1 if a == "always" else 2) for n, c, p, a in tiers],
        warmup=0.3,
        replicas=split,
        shared=("remote",),
    )
    assert {t["name"]: t["served_tokens"] for t in got["tiers"]} == want["served"]
    assert want["served"]["remote"] > 0  # the split leaves the shared tier something to serve
    assert (got["miss_tokens"], got["total_tokens"]) == (want["miss_tokens"], want["total_tokens"])


@needs_traces
def test_reuse_distance_equals_reference():
    data = read_trace(TRACES / "mooncake_synthetic_trace.jsonl", limit=150)
    a = build_trace(data).analyze()
    assert a["reuse_distance"] == ref.reuse_distances(requests_of(data))


@needs_traces
def test_properties_on_conversation_slice():
    data = read_trace(TRACES / "mooncake_conversation_trace.jsonl", limit=4000)
    trace = build_trace(data)
    caps = [50, 200, 800, 3000, 12000]
    jobs = [(p, c, "always") for p in ["fifo", "lru", "arc", "s3fifo", "opt"] for c in caps] + [
        ("ceiling", 0, "always")
    ]
    res = replay_sweep(trace, jobs)
    by = {(r["policy"], r["capacity_blocks"]): r for r in res}
    ceiling = res[-1]
    for c in caps:
        for p in ["fifo", "lru", "arc", "s3fifo"]:
            # Belady bounds block hits over the whole replay; not token-weighted hits, nor (after
            # a warm-up) the measured window's: see test_opt_is_labelled_a_bound_on_block_hits_only.
            assert by[(p, c)]["all_hit_blocks"] <= by[("opt", c)]["all_hit_blocks"], (p, c)
            assert by[(p, c)]["hit_tokens"] <= ceiling["hit_tokens"], (p, c)
        assert by[("opt", c)]["hit_tokens"] <= ceiling["hit_tokens"]
    opt = [by[("opt", c)]["all_hit_blocks"] for c in caps]  # a stack algorithm over the whole replay
    assert opt == sorted(opt)
    flat = [rust(trace, "lru", c, mode="flat")["hit_blocks"] for c in caps]
    assert flat == sorted(flat)


@st.composite
def chained_requests(draw):
    """Requests that continue a prefix of an earlier request (or start fresh) and add new
    blocks: every key keeps one parent, as in hash-chained traces. Partial last blocks vary."""
    n = draw(st.integers(1, 60))
    chains, nxt, out = [], 0, []
    for _ in range(n):
        if chains and draw(st.booleans()):
            base = draw(st.sampled_from(chains))
            chain = base[: draw(st.integers(0, len(base)))]
        else:
            chain = []
        for _ in range(draw(st.integers(0 if chain else 1, 4))):
            chain.append(nxt)
            nxt += 1
        chains.append(chain)
        tokens = (len(chain) - 1) * 4 + draw(st.integers(1, 4)) if chain else draw(st.integers(0, 3))
        out.append((chain, tokens))
    return out


def to_trace(reqs):
    offsets, keys = [0], []
    for chain, _ in reqs:
        keys += chain
        offsets.append(len(keys))
    return ReplayTrace(offsets, keys, [t for _, t in reqs], [float(i) for i in range(len(reqs))], 4)


@needs_traces
def test_hit_density_beats_lru_at_small_capacities_and_never_loses_at_large_ones():
    """The reason `lhd` exists, measured under the planner's rules (prefix tree, warm-up 0.5,
    token-weighted): on the conversation trace it closes about a quarter of the LRU -> opt gap
    at 2048 and 4096 blocks, and on every shared trace it is never more than 0.005 below LRU
    from 8192 to 65536 blocks (where the gap is small and a learned policy can only lose)."""
    for name in [s[0] for s in SLICES]:
        trace = build_trace(read_trace(TRACES / name))
        caps = [2048, 4096, 8192, 16384, 32768, 65536]
        jobs = [(p, c, "always") for p in ("lru", "lhd", "opt") for c in caps]
        rate = {
            (r["policy"], r["capacity_blocks"]): r["hit_tokens"] / r["total_tokens"] for r in replay_sweep(trace, jobs)
        }
        for c in caps[2:]:
            assert rate[("lhd", c)] >= rate[("lru", c)] - 0.005, (name, c)
        if name.startswith("mooncake_conversation"):
            for c in caps[:2]:
                gap = (rate[("lhd", c)] - rate[("lru", c)]) / (rate[("opt", c)] - rate[("lru", c)])
                assert gap >= 0.2, (c, gap)


@settings(max_examples=60, deadline=None)
@given(
    reqs=chained_requests(),
    cap=st.integers(1, 12),
    mode=st.sampled_from(["tree", "flat"]),
    warmup=st.sampled_from([0.0, 0.3]),
    admit=st.sampled_from([1, 2]),
)
def test_random_chained_traces_equal_reference(reqs, cap, mode, warmup, admit):
    trace = to_trace(reqs)
    adm = "always" if admit == 1 else f"uses:{admit}"
    policies = ["fifo", "lru", "arc", "s3fifo", "lhd", "opt"]
    res = replay_sweep(trace, [(p, cap, adm) for p in policies], warmup=warmup, mode=mode, threads=1)
    for p, got in zip(policies, res, strict=True):
        want = ref.replay(reqs, 4, p, cap, warmup=warmup, mode=mode, admit_after=admit)
        assert (got["hit_tokens"], got["hit_blocks"], got["insertions"], got["filled_at_request"]) == (
            want["hit_tokens"],
            want["hit_blocks"],
            want["insertions"],
            want["filled_at_request"],
        ), p
        assert got["underfilled"] == want["underfilled"], p
    if admit == 1:  # opt itself runs under the admission rule too; compared as the planner runs it
        opt = res[-1]["all_hit_blocks"]
        assert all(r["all_hit_blocks"] <= opt for r in res[:-1])


@pytest.mark.parametrize("side", ["rust", "reference"])
def test_fifo_by_hand_in_prefix_tree_mode(side):
    # Capacity 3, tree mode, chains applied tail first; the queue's front is the next victim.
    #   [1,2] -> queue 2, 1;  [3] -> 2, 1, 3 (full)
    #   [1,4]: hit 1; 2 goes; 4 extends the cached 1: just ahead of it -> 4, 1, 3 (1 not moved)
    #   [5,6]: 4 goes, then 1 (now a leaf) -> 3, 6, 5
    #   [1,7]: 1 misses; 3 goes, then 6 (5 is not a leaf)
    # One block hit (r2), victims 2, 4, 1, 3, 6. LRU keeps the reused 1: two hits, four victims.
    reqs = [([1, 2], 8), ([3], 4), ([1, 4], 8), ([5, 6], 8), ([1, 7], 8)]
    for policy, want in [("fifo", (1, 5)), ("lru", (2, 4))]:
        if side == "rust":
            got = rust(to_trace(reqs), policy, 3, warmup=0.0)
        else:
            got = ref.replay(reqs, 4, policy, 3, warmup=0.0)
        assert (got["all_hit_blocks"], got["evictions"]) == want, policy


def test_bad_arguments_name_the_argument():
    trace = to_trace([([1, 2], 8)])
    with pytest.raises(InvalidArgumentError, match="policy"):
        replay_sweep(trace, [("mru", 4, "always")])
    with pytest.raises(InvalidArgumentError, match="capacity"):
        replay_sweep(trace, [("lru", 0, "always")])
    with pytest.raises(InvalidArgumentError, match="warmup"):
        replay_sweep(trace, [("lru", 4, "always")], warmup=1.0)
    with pytest.raises(InvalidArgumentError, match="admission"):
        replay_sweep(trace, [("lru", 4, "sometimes")])
    with pytest.raises(InvalidArgumentError, match="hash_ids"):
        ReplayTrace([0, 3], [1, 2, 3], [5], [0.0], 4)


def test_opt_is_refused_on_a_trace_that_is_not_prefix_chained():
    # Block 0 starts r0 but follows 4 in r1 (ids that do not digest their prefix): at capacity 2
    # Belady hits nothing here while every online policy hits a block, so opt is no bound there.
    trace = to_trace([([0], 4), ([2, 4, 0], 12), ([1, 4, 3], 12), ([4, 2], 8), ([3, 2, 0], 12)])
    assert not trace.prefix_chained
    for mode in ("tree", "flat"):
        online = replay_sweep(trace, [(p, 2, "always") for p in ["fifo", "lru", "arc", "s3fifo"]], mode=mode)
        assert all(r["all_hit_blocks"] == 1 for r in online)
        with pytest.raises(InvalidArgumentError, match=r"prefix-chained.*block 0 starts request 0 but follows block 4"):
            replay_sweep(trace, [("lru", 2, "always"), ("opt", 2, "always")], mode=mode)
    assert to_trace([([1, 2], 8), ([1, 3], 8)]).prefix_chained


def test_replay_trace_refuses_timestamps_that_go_backwards():
    with pytest.raises(InvalidArgumentError, match=r"timestamps.*request 2: 1(\.0)? s is earlier than request 1's 3"):
        ReplayTrace([0, 1, 2, 3], [1, 1, 1], [4, 4, 4], [0.0, 3.0, 1.0], 4)
    # Negative timestamps are fine as long as they do not decrease: reuse times are differences.
    a = ReplayTrace([0, 1, 2], [1, 1], [4, 4], [-5.0, -2.0], 4).analyze()
    assert a["reuse_time_s"] == [3.0]
