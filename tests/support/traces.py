"""The real traces beside the project (../shared/traces) and the mark for tests that read them:
CI has them, so the skip only fires on a checkout without ../shared, and says so loudly."""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED_TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"

needs_traces = pytest.mark.skipif(
    not SHARED_TRACES.is_dir(), reason="SKIPPED LOUDLY: ../shared/traces is missing (CI has it)"
)
