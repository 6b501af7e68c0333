"""`kvtier plan` and `kvtier trace synth` end to end: JSON schema, table, plots, recommendation,
and one-line errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier_rs.cli import main
from kvtier_rs.planner.synth import SynthConfig, synthesize, write_trace


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
    assert pols == {(p, c) for p in ["fifo", "lru", "arc", "opt"] for c in [50, 400, 100000]}
    for r in rep["results"] + [rep["ceiling"]]:
        assert {"policy", "capacity_blocks", "hit_rate", "hit_tokens", "total_tokens", "underfilled"} <= set(r)
    big = [r for r in rep["results"] if r["capacity_blocks"] == 100000]
    assert all(r["underfilled"] and r["hit_rate"] is None for r in big)
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
