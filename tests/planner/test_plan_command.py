"""`kvtier plan` and `kvtier trace synth` end to end: JSON schema, table, plots, recommendation,
and one-line errors with exit status 2."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvtier_rs.cli import main
from kvtier_rs.planner.files import replaced_atomically
from kvtier_rs.planner.synth import SynthConfig, synthesize, write_trace
from kvtier_rs.planner.traces import read_trace


@pytest.fixture(scope="module")
def synth_trace(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("synth") / "trace.jsonl"
    assert main(["trace", "synth", "--out", str(p), "--requests", "1500", "--seed", "3"]) == 0
    return p


def plan_json(capsys, *args) -> dict:
    assert main(["plan", *args, "--format", "json", "--no-progress"]) == 0
    return json.loads(capsys.readouterr().out)


def test_synth_is_deterministic_and_has_reuse(tmp_path):
    a = synthesize(SynthConfig(requests=300, seed=1))
    assert a == synthesize(SynthConfig(requests=300, seed=1))
    assert a != synthesize(SynthConfig(requests=300, seed=2))
    ids = [k for r in a for k in r["hash_ids"]]
    assert len(set(ids)) < len(ids)  # shared prompts, documents and sessions reuse blocks
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // 512) for r in a)
    unique = synthesize(SynthConfig(requests=300, mix={"unique": 1.0}))
    uids = [k for r in unique for k in r["hash_ids"]]
    assert len(set(uids)) == len(uids)
    write_trace(a, tmp_path / "x.jsonl.gz")
    assert (tmp_path / "x.jsonl.gz").stat().st_size > 0


def test_plan_json_schema(synth_trace, capsys, tmp_path):
    rep = plan_json(
        capsys,
        str(synth_trace),
        "--capacities",
        "50,400,100000",
        "--bytes-per-token",
        "131072",
        "--gpu",
        "50blocks",
        "--cpu",
        "2GiB",
        "--plot",
        str(tmp_path / "figs"),
    )
    assert rep["schema"] == "kvtier.plan/1"
    pols = {(r["policy"], r["capacity_blocks"]) for r in rep["results"]}
    assert pols == {(p, c) for p in ["fifo", "lru", "arc", "lhd", "opt"] for c in [50, 400, 100000]}
    for r in rep["results"] + [rep["ceiling"]]:
        assert {"policy", "capacity_blocks", "hit_rate", "hit_tokens", "total_tokens", "underfilled"} <= set(r)
    big = [r for r in rep["results"] if r["capacity_blocks"] == 100000]
    # Never full: it holds everything it was offered, so it hits what the infinite cache hits.
    assert all(r["underfilled"] and r["hit_tokens"] == rep["ceiling"]["hit_tokens"] for r in big)
    small = [r for r in rep["results"] if r["capacity_blocks"] == 50]
    assert all(not r["underfilled"] and r["hit_rate"] == r["hit_tokens"] / r["total_tokens"] for r in small)
    assert rep["ceiling"]["capacity_blocks"] is None
    # 2 GiB of 64 MiB blocks: 32 CPU blocks.
    assert [t["capacity_blocks"] for t in rep["tiers"]["tiers"]] == [50, 32]
    served = sum(t["served_tokens"] for t in rep["tiers"]["tiers"]) + rep["tiers"]["miss_tokens"]
    assert served == rep["tiers"]["total_tokens"]
    assert rep["recommendation"]["verdict"] in ("tier", "no_tiering")
    assert rep["recommendation"]["summary"]
    q = rep["questions"]
    assert 0 < q["admission"]["one_hit_block_fraction"] < 1
    assert q["shared_prefixes"]["top"] and q["reuse"]["time_s"]["p50"] >= 0
    for f in ["miss_ratio_curves.png", "reuse_time_histogram.png", "reuse_distance_histogram.png"]:
        assert (tmp_path / "figs" / f).read_bytes()[:4] == b"\x89PNG"


def test_plan_table_and_unique_workload_verdict(tmp_path, capsys):
    p = tmp_path / "u.jsonl"
    write_trace(synthesize(SynthConfig(requests=400, mix={"unique": 1.0})), p)
    assert main(["plan", str(p), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "Tiering will not pay" in out and "Which prefixes are shared" in out


def test_errors_are_one_line_with_status_2(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\n{"timestamp": 0, "hash_ids": [1]}\n')
    assert main(["plan", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.jsonl:2" in err and "'input_length'" in err
    assert main(["plan", str(bad), "--gpu", "40", "--no-progress"]) == 2
    assert "--gpu" in capsys.readouterr().err
    assert main(["plan", str(bad), "--skip-bad", "--warmup", "0", "--capacities", "1", "--no-progress"]) == 0
    assert "skipped 1 bad records" in capsys.readouterr().out


def test_console_script_help_documents_semantics():
    out = subprocess.run(
        [sys.executable, "-m", "kvtier_rs.cli", "plan", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for phrase in [
        "after the first miss",
        "--warmup",
        "leaves of the cached prefix tree",
        "Belady",
        "underfilled",
    ]:
        assert phrase in out


def cli_fails(capsys, *argv: str) -> str:
    """Run the `kvtier` entry point: it must exit with status 2 and a one-line error (argparse
    prints its usage above it), never a traceback. Returns the error line."""
    try:
        rc, from_argparse = main(list(argv)), False
    except SystemExit as e:  # argparse rejects an argument by exiting with status 2
        rc, from_argparse = e.code, True
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    lines = err.splitlines()
    assert from_argparse or len(lines) == 1, err
    return lines[-1]


@pytest.fixture
def tiny_trace(tmp_path) -> Path:
    p = tmp_path / "tiny.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]}\n')
    return p


@pytest.mark.parametrize(
    "args,words",
    [
        (["--capacities", "100000000000000000000"], ["--capacities", "1000000000000 (10^12)"]),
        (["--gpu", "100000000000000000000blocks"], ["--gpu", "at most 1000000000000 (10^12) blocks"]),
        (["--cpu", "99999999999999999999999TiB", "--bytes-per-token", "1"], ["--cpu", "is more than the maximum"]),
        (["--cpu", "1" + "0" * 400 + "GiB", "--bytes-per-token", "1"], ["--cpu", "is more than the maximum"]),
        (["--cpu", "1000TiB", "--bytes-per-token", "1", "--block-size", "1"], ["--cpu", "at most 1000000000000"]),
        (["--bytes-per-token", str(10**40), "--cpu", "1GiB"], ["--bytes-per-token", "(1 GiB)"]),
        (["--prefill-tps", "inf", "--bytes-per-token", "1000"], ["--prefill-tps", "positive finite"]),
        (["--threads", "-1"], ["--threads", "between 0 (every core) and 1024", "got -1"]),
        (["--top", "-1"], ["--top", "between 0 and 10000", "got -1"]),
    ],
)
def test_plan_out_of_range_options_are_one_line_errors(tiny_trace, capsys, args, words):
    err = cli_fails(capsys, "plan", str(tiny_trace), *args)
    assert err.startswith("kvtier plan: error: ")
    for w in words:
        assert w in err


@pytest.mark.parametrize(
    "args,words",
    [
        (["--rate", "nan"], ["argument --rate", "finite number > 0"]),
        (["--mix", "chat=nan"], ["--mix", "share of chat", "finite"]),
        (["--mix", "chat=inf"], ["--mix", "share of chat", "finite"]),
        (["--mix", "chat=1e308,rag=1e308"], ["--mix", "add up to a finite number"]),
        (["--zipf", "nan"], ["argument --zipf", "finite number >= 0 and <= 10"]),
        (["--zipf", "1000"], ["argument --zipf", "finite number >= 0 and <= 10"]),
        (["--mean-turns", "nan"], ["argument --mean-turns", "finite number >= 1"]),
        (["--mean-turns", "inf"], ["argument --mean-turns", "finite number >= 1"]),
        (["--think-time", "inf"], ["argument --think-time", "finite number > 0"]),
        (["--think-time", "nan"], ["argument --think-time", "finite number > 0"]),
    ],
)
def test_synth_non_finite_or_out_of_range_numbers_are_errors(tmp_path, capsys, args, words):
    out = tmp_path / "t.jsonl"
    err = cli_fails(capsys, "trace", "synth", "--out", str(out), "--requests", "50", *args)
    assert err.startswith("kvtier trace")
    for w in words:
        assert w in err
    assert not out.exists()


def test_status_says_whether_the_dir_is_missing_or_not_a_directory(tmp_path, capsys):
    missing = tmp_path / "nonexistent"
    assert cli_fails(capsys, "status", "--dir", str(missing)).endswith(f"--dir {missing}: no such directory")
    f = tmp_path / "file"
    f.write_text("")
    assert cli_fails(capsys, "status", "--dir", str(f)).endswith(f"--dir {f}: not a directory")


@pytest.fixture
def model_config(tmp_path) -> Path:
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}))
    return p


@pytest.mark.parametrize(
    "args,words",
    [
        (["--tier-policy", "bogus", "--cpu", "100blocks"], ["--tier-policy", "'bogus'", "lru"]),
        (["--tier-policy", "opt", "--cpu", "100blocks"], ["--tier-policy", "'opt'", "offline"]),
        (["--cpu-admission", "sometimes", "--cpu", "10blocks"], ["--cpu-admission", '"sometimes"']),
        (["--disk-admission", "uses:0", "--cpu", "10blocks", "--disk", "99blocks"], ["--disk-admission", "uses:0"]),
        (["--admission-thresholds", "2,300"], ["--admission-thresholds", "300", "1..=255"]),
        (["--admission-thresholds", "2,x"], ["--admission-thresholds", "'2,x'"]),
        (["--cpu", "1GiB"], ["--cpu", "needs --bytes-per-token or --model-config"]),
        (["--cpu", "1KiB", "--bytes-per-token", "131072"], ["--cpu", "smaller than one block"]),
        (["--gpu", "1MiB", "--bytes-per-token", "1024", "--block-size", "2048"], ["--gpu", "smaller than one block"]),
        (["--disk", "100blocks"], ["--disk", "needs --cpu"]),
        (["--remote", "100blocks"], ["--remote", "needs --cpu"]),
        (["--remote", "1GiB", "--cpu", "10blocks"], ["--remote", "needs --bytes-per-token or --model-config"]),
        (["--remote-gbps", "0"], ["--remote-gbps", "positive finite", "got 0.0"]),
        (["--remote-latency-ms", "-1"], ["--remote-latency-ms", ">= 0", "got -1.0"]),
        (["--remote-latency-ms", "nan"], ["--remote-latency-ms", ">= 0"]),
        (["--replicas", "0"], ["--replicas", "between 1 and 1024", "got 0"]),
        (["--replicas", "5000", "--cpu", "1blocks", "--remote", "1blocks"], ["--replicas", "between 1 and 1024"]),
        (["--replicas", "2", "--cpu", "10blocks"], ["--replicas", "needs --remote"]),
        (["--split", "sticky"], ["--split", "round-robin, session", "'sticky'"]),
        (["--kv-dtype", "fp8"], ["--kv-dtype", "needs --model-config"]),
        (["--bytes-per-token", "0", "--model-config", "CONFIG"], ["--bytes-per-token"]),
        (["--plot", "FILE/figs"], ["--plot", "not a directory"]),
        (["--limit", "0"], ["--limit", "positive"]),
        (["--warmup", "1"], ["--warmup", "[0, 1)"]),
        (["--policies", "lru,mru"], ["--policies", "'mru'"]),
    ],
)
def test_every_bad_option_is_refused_before_the_trace_is_read(tmp_path, model_config, capsys, args, words):
    """The trace path does not exist: an option checked only after reading the trace (or after
    a replay) would be reported as a missing trace instead of by its own name."""
    file = tmp_path / "file"
    file.write_text("")
    args = [a.replace("CONFIG", str(model_config)).replace("FILE", str(file)) for a in args]
    err = cli_fails(capsys, "plan", str(tmp_path / "missing.jsonl"), "--no-progress", *args)
    assert err.startswith("kvtier plan: error: " + words[0]), err
    for w in words[1:]:
        assert w in err, err
    assert "missing.jsonl" not in err


def test_underfilled_means_never_full_and_a_late_fill_is_flagged(tmp_path, capsys):
    """20 requests, each block used by two requests in a row (10 blocks). Capacity 3 fills at
    request 4, in the warm-up; capacity 7 at request 12, 3 of the 10 measured requests in: it
    did fill (not underfilled, its rate shown) but late; capacity 20 never fills."""
    recs = [{"timestamp": r, "input_length": 512, "hash_ids": [r // 2]} for r in range(20)]
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in recs))
    rep = plan_json(capsys, str(p), "--capacities", "3,7,20", "--policies", "lru,opt")
    by = {(r["policy"], r["capacity_blocks"]): r for r in rep["results"]}
    for pol in ("lru", "opt"):
        early, late, never = by[(pol, 3)], by[(pol, 7)], by[(pol, 20)]
        assert not late["underfilled"] and late["hit_rate"] == 0.5  # it filled: a real rate
        assert (early["underfilled"], early["filled_late"], early["unfilled_share"]) == (False, False, 0.0)
        assert (late["underfilled"], late["filled_late"], late["filled_at_request"]) == (False, True, 12)
        assert late["unfilled_share"] == pytest.approx(0.3)
        assert late["hit_rate"] == late["hit_tokens"] / late["total_tokens"] == 0.5
        assert (never["underfilled"], never["filled_late"], never["unfilled_share"]) == (True, False, 1.0)
        assert never["hit_rate"] == rep["ceiling"]["hit_rate"] == 0.5
    assert main(["plan", str(p), "--capacities", "3,7,20", "--policies", "lru", "--no-progress"]) == 0
    table = capsys.readouterr().out
    rows = {line.split()[0]: line for line in table.splitlines() if line.strip()[:2] in ("3 ", "7 ", "20")}
    assert rows["7"].rstrip().endswith("50.0%*") and rows["20"].rstrip().endswith("50.0%^"), table
    assert rows["3"].rstrip().endswith("0.0%"), table


def test_one_policy_and_one_set_of_numbers_across_the_plan(tmp_path, capsys):
    """On this trace arc has the most hit tokens over the sweep but s3fifo reaches the knee
    first: the admission sweep, the tier replay and the advice must still all use one policy,
    and quote the sweep's own rows for it."""
    p = tmp_path / "t.jsonl"
    write_trace(
        synthesize(SynthConfig(requests=600, seed=3, mix={"chat": 0.5, "rag": 0.3, "system": 0.1, "unique": 0.1})), p
    )
    caps = "37,73,147,294,587,1174"
    rep = plan_json(
        capsys, str(p), "--policies", "arc,s3fifo,opt", "--capacities", caps, "--gpu", "20blocks", "--cpu", "300blocks"
    )
    rec, q = rep["recommendation"], rep["questions"]
    policy = rec["policy"]
    assert policy in ("arc", "s3fifo")
    assert q["admission"]["policy"] == policy
    assert {t["policy"] for t in rep["tiers"]["tiers"]} == {policy}
    assert {e["policy"] for e in q["admission"]["threshold_effect"]} == {policy}
    by = {(r["policy"], r["capacity_blocks"]): r for r in rep["results"]}
    for e in q["admission"]["threshold_effect"]:
        assert e["hit_rate_always"] == by[(policy, e["capacity_blocks"])]["hit_rate"]
    row = by[(policy, rec["capacity_blocks"])]
    assert any(f"{policy} at {row['capacity_blocks']} blocks hits {row['hit_rate']:.1%}" in x for x in rec["reasons"])


