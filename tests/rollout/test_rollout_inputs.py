"""`kvtier rollout`'s bad inputs, each refused in one line naming it, before anything is sent
or started, and nothing written: no engine is needed for any of them."""

from __future__ import annotations

import json
import socket

import pytest
from support.rollout import model_list, write_reuse_trace

from kvtier_rs.cli import main


@pytest.fixture
def trace(tmp_path):
    return write_reuse_trace(tmp_path / "trace.jsonl")


def closed_port_url() -> str:
    """A loopback URL nothing listens on (the port was free a moment ago)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def rollout(capsys, tmp_path, *args: str) -> tuple[int, str]:
    out = tmp_path / "out"
    code = main(["rollout", "--out", str(out), *args])
    err = capsys.readouterr().err
    assert not out.exists(), "nothing may be written for a refused input"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")] == [], "no temporary left"
    return code, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_an_unreachable_endpoint_is_named(capsys, tmp_path, trace):
    url = closed_port_url()
    code, err = rollout(capsys, tmp_path, "--trace", str(trace), "--endpoint", url)
    assert code == 2
    line = one_line(err)
    assert line.startswith("kvtier rollout: error: --endpoint") and url in line and "cannot reach" in line, line


def test_a_model_the_endpoint_does_not_serve_is_named(capsys, tmp_path, trace):
    with model_list(["tiny"]) as url:
        code, err = rollout(capsys, tmp_path, "--trace", str(trace), "--endpoint", url, "--model", "llama-70b")
    assert code == 2
    line = one_line(err)
    assert "--model llama-70b" in line and "does not serve it" in line and "tiny" in line, line


def test_a_trace_that_does_not_parse_is_named_with_its_line(capsys, tmp_path, trace):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(trace.read_text() + '{"timestamp": 2000, "input_length": "many", "hash_ids": [1]}\n')
    with model_list(["tiny"]) as url:
        code, err = rollout(capsys, tmp_path, "--trace", str(bad), "--endpoint", url)
    assert code == 2
    line = one_line(err)
    assert f"{bad}:11" in line and "input_length" in line, line


def test_a_missing_trace_is_named(capsys, tmp_path):
    with model_list(["tiny"]) as url:
        code, err = rollout(capsys, tmp_path, "--trace", str(tmp_path / "nope.jsonl"), "--endpoint", url)
    assert code == 2
    assert "nope.jsonl: no such trace file" in one_line(err)


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--ttft-p99", "500"), ("--ttft-p99", "fast"), ("--itl-p99", "50 parsecs"), ("--itl-p99", "0ms")],
)
def test_a_budget_that_is_not_a_duration_is_named(capsys, tmp_path, trace, flag, value):
    # The endpoint is unreachable too: the budget is refused first, before any connection.
    code, err = rollout(capsys, tmp_path, "--trace", str(trace), "--endpoint", closed_port_url(), flag, value)
    assert code == 2
    line = one_line(err)
    assert line.startswith(f"kvtier rollout: error: {flag}:") and repr(value) in line, line


def test_budgets_with_units_are_read_as_seconds():
    from kvtier_rs.rollout.units import parse_duration

    assert parse_duration("500ms", "x") == pytest.approx(0.5)
    assert parse_duration("1.5s", "x") == pytest.approx(1.5)
    assert parse_duration("250us", "x") == pytest.approx(250e-6)
    assert parse_duration("2m", "x") == pytest.approx(120.0)


def test_an_existing_output_directory_is_kept_unless_overwrite(capsys, tmp_path, trace):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with model_list(["tiny"]) as url:
        code = main(["rollout", "--out", str(out), "--trace", str(trace), "--endpoint", url])
    assert code == 2
    assert "--overwrite" in one_line(capsys.readouterr().err)
    assert (out / "keep.txt").read_text() == "mine"


def test_a_bad_config_file_is_named(capsys, tmp_path, trace):
    cfg = tmp_path / "steps.json"
    cfg.write_text(json.dumps({"steps": [{"name": "cpu", "cpu": "lots"}]}))
    code, err = rollout(capsys, tmp_path, "--trace", str(trace), "--config", str(cfg))
    assert code == 2
    line = one_line(err)
    assert f"--config {cfg}: steps[0].cpu" in line, line


def test_a_step_config_with_a_bad_kvtier_key_is_refused_before_any_start(capsys, tmp_path, trace):
    cfg = tmp_path / "steps.json"
    steps = [{"name": "cpu", "cpu": "1GiB", "extra": {"eviction_policy": "random"}}]
    cfg.write_text(json.dumps({"launch": {"model": "/nonexistent/model"}, "steps": steps}))
    code, err = rollout(capsys, tmp_path, "--trace", str(trace), "--config", str(cfg))
    assert code == 2
    line = one_line(err)
    assert "steps[0]" in line and "eviction_policy" in line, line


def test_a_launched_server_that_dies_at_start_is_one_line_and_nothing_is_written(capsys, tmp_path, trace):
    """Launcher mode with a model that does not exist: `vllm serve` exits before it is ready
    (or, without vLLM installed, python cannot find it); the step is named, the server's log is
    pointed at, and the temporary output is removed."""
    code, err = rollout(
        capsys, tmp_path, "--trace", str(trace), "--launch", str(tmp_path / "no-model"), "--no-progress"
    )
    assert code == 2
    line = one_line(err)
    assert line.startswith("kvtier rollout: error: step baseline: vllm serve exited with status"), line
    # Why, from the server's log: vLLM cannot find the model, or python cannot find vLLM.
    assert ("no-model" in line and "Error: " in line) or "No module named" in line, line


def test_a_model_name_launched_servers_will_not_serve_is_refused_before_any_start(capsys, tmp_path, trace):
    code, err = rollout(
        capsys, tmp_path, "--trace", str(trace), "--launch", "/models/any", "--model", "llama", "--no-progress"
    )
    assert code == 2
    line = one_line(err)
    assert "--model llama" in line and "'model'" in line and "--served-model-name" in line, line


def test_endpoints_and_a_launch_together_are_refused(capsys, tmp_path, trace):
    code, err = rollout(
        capsys, tmp_path, "--trace", str(trace), "--endpoint", closed_port_url(), "--launch", "/models/any"
    )
    assert code == 2
    assert "give one of --endpoint, --launch, --config" in one_line(err)


def test_a_negative_seed_is_named(capsys, tmp_path, trace):
    with model_list(["tiny"]) as url:
        code, err = rollout(capsys, tmp_path, "--trace", str(trace), "--endpoint", url, "--seed", "-1")
    assert code == 2
    assert one_line(err) == "kvtier rollout: error: --seed: must be >= 0, got -1"
