"""Where an engine's time goes, measured in a way this VM's noise cannot move: a sampling profile
of the engine thread (py-spy, from outside the process, so every sample is unbiased by the GIL)
and the CPU time of kvtier's own native threads.

A wall-clock ratio of two runs scatters by 10-25% per repetition here; a share of samples within
one run does not, since a slower machine slows the numerator and the denominator alike.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Frames of vLLM's offloading connector (run only when offloading is on), except the attention
# computation that vLLM's per-layer connector decorator wraps.
CONNECTOR_MARKERS = ("kv_offload", "kv_transfer", "kv_connector", "KVConnector")
ATTENTION_COMPUTE = "unified_attention_with_output"


@dataclass
class Shares:
    samples: int
    kvtier_pct: float  # engine-thread samples inside kvtier_rs code
    connector_pct: float  # engine-thread samples in vLLM's connector hooks, outside kvtier
    native_threads_cpu_pct: float  # kvtier's native threads' CPU time, % of the wall time

    def line(self) -> str:
        return (
            f"kvtier {self.kvtier_pct:.2f}% + vLLM connector hooks {self.connector_pct:.2f}% of the engine "
            f"thread ({self.samples} samples); kvtier's native threads {self.native_threads_cpu_pct:.2f}% of a core"
        )


def _thread_cpu_seconds(prefix: str) -> float:
    """CPU seconds (user + system) used so far by this process's threads named `prefix`*."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            if not (task / "comm").read_text().startswith(prefix):
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
        except OSError:
            continue  # the thread ended meanwhile
    return total / tick


def profile(workload: Callable[[Callable[[], None]], None], rate: int = 250) -> Shares | None:
    """Run `workload(mark_end)` under py-spy and attribute the engine thread's samples.

    `workload` calls `mark_end()` once its timed part is over, before it tears anything down
    (kvtier's threads' CPU is read there). Returns None, and says why, when py-spy is missing
    or cannot attach.
    """
    spy = shutil.which("py-spy")
    if spy is None:
        print("attribution SKIPPED LOUDLY: py-spy is not installed (pip install py-spy)")
        return None
    out = Path(tempfile.mkdtemp(prefix="kvtier-attr-")) / "raw.txt"
    proc = subprocess.Popen(
        [spy, "record", "--pid", str(os.getpid()), "--rate", str(rate), "--format", "raw", "--output", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    time.sleep(1.0)  # let it attach
    cpu = {"start": _thread_cpu_seconds("kvtier-"), "t0": time.perf_counter()}

    def mark_end() -> None:
        cpu["end"] = _thread_cpu_seconds("kvtier-")
        cpu["t1"] = time.perf_counter()

    try:
        workload(mark_end)
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    if not out.exists():
        print(f"attribution SKIPPED LOUDLY: py-spy wrote nothing ({err.decode(errors='replace').strip()[-300:]})")
        return None
    samples = kvtier = connector = 0
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if "run_workload" not in stack:  # the engine thread while it serves requests
            continue
        n = int(count)
        samples += n
        if "kvtier_rs" in stack:
            kvtier += n
        elif ATTENTION_COMPUTE not in stack and any(m in stack for m in CONNECTOR_MARKERS):
            connector += n
    shutil.rmtree(out.parent, ignore_errors=True)
    if samples == 0:
        print("attribution SKIPPED LOUDLY: no engine-thread samples (py-spy could not read the process)")
        return None
    wall = cpu.get("t1", time.perf_counter()) - cpu["t0"]
    native = cpu.get("end", cpu["start"]) - cpu["start"]
    return Shares(samples, 100 * kvtier / samples, 100 * connector / samples, 100 * native / wall)