def _knee_trace(tmp_path) -> Path:
    p = tmp_path / "knee.jsonl"
    write_trace(
        synthesize(SynthConfig(requests=600, seed=3, mix={"chat": 0.5, "rag": 0.3, "system": 0.1, "unique": 0.1})), p
    )
    return p


def test_no_knee_within_the_swept_range_is_said_plainly(tmp_path, capsys):
    """The curve is still rising at the largest swept capacity (20 blocks hit 14% of tokens, the
    ceiling 63%): there is no knee in range, so no size is recommended from it and the report
    says to sweep larger capacities."""
    rep = plan_json(capsys, str(_knee_trace(tmp_path)), "--policies", "lru,opt", "--capacities", "5,10,20")
    rec = rep["recommendation"]
    assert rec["capacity_blocks"] is None and rec["knee"] is None
    assert "no knee within the swept capacities (5 to 20 blocks)" in rec["summary"]
    assert any("--capacities 40,80,160" in x for x in rec["reasons"]), rec["reasons"]


def test_a_flat_stretch_below_the_ceiling_is_no_knee(tmp_path, capsys):
    """Only the shared first block hits at 2 to 8 blocks (a flat curve); the long chain comes
    back only after 20 other requests: the knee is beyond the sweep, not at its largest point."""
    chain = list(range(1, 32))
    recs = [{"timestamp": 0, "input_length": 32 * 16, "hash_ids": [0, *chain], "block_size": 16}]
    recs += [{"timestamp": 1 + i, "input_length": 32, "hash_ids": [0, 100 + i], "block_size": 16} for i in range(20)]
    recs.append({"timestamp": 30, "input_length": 32 * 16, "hash_ids": [0, *chain], "block_size": 16})
    p = tmp_path / "flat.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    rep = plan_json(capsys, str(p), "--policies", "lru", "--capacities", "2,4,8", "--warmup", "0")
    rates = [r["hit_rate"] for r in rep["results"]]
    assert rates[0] == rates[1] == rates[2] < 0.9 * rep["ceiling"]["hit_rate"]
    assert rep["recommendation"]["capacity_blocks"] is None
    assert "no knee within the swept capacities" in rep["recommendation"]["summary"]


