"""benches/policy_bounds.py replays the planner's rules in plain Python to measure bounds the
planner has no policy for; its numbers are only worth something while its own LRU and opt equal
the planner's. The script checks that itself and fails on a difference: run it on a slice of the
shared trace, at capacities where every policy differs."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from support.traces import SHARED_TRACES, needs_traces

ROOT = Path(__file__).resolve().parents[2]
TRACE = SHARED_TRACES / "mooncake_conversation_trace.jsonl"


@needs_traces
def test_bounds_replay_matches_the_planners_lru_and_opt_on_a_trace_slice(tmp_path):
    lines = TRACE.read_text().splitlines()[:800]
    sliced = tmp_path / "slice.jsonl"
    sliced.write_text("\n".join(lines) + "\n")
    out = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "policy_bounds.py"), "--trace", str(sliced), "--capacities", "60,300"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    header = next(line.split() for line in out.stdout.splitlines() if line.split()[:1] == ["capacity"])
    assert header[3:] == ["lhd", "oracle", "lastgap", "second", "alive", "odds", "density"]
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:1] in (["60"], ["300"])]
    assert [r[0] for r in rows] == ["60", "300"]
    for r in rows:
        lru, opt = map(float, r[1:3])
        assert lru < opt
        shares = [float(cell.rstrip("%")) for cell in r[3::2]]
        rates = [float(cell.strip("()")) for cell in r[4::2]]
        assert len(rates) == 7 and all(0.0 <= v <= 1.0 for v in rates), r
        for share, v in zip(shares, rates, strict=True):  # the share is of the LRU -> opt gap
            assert abs(share - 100 * (v - lru) / (opt - lru)) < 0.05 + 100 * 1e-4 / (opt - lru), r


def test_bounds_refuses_a_missing_trace(tmp_path):
    missing = tmp_path / "nope.jsonl"
    out = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "policy_bounds.py"), "--trace", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "trace not found" in out.stderr and "nope.jsonl" in out.stderr


def _load_bounds_module():
    spec = importlib.util.spec_from_file_location("policy_bounds", ROOT / "benches" / "policy_bounds.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_request_continues_the_last_user_of_its_deepest_seen_block_below_the_first():
    bounds = _load_bounds_module()
    requests = [
        ([0, 1, 2], 1500),
        ([0, 1, 2, 3], 2000),  # extends the first request: its second turn
        ([0, 5], 1000),  # shares only the first block: a new conversation
        ([0, 1, 2, 3, 4], 2500),  # extends the second request: third turn
        ([0, 5, 6], 1500),  # extends the third request: second turn
    ]
    assert bounds.conversation_turns(requests) == [1, 2, 1, 3, 2]


def test_each_age_bucket_starts_where_the_one_before_ends():
    bounds = _load_bounds_module()
    for b in range(1, bounds.AGE_BUCKETS):
        start = bounds.bucket_start(b)
        assert bounds.age_bucket(start) == b and bounds.age_bucket(start - 1) == b - 1, b
