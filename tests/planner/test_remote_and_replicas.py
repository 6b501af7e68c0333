"""The remote tier and the K-replica replay, on small traces counted by hand: which tier serves
each block, when a remote hit counts as a recompute, and what a shared remote tier saves replicas
that each keep their own CPU tier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier_rs.cli import main
from kvtier_rs.planner.errors import PlanError
from kvtier_rs.planner.replicas import split
from kvtier_rs.planner.synth import SynthConfig, synthesize, write_trace
from kvtier_rs.planner.traces import read_trace

BS = 512  # Mooncake's block size: every request below is whole blocks of 512 tokens


def mooncake(tmp_path: Path, chains: list[list[int]]) -> Path:
    p = tmp_path / "t.jsonl"
    recs = [
        {"timestamp": i, "input_length": len(c) * BS, "output_length": 1, "hash_ids": c} for i, c in enumerate(chains)
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return p


def plan(capsys, path: Path, *args: str) -> dict:
    argv = ["plan", str(path), "--warmup", "0", "--policies", "lru", "--format", "json", "--no-progress", *args]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def served(side: dict) -> dict[str, int]:
    return {t["name"]: t["served_blocks"] for t in side["tiers"]}


def test_a_block_the_cpu_tier_lost_is_a_remote_promotion(tmp_path, capsys):
    # CPU tier of 1 block, LRU: r0 keeps only [1] (placing 2 would evict its own parent), r1
    # replaces it with [3]; the remote store (10 blocks) keeps everything, so r2 finds [1, 2]
    # there alone. No model bytes: every hit counts.
    p = mooncake(tmp_path, [[1, 2], [3], [1, 2]])
    rep = plan(capsys, p, "--cpu", "1blocks", "--remote", "10blocks")
    mt = rep["tiers"]
    assert served(mt) == {"cpu": 0, "remote": 2}
    remote = mt["tiers"][1]
    assert (remote["policy"], remote["admission"], remote["served_tokens"]) == ("lru", "always", 2 * BS)
    assert (mt["miss_blocks"], mt["miss_tokens"]) == (3, 3 * BS)
    assert rep["cost"]["remote_promoted_tokens"] == rep["cost"]["prefill_tokens_saved_by_lower_tiers"] == 2 * BS
    assert (rep["cost"]["recomputed_blocks"], rep["cost"]["recomputed_tokens"]) == (3, 3 * BS)
    assert rep["replicas"] is None


@pytest.mark.parametrize(("latency_ms", "worth"), [("0", True), ("1000", False)])
def test_a_remote_hit_slower_than_recompute_is_a_recompute(tmp_path, capsys, latency_ms, worth):
    # r2's two remote blocks load as one job: 1 KB/token, so 1 MB at 1.25 GB/s then PCIe, plus
    # the round trip, against 1024 tokens at 10k tokens/s = 102 ms of prefill. With a 1 s round
    # trip the load loses and the blocks are prefilled, as the orchestrator would decide.
    p = mooncake(tmp_path, [[1, 2], [3], [1, 2]])
    tiers = ("--cpu", "1blocks", "--remote", "10blocks")
    rep = plan(capsys, p, *tiers, "--bytes-per-token", "1000", "--remote-latency-ms", latency_ms)
    c = rep["cost"]
    assert c["latency_s"]["remote"] == float(latency_ms) / 1e3 and c["bandwidth_bytes_per_s"]["remote"] == 1.25e9
    assert c["remote_promoted_tokens"] == 2 * BS
    assert c["saved_tokens_by_tier"]["remote"] == (2 * BS if worth else 0)
    assert c["not_worth_loading_tokens"] == (0 if worth else 2 * BS)
    assert c["recomputed_blocks"] == (3 if worth else 5)
    assert rep["tiers"]["tiers"][1]["saved_tokens"] == (2 * BS if worth else 0)
    hop = {t["name"]: t for t in rep["questions"]["transfer"]["tiers"]}["remote"]
    assert hop["worth_loading"] is worth  # one block alone: the same verdict here


def test_a_prefix_computed_on_one_replica_is_a_remote_hit_on_the_other(tmp_path, capsys):
    # Round robin over replicas A (r0, r2) and B (r1, r3), each with its own 10-block CPU tier.
    # r1 on B finds [1, 2], computed by r0 on A, only in the shared remote store; r2 finds 1 in
    # A's tier, r3 [1, 2] in B's (stored there by r1). Without the remote store r1's two blocks
    # are prefilled: it saves 2 blocks. On one replica the CPU tier holds all of it.
    p = mooncake(tmp_path, [[1, 2], [1, 2], [1, 3], [1, 2, 4]])
    args = ("--cpu", "10blocks", "--remote", "10blocks", "--replicas", "2")
    rep = plan(capsys, p, *args)
    assert served(rep["tiers"]) == {"cpu": 5, "remote": 0}
    rp = rep["replicas"]
    assert (rp["replicas"], rp["split"], rp["requests_per_replica"]) == (2, "round-robin", [2, 2])
    assert served(rp["private"]) == {"cpu": 3}
    assert served(rp["with_remote"]) == {"cpu": 3, "remote": 2}
    assert (rp["private"]["recomputed_blocks"], rp["with_remote"]["recomputed_blocks"]) == (6, 4)
    saves = rp["remote_saves"]
    assert (saves["recomputed_blocks"], saves["recomputed_tokens"]) == (2, 2 * BS)
    assert saves["token_share"] == pytest.approx(2 / 9)
    assert saves["remote_served_tokens"] == saves["remote_saved_tokens"] == 2 * BS
    assert main(["plan", str(p), "--warmup", "0", "--policies", "lru", "--no-progress", *args]) == 0
    table = capsys.readouterr().out
    assert "2 replicas, round-robin split (2..2 requests each)" in table
    assert "the shared remote tier saves 2 block recomputes, 1024 prefill tokens" in table


def bailian(tmp_path: Path, rows: list[tuple[int, int, list[int]]]) -> Path:
    p = tmp_path / "b.jsonl"
    recs = [
        {"chat_id": c, "parent_chat_id": parent, "timestamp": i, "input_length": 16 * len(ids), "hash_ids": ids}
        for i, (c, parent, ids) in enumerate(rows)
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return p


def test_a_session_split_keeps_a_conversation_on_its_replica(tmp_path, capsys):
    # Conversation 10 (chats 10, 11) then conversation 20 (chats 20, 21). Round robin puts each
    # follow-up on the other replica, where only the remote store has its prefix (2 blocks
    # each); by session each follow-up finds its prefix in its own replica's CPU tier.
    p = bailian(tmp_path, [(10, -1, [1, 2]), (11, 10, [1, 2, 3]), (20, -1, [5, 6]), (21, 20, [5, 6, 7])])
    assert split(read_trace(p), 2, "session") == [0, 0, 1, 1]
    args = ("--cpu", "10blocks", "--remote", "10blocks", "--replicas", "2", "--split")
    rr = plan(capsys, p, *args, "round-robin")["replicas"]
    assert served(rr["with_remote"]) == {"cpu": 0, "remote": 4}
    assert rr["remote_saves"]["recomputed_blocks"] == 4
    by_session = plan(capsys, p, *args, "session")["replicas"]
    assert by_session["requests_per_replica"] == [2, 2]
    assert served(by_session["with_remote"]) == {"cpu": 4, "remote": 0}
    assert by_session["remote_saves"]["recomputed_blocks"] == 0


def test_sessions_follow_the_parent_chain_and_the_conversations(tmp_path):
    # Chat 12 continues 11, which continues 10: one conversation. Chat 31's parent is not in the
    # trace (it began earlier): the parent stands for its conversation, as for chat 32.
    p = bailian(tmp_path, [(10, -1, [1]), (11, 10, [2]), (31, 30, [3]), (12, 11, [4]), (32, 30, [5]), (40, -1, [6])])
    assert list(read_trace(p).sessions or []) == [10, 10, 30, 10, 30, 40]
    assert split(read_trace(p), 2, "session") == [0, 0, 1, 0, 1, 0]
    assert split(read_trace(p), 4, "round-robin") == [0, 1, 2, 3, 0, 1]
    conv = {"block_size": 4, "requests": [{"t": 0, "in": 4, "hash_ids": [1]}, {"t": 2, "in": 4, "hash_ids": [2]}]}
    t = tmp_path / "tester.json"
    t.write_text(json.dumps([conv, {**conv, "requests": [{"t": 1, "in": 4, "hash_ids": [1]}]}]))
    assert list(read_trace(t).sessions or []) == [0, 1, 0]  # merged in time order


def test_session_ids_of_mooncake_records_and_synthesized_chats(tmp_path):
    # A record without a session_id is a session of its own.
    p = tmp_path / "s.jsonl"
    recs = [{"timestamp": i, "input_length": BS, "hash_ids": [i]} for i in range(4)]
    recs[0]["session_id"] = recs[2]["session_id"] = 7
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert list(read_trace(p).sessions or []) == [7, -3, 7, -5]
    assert split(read_trace(p), 2, "session") == [0, 1, 0, 0]
    # kvtier trace synth numbers each chat: its turns share one session, other requests none.
    records = synthesize(SynthConfig(requests=400, seed=5, mix={"chat": 0.5, "unique": 0.5}))
    write_trace(records, tmp_path / "synth.jsonl")
    sessions = list(read_trace(tmp_path / "synth.jsonl").sessions or [])
    chats = {}
    for r, s in zip(records, sessions, strict=True):
        if "session_id" in r:
            assert s == r["session_id"]
            chats.setdefault(s, []).append(r["hash_ids"])
        else:
            assert s < 0
    # A later turn resends the earlier one: its first block is the same.
    assert any(len(turns) > 1 for turns in chats.values())
    assert all(len({t[0] for t in turns}) == 1 for turns in chats.values())


def test_a_session_split_of_a_trace_without_sessions_is_refused(tmp_path, capsys):
    p = mooncake(tmp_path, [[1, 2], [1, 2]])
    with pytest.raises(PlanError, match="--split session: this mooncake trace names no session"):
        split(read_trace(p), 2, "session")
    argv = ["plan", str(p), "--cpu", "4blocks", "--remote", "4blocks", "--replicas", "2", "--split", "session"]
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvtier plan: error: --split session:") and "use --split round-robin" in err
    assert len(err.splitlines()) == 1


def test_the_core_names_a_bad_split_or_shared_tier(tmp_path):
    from kvtier_rs._core import InvalidArgumentError, replay_tiers
    from kvtier_rs.planner.plan import build_trace

    trace = build_trace(read_trace(mooncake(tmp_path, [[1], [2], [1]])))
    cpu = [("cpu", 4, "lru", "always")]
    with pytest.raises(InvalidArgumentError, match=r"`replicas`: expected one replica per request \(3\), got 2"):
        replay_tiers(trace, cpu, replicas=[0, 1])
    with pytest.raises(InvalidArgumentError, match=r"`shared`: \"remote\" names no tier"):
        replay_tiers(trace, cpu, shared=["remote"])
    with pytest.raises(InvalidArgumentError, match="`replicas`: replica 1024 named; at most 1024 replicas"):
        replay_tiers(trace, cpu, replicas=[0, 1024, 0])
    assert replay_tiers(trace, cpu, replicas=[0, 1, 0])["tiers"][0]["served_blocks"] == 1