def test_the_knee_is_the_first_capacity_near_the_ceiling_not_the_largest(tmp_path, capsys):
    p = str(_knee_trace(tmp_path))
    rep = plan_json(capsys, p, "--policies", "lru", "--capacities", "320,640,1280,2560")
    knee = rep["recommendation"]["knee"]
    assert (knee["capacity_blocks"], knee["at_smallest_swept"]) == (1280, False)
    assert rep["recommendation"]["capacity_blocks"] == 1280
    assert knee["hit_rate"] >= 0.9 * rep["ceiling"]["hit_rate"] > rep["results"][1]["hit_rate"]
    # Reached at the smallest swept capacity already: the knee may lie below it.
    rep = plan_json(capsys, p, "--policies", "lru", "--capacities", "1280,2560")
    knee = rep["recommendation"]["knee"]
    assert (knee["capacity_blocks"], knee["at_smallest_swept"]) == (1280, True)
    assert any("at or below 1280 blocks" in x for x in rep["recommendation"]["reasons"])


def _block_trace(tmp_path, name: str, reqs: list[tuple[list[int], int]]) -> Path:
    p = tmp_path / name
    rec = [{"timestamp": i, "input_length": n, "hash_ids": ids, "block_size": 4} for i, (ids, n) in enumerate(reqs)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rec))
    return p


