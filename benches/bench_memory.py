"""Memory per resident block: kvtier's index against the pure-Python manager with the same
semantics (benches/py_baseline_manager.py), each filled with N blocks of 36-byte keys (vLLM's
OffloadKey size) in 32-key chains, measured as the growth of this process's resident set.

kvtier copies each key into its own records, so the Python key objects are dropped after each
store; the Python manager keeps them (a dict holds its keys), which is part of its footprint.
Each measurement runs in a fresh child process, so one index's freed memory cannot be reused
by the next. Prints bytes per block and the ratio (Python / kvtier).

Usage: python benches/bench_memory.py [--blocks N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHAIN = 32
POLICIES = ("lru", "arc", "s3fifo", "priority", "lhd")

_CHILD = r"""
import os, sys
sys.path.insert(0, {benches!r})
from bench_manager import make_key
from py_baseline_manager import PyArcManager, PyLruManager
import kvtier_rs as kv

def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

impl, policy, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
before = rss()
if impl == "kvtier":
    mgr = kv.BlockIndex(n, policy=policy)
else:
    mgr = (PyArcManager if policy == "arc" else PyLruManager)(n)
for start in range(0, n, {chain}):
    chain = [make_key(i) for i in range(start, min(start + {chain}, n))]
    mgr.prepare_store(chain)
    mgr.complete_store(chain)
assert mgr.lookup_prefix([make_key(0)]) == 1
print(rss() - before)
"""


def measure(impl: str, policy: str, blocks: int) -> float:
    code = _CHILD.format(benches=str(Path(__file__).parent), chain=CHAIN)
    out = subprocess.run([sys.executable, "-c", code, impl, policy, str(blocks)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{impl}/{policy} failed:\n{out.stderr}")
    return int(out.stdout.strip()) / blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=2_000_000, help="resident blocks (default 2,000,000)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if args.blocks < CHAIN:
        ap.error(f"--blocks must be at least {CHAIN}")
    if not os.path.exists("/proc/self/statm"):
        raise SystemExit("bench_memory.py reads /proc/self/statm (Linux only)")
    rows = {}
    for policy in POLICIES:
        # The Python baseline has LRU and ARC; S3-FIFO, priority and hit density are compared with
        # its LRU (the cheaper of the two).
        base = "arc" if policy == "arc" else "lru"
        k = measure("kvtier", policy, args.blocks)
        p = measure("python", base, args.blocks)
        rows[policy] = {
            "kvtier_bytes_per_block": round(k, 1),
            "python_bytes_per_block": round(p, 1),
            "ratio": round(p / k, 2),
        }
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{args.blocks:,} resident blocks, 36-byte keys")
    print(f"{'policy':<9} {'kvtier B/block':>15} {'python B/block':>15} {'python/kvtier':>14}")
    for policy, r in rows.items():
        kb, pb = r["kvtier_bytes_per_block"], r["python_bytes_per_block"]
        print(f"{policy:<9} {kb:>15.1f} {pb:>15.1f} {r['ratio']:>13.2f}x")


if __name__ == "__main__":
    main()
