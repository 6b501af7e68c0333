"""benches/policy_bounds.py replays the planner's rules in plain Python to measure bounds the
planner has no policy for; its numbers are only worth something while its own LRU and opt equal
the planner's. The script checks that itself and fails on a difference: run it on a slice of the
shared trace, at capacities where every policy differs."""

from __future__ import annotations

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
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:1] in (["60"], ["300"])]
    assert [r[0] for r in rows] == ["60", "300"]
    for r in rows:
        lru, opt = map(float, r[1:3])
        assert lru < opt


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