def test_opt_is_labelled_a_bound_on_block_hits_only(tmp_path, capsys):
    """Belady keeps the blocks used soonest, which maximises block hits over the whole replay,
    and nothing else: FIFO at 3 blocks hits more tokens than opt here (a partial block weighs
    less), and after a warm-up FIFO hits more blocks in the measured window on the second
    trace. The report must label opt as the bound it is, and quote it in that metric."""
    reqs = [([1], 4), ([2], 1), ([3, 103], 5), ([2], 1), ([1], 1), ([3], 4), ([3, 103], 8), ([3], 1), ([1], 4)]
    args = [str(_block_trace(tmp_path, "t.jsonl", [*reqs, ([1, 101], 8), ([1], 4)]))]
    args += ["--policies", "fifo,opt", "--capacities", "3,6", "--warmup", "0"]
    rep = plan_json(capsys, *args)
    by = {(r["policy"], r["capacity_blocks"]): r for r in rep["results"]}
    fifo, opt = by[("fifo", 3)], by[("opt", 3)]
    assert fifo["hit_tokens"] > opt["hit_tokens"] and opt["all_hit_blocks"] >= fifo["all_hit_blocks"]
    assert rep["bounds"]["opt"] == {"metric": "all_block_hit_rate", "of": "every policy at the same capacity"}
    rec = rep["recommendation"]
    assert rec["policy"] == "fifo" and rec["capacity_blocks"] == 3
    assert [x for x in rec["reasons"] if x.startswith("opt")] == [
        f"opt (Belady) hits {opt['all_block_hit_rate']:.1%} of all block references over the whole replay at that "
        f"size, the most any eviction order can (fifo: {fifo['all_block_hit_rate']:.1%}); it bounds that, not the "
        "measured token-weighted rates"
    ]
    assert main(["plan", *args, "--no-progress"]) == 0
    assert "opt = Belady: the most block hits any eviction order gets at that capacity over the whole replay" in (
        capsys.readouterr().out
    )
    chains = [[2, 7], [1, 4], [1, 5, 16], [1, 4], [1], [2], [1, 5, 16], [1, 5], [1, 5, 16], [2, 8]]
    warm = _block_trace(tmp_path, "w.jsonl", [(c, 4 * len(c)) for c in chains])
    rep = plan_json(capsys, str(warm), "--policies", "fifo,opt", "--capacities", "4", "--warmup", "0.6")
    fifo, opt = rep["results"]
    assert fifo["hit_blocks"] > opt["hit_blocks"] and fifo["all_hit_blocks"] == opt["all_hit_blocks"]


