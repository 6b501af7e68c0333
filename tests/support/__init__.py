"""Helpers shared by the tests (and by the benchmarks that drive the same setups): reference
models of the core, disk-tier fixtures, the planner's reference replay, a vLLM engine and
server harness, and a stand-in of TensorRT-LLM's executor. Importable as `support` because
pytest puts tests/ on the path (`pythonpath` in pyproject.toml)."""

from __future__ import annotations

import os
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent.parent


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) with tests/ first on PYTHONPATH, so that a
    child Python process (a killed writer, a vLLM server's workers) imports `support` too."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS_DIR), env.get("PYTHONPATH", "")) if p)
    return env