def test_opt_is_left_out_and_said_on_a_trace_whose_ids_are_not_prefix_chained(tmp_path, capsys):
    """Block 0 starts one request and follows block 4 in others: there Belady is no bound (every
    online policy beats it at 2 blocks) and the core refuses it. The plan goes on without it and
    says why; asked for opt alone, it is a one-line error."""
    reqs = [([0], 4), ([2, 4, 0], 12), ([1, 4, 3], 12), ([4, 2], 8), ([3, 2, 0], 12)]
    trace = str(_block_trace(tmp_path, "unchained.jsonl", reqs))
    rep = plan_json(capsys, trace, "--policies", "lru,opt", "--capacities", "2,4", "--warmup", "0")
    assert {r["policy"] for r in rep["results"]} == {"lru"}
    (note,) = rep["trace"]["notes"]
    assert note.startswith("opt (Belady) left out: the block ids are not prefix-chained")
    assert main(["plan", trace, "--capacities", "2", "--no-progress"]) == 0  # the default policies
    assert f"note: {note}" in capsys.readouterr().out
    err = cli_fails(capsys, "plan", trace, "--policies", "opt", "--capacities", "2")
    assert "--policies: opt (Belady) is no bound on this trace" in err
    err = cli_fails(capsys, "plan", trace, "--policies", "opt,opt", "--capacities", "2")
    assert "--policies: opt (Belady) is no bound on this trace" in err, "a repeat of opt is opt"
    rep = plan_json(capsys, trace, "--policies", "lru,opt,opt", "--capacities", "2", "--warmup", "0")
    assert {r["policy"] for r in rep["results"]} == {"lru"}
    chained = plan_json(capsys, str(_block_trace(tmp_path, "chained.jsonl", [([1, 2], 8), ([1, 3], 8)])))
    assert "opt" in {r["policy"] for r in chained["results"]} and chained["trace"]["notes"] == []


def test_promotions_not_worth_loading_are_not_gains(tmp_path, capsys):
    """Disk reads at 0.5 GB/s take longer than recomputing a 64 MiB block: the orchestrator
    would recompute those disk hits, so the plan must not count them. With them set aside the
    CPU tier adds 1.1% of tokens behind a 100-block GPU cache: tiering does not pay."""
    from kvtier_rs._core import replay_tiers
    from kvtier_rs.orchestrator.cost import CostModel
    from kvtier_rs.planner.plan import build_trace
    from kvtier_rs.planner.traces import read_trace

    p = str(_knee_trace(tmp_path))
    tiers = ["--bytes-per-token", "131072", "--gpu", "100blocks", "--cpu", "110blocks", "--disk", "2000blocks"]
    fast = plan_json(capsys, p, *tiers)
    slow = plan_json(capsys, p, *tiers, "--disk-gbps", "0.5")
    assert fast["recommendation"]["verdict"] == "tier"
    assert slow["recommendation"]["verdict"] == "no_tiering"
    served = {t["name"]: t["served_tokens"] for t in slow["tiers"]["tiers"]}
    c = slow["cost"]
    assert served["disk"] > 0.1 * c["total_tokens"]
    assert (c["prefill_tokens_saved_by_lower_tiers"], c["not_worth_loading_tokens"]) == (served["cpu"], served["disk"])
    assert fast["cost"]["prefill_tokens_saved_by_lower_tiers"] == served["cpu"] + served["disk"]
    # The loads the TTFT estimate counts are the orchestrator's: CostModel per request and tier.
    cost = CostModel(10_000.0, 512, 131072 * 512, bandwidth={"cpu": 25e9, "disk": 0.5e9})
    specs = [("gpu", 100, "arc", "always"), ("cpu", 110, "arc", "always"), ("disk", 2000, "arc", "uses:2")]
    assert [t["policy"] for t in slow["tiers"]["tiers"]] == ["arc"] * 3
    mt = replay_tiers(build_trace(read_trace(p)), specs)
    load_s = sum(reqs * cost.load_seconds("cpu", blocks[1]) for blocks, reqs, _ in mt["served_histogram"] if blocks[1])
    assert c["transfer_s"] == pytest.approx(load_s)
    n, total = mt["measured_requests"], mt["total_tokens"]
    assert c["mean_ttft_tiered_s"] == pytest.approx(((total - served["gpu"] - served["cpu"]) / 10_000 + load_s) / n)


def test_sweep_gains_weigh_each_request_load_as_the_orchestrator_does(tmp_path, capsys):
    """A 50 us fixed cost per load job and a link a hair faster than recompute per block: one
    block alone is not worth loading, five or more are. The sweep's gains are the hits of the
    requests whose load the orchestrator's CostModel would take, and the knee goes by them."""
    from kvtier_rs._core import replay_sweep
    from kvtier_rs.orchestrator.cost import CostModel
    from kvtier_rs.planner.plan import build_trace
    from kvtier_rs.planner.traces import read_trace

    p = str(_knee_trace(tmp_path))
    gbps = 51200 / (0.0512 - 12e-6) / 1e9  # 100 bytes/token x 512 tokens per block
    rep = plan_json(capsys, p, "--policies", "lru", "--capacities", "160,1280", "--bytes-per-token", "100",
                    "--pcie-gbps", str(gbps))  # fmt: skip
    cpu = rep["questions"]["transfer"]["tiers"][0]
    assert cpu["name"] == "cpu" and not cpu["worth_loading"]  # one block alone
    cost = CostModel(10_000.0, 512, 51200, bandwidth={"cpu": gbps * 1e9, "disk": 6e9})
    assert not cost.worth_loading("cpu", 4) and cost.worth_loading("cpu", 5)
    trace = build_trace(read_trace(p))
    for row, want in zip(
        rep["results"], replay_sweep(trace, [("lru", 160, "always"), ("lru", 1280, "always")]), strict=True
    ):
        gain = sum(toks for n, _, toks in want["hit_histogram"] if cost.worth_loading("cpu", n))
        assert 0 < gain < row["hit_tokens"] == want["hit_tokens"]
        assert (row["gain_tokens"], row["gain_rate"]) == (gain, gain / row["total_tokens"])
    knee = rep["recommendation"]["knee"]
    assert knee["gain_rate"] >= 0.9 * rep["ceiling"]["gain_rate"]


def test_the_verdict_judges_the_tiers_asked_for_cpu_and_disk(tmp_path, capsys):
    """30 four-block prompts, sent three times round-robin: a block comes back 120 blocks
    later. A 1-block CPU tier alone saves nothing, so tiering as asked does not pay, whatever
    the sweep's knee (120 blocks) says; with a 2000-block disk tier behind it (admitting on
    the second use) the third round hits on disk, and the verdict must count the disk tier."""
    recs = [
        {"timestamp": r * 30 + i, "input_length": 2048, "hash_ids": [i * 10 + k for k in range(1, 5)]}
        for r in range(3)
        for i in range(30)
    ]
    p = tmp_path / "rounds.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in recs))
    common = [str(p), "--policies", "lru", "--capacities", "30,120,240", "--bytes-per-token", "131072"]
    rec = plan_json(capsys, *common, "--cpu", "1blocks")["recommendation"]
    assert rec["verdict"] == "no_tiering", rec["summary"]
    assert rec["summary"].startswith("Tiering will not pay with the tiers asked for: together they save only 0.0%")
    assert rec["knee"]["capacity_blocks"] == 120  # the sizing advice stays, among the reasons
    both = plan_json(capsys, *common, "--cpu", "1blocks", "--disk", "2000blocks", "--disk-admission", "uses:2")
    rec, mt = both["recommendation"], both["tiers"]
    saved = {t["name"]: t["saved_tokens"] / mt["total_tokens"] for t in mt["tiers"]}
    assert rec["verdict"] == "tier" and saved == {"cpu": 0.0, "disk": pytest.approx(2 / 3)}
    assert rec["summary"].startswith(f"Tier it as asked: the tiers save {saved['disk']:.1%} of prefill tokens")
    assert f"the DISK tier of 2000 blocks saves {saved['disk']:.1%} of tokens" in rec["summary"]
    assert "the CPU tier of 1 block saves 0.0% of tokens" in rec["summary"]
    # Only a GPU cache given: no lower tier to judge, so not "they add 0%" but the knee over it.
    rec = plan_json(capsys, *common, "--gpu", "1blocks")["recommendation"]
    assert rec["verdict"] == "tier", rec["summary"]
    assert "a CPU tier of 120 blocks" in rec["summary"] and "to the GPU cache's 0.0%" in rec["summary"]


@pytest.mark.parametrize("policy", ["fifo", "lru", "arc", "priority", "s3fifo"])
def test_a_policy_gets_the_same_numbers_from_the_sweep_and_the_tier_replay(tmp_path, capsys, policy):
    """A lone CPU tier is the sweep's single cache: the two paths (the sweep, with its indexed
    FIFO, and the tier replay, with the core's policies) must agree on every figure, hits and
    gains alike."""
    args = ["--policies", policy, "--tier-policy", policy, "--capacities", "300", "--cpu", "300blocks"]
    rep = plan_json(capsys, str(_knee_trace(tmp_path)), *args, "--bytes-per-token", "131072")
    (row,) = rep["results"]
    (cpu,) = rep["tiers"]["tiers"]
    assert (cpu["served_tokens"], cpu["saved_tokens"]) == (row["hit_tokens"], row["gain_tokens"])
    assert (cpu["underfilled"], cpu["filled_late"]) == (row["underfilled"], row["filled_late"])


def test_one_block_is_said_in_the_singular(tmp_path, capsys):
    """A knee at one block: the report reads "1 block", not "1 blocks"."""
    p = tmp_path / "one.jsonl"
    p.write_text("".join(json.dumps({"timestamp": i, "input_length": 600, "hash_ids": [7]}) + "\n" for i in range(50)))
    assert main(["plan", str(p), "--capacities", "1,2", "--policies", "lru", "--warmup", "0", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "a CPU tier of 1 block with policy lru" in out and "lru @ 1 block, admit" in out
    assert "1 blocks" not in out


@pytest.mark.parametrize(
    "args,words",
    [
        (["--rate", "1e-320"], ["--rate 1e-320", "timestamps", "float"]),
        (["--rate", "1e-306"], ["--rate 1e-306", "timestamps", "float"]),
    ],
)
def test_synth_arrivals_overflowing_time_are_a_one_line_error(tmp_path, capsys, args, words):
    """A tiny --rate (positive and finite, so accepted) made arrival times overflow a float:
    an OverflowError traceback from int(inf * 1000)."""
    out = tmp_path / "t.jsonl"
    err = cli_fails(capsys, "trace", "synth", "--out", str(out), "--requests", "50", "--mix", "chat=1", *args)
    for w in words:
        assert w in err
    assert not out.exists()


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_synth_that_fails_midway_leaves_no_half_written_trace(tmp_path, capsys, monkeypatch, name):
    """A write failing midway (a full disk: ENOSPC) left --out half-written, ending inside a
    record, and a trace already there destroyed. The trace is now written beside it and moved
    into place only once whole."""
    import errno

    import kvtier_rs.planner.synth as synth

    out = tmp_path / name
    assert main(["trace", "synth", "--out", str(out), "--requests", "20"]) == 0
    before = out.read_bytes()
    capsys.readouterr()
    real_dumps, calls = synth.json.dumps, []

    def dumps(obj, **kw):
        calls.append(1)
        if len(calls) > 30:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_dumps(obj, **kw)

    monkeypatch.setattr(synth.json, "dumps", dumps)
    err = cli_fails(capsys, "trace", "synth", "--out", str(out), "--requests", "100", "--seed", "5")
    assert "--out" in err and "No space left on device" in err
    assert out.read_bytes() == before, "the earlier trace is intact"
    assert sorted(p.name for p in tmp_path.iterdir()) == [name], "no temporary file left behind"
    monkeypatch.undo()
    fresh = tmp_path / "sub" / name
    assert main(["trace", "synth", "--out", str(fresh), "--requests", "30"]) == 0
    assert read_trace(fresh).n_requests == 30


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_synth_replaces_a_link_at_out_and_leaves_its_target_alone(tmp_path, name):
    """--out naming a symlink (planted, or left over): the trace replaces the link itself, and the
    file it pointed at is left as it was, content and mode (kvtier often runs as root)."""
    victim = tmp_path / "elsewhere" / "precious"
    victim.parent.mkdir()
    victim.write_text("not a trace\n")
    victim.chmod(0o640)
    link = tmp_path / name
    link.symlink_to(victim)
    assert main(["trace", "synth", "--out", str(link), "--requests", "20"]) == 0
    assert not link.is_symlink() and read_trace(link).n_requests == 20
    assert victim.read_text() == "not a trace\n" and stat.S_IMODE(victim.stat().st_mode) == 0o640


def test_synth_to_a_fifo_writes_in_place(tmp_path):
    """A stream at --out (a FIFO here, /dev/stdout's usual target) is written, not replaced."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    assert main(["trace", "synth", "--out", str(fifo), "--requests", "5"]) == 0
    reader.join(60)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and len(got[0].splitlines()) == 5


def test_a_figure_replaces_a_link_at_its_name(synth_trace, tmp_path):
    victim = tmp_path / "precious"
    victim.write_bytes(b"keep")
    d = tmp_path / "figs"
    d.mkdir()
    (d / "miss_ratio_curves.png").symlink_to(victim)
    assert main(["plan", str(synth_trace), "--plot", str(d), "--no-progress", "--capacities", "50"]) == 0
    fig = d / "miss_ratio_curves.png"
    assert not fig.is_symlink() and fig.read_bytes().startswith(b"\x89PNG")
    assert victim.read_bytes() == b"keep"


def test_an_output_temporary_swapped_for_a_link_is_not_written_through(tmp_path):
    """Someone who can write the output directory replaces the temporary by a link while the
    output is written: nothing reaches the link's target, since the temporary is only ever used
    through the descriptor it was created with, and the link is not renamed onto the output."""
    victim = tmp_path / "precious"
    victim.write_bytes(b"keep")
    victim.chmod(0o600)
    out = tmp_path / "out" / "report.bin"
    out.parent.mkdir()
    with pytest.raises(OSError, match="was replaced while it was written"), replaced_atomically(out) as f:
        (tmp,) = [p for p in out.parent.iterdir() if p.name.startswith(".report.bin.")]
        tmp.unlink()
        tmp.symlink_to(victim)
        f.write(b"the output")
    assert victim.read_bytes() == b"keep" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert not out.exists(), "the swapped-in link was renamed onto the output"


def test_a_figure_that_cannot_be_written_is_a_one_line_error(synth_trace, tmp_path, capsys):
    """check_plot_dir checks DIR, not the figures' own paths: a figure path taken by a directory
    (or a file that cannot be replaced) failed in fig.savefig after the whole replay, an
    IsADirectoryError traceback. Now it is one line naming --plot and the file."""
    d = tmp_path / "figs"
    (d / "miss_ratio_curves.png").mkdir(parents=True)
    err = cli_fails(capsys, "plan", str(synth_trace), "--plot", str(d), "--no-progress", "--capacities", "50")
    assert "--plot" in err and "miss_ratio_curves.png" in err


def test_status_refuses_an_empty_dir_instead_of_scanning_the_current_one(tmp_path, capsys, monkeypatch):
    """Path("") is ".": `kvtier status --dir ""` scanned the current directory."""
    monkeypatch.chdir(tmp_path)
    err = cli_fails(capsys, "status", "--dir", "")
    assert "--dir: empty path" in err and "./kvtier-disk.meta" not in err


@pytest.mark.parametrize(
    ("args", "words"), [(["--block-size", "2000000"], "--block-size: must be between 1 and 1048576")]
)
def test_synth_refuses_a_block_size_the_planner_cannot_read(tmp_path, capsys, args, words):
    out = tmp_path / "t.jsonl"
    err = cli_fails(capsys, "trace", "synth", "--out", str(out), "--requests", "5", *args)
    assert words in err and not out.exists()
