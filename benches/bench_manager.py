"""kvtier's index through its Python API against a pure-Python manager with the same semantics
(benches/py_baseline_manager.py: dict + OrderedDict LRU, and ARC), on identical operation
sequences: uniform churn with eviction, and skewed (Zipf-like) reuse.

Reports microseconds per key for per-key calls and for batch calls, and kvtier's speedup.

Also the ceiling: the speedup that an implementation doing no work at all would reach, timed
as the same loops making the same number of calls to a builtin that returns at once (`bool`
per key, `len` per chain). It bounds what any native index can show against this baseline from
Python: the interpreter's loop and call costs are in both columns.
Usage: python benches/bench_manager.py [--json] [--ops N]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from py_baseline_manager import PyArcManager, PyLruManager  # noqa: E402

import kvtier_rs as kv  # noqa: E402

CAPACITY = 8192
BATCH = 32


def make_key(i: int) -> bytes:
    # 36 bytes, like vLLM's OffloadKey (32-byte digest + 4-byte group index).
    return i.to_bytes(8, "little") * 4 + b"\x00\x00\x00\x00"


def workloads(n_ops: int, seed: int = 7) -> dict[str, list[list[bytes]]]:
    """Chains of BATCH keys; each op is one request's chain."""
    rng = random.Random(seed)
    uniform = [[make_key(rng.randrange(8 * CAPACITY) * 1000 + j) for j in range(BATCH)] for _ in range(n_ops)]
    # Skewed: requests pick a conversation by a power law; chains share prefixes.
    skewed = []
    for _ in range(n_ops):
        conv = int(rng.paretovariate(1.1)) % (4 * CAPACITY // BATCH)
        skewed.append([make_key(conv * 1000 + j) for j in range(BATCH)])
    return {"uniform": uniform, "skewed": skewed}


def best_of(fn, *args, repeats: int = 3) -> float:
    """Fastest of `repeats` runs of fn(*args) (the least disturbed by other load)."""
    return min(fn(*args) for _ in range(repeats))


def run_lookup(mgr, chains, per_key: bool) -> float:
    t0 = time.perf_counter()
    if per_key:
        f = mgr.lookup_one
        for chain in chains:
            for k in chain:
                if not f(k):
                    break
    else:
        f = mgr.lookup_prefix
        for chain in chains:
            f(chain)
    return time.perf_counter() - t0


def run_store(factory, chains, per_key: bool) -> float:
    """Store-with-eviction: every chain stored, evicting as needed (after a fill)."""
    mgr = factory()
    t0 = time.perf_counter()
    if per_key:
        if isinstance(mgr, kv.BlockIndex):
            prep, done = mgr.prepare_store_one, mgr.complete_store_one
            for chain in chains:
                for k in chain:
                    prep(k)
                    done(k)
        else:
            prep, done = mgr.prepare_store, mgr.complete_store
            for chain in chains:
                for k in chain:
                    prep((k,))
                    done((k,))
    else:
        prep, done = mgr.prepare_store, mgr.complete_store
        for chain in chains:
            prep(chain)
            done(chain)
    return time.perf_counter() - t0


def run_floor(chains, per_key: bool, calls_per_key: int) -> float:
    """The loop of run_lookup / run_store around builtins that do nothing (`chains` already cut
    to the keys the real run examines, so the calls match one for one)."""
    t0 = time.perf_counter()
    if per_key:
        f = bool  # true for every key: the loop never breaks early
        for chain in chains:
            for k in chain:
                if calls_per_key == 2:
                    f(k)
                if not f(k):
                    break
    else:
        g = len
        for chain in chains:
            if calls_per_key == 2:
                g(chain)
            g(chain)
    return time.perf_counter() - t0


def examined(mgr, chains) -> list[list[bytes]]:
    """Each chain cut to the keys a per-key prefix walk calls lookup on (hits + the miss)."""
    return [c[: min(mgr.lookup_prefix(c) + 1, len(c))] for c in chains]


def filled(factory, chains):
    mgr = factory()
    for chain in chains:
        mgr.prepare_store(chain)
        mgr.complete_store(chain)
    return mgr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object with the speedups")
    ap.add_argument("--ops", type=int, default=3000, help="requests per workload (default 3000)")
    args = ap.parse_args()
    loads = workloads(args.ops)
    impls = {
        "lru": (lambda: kv.BlockIndex(CAPACITY, policy="lru"), lambda: PyLruManager(CAPACITY)),
        "arc": (lambda: kv.BlockIndex(CAPACITY, policy="arc"), lambda: PyArcManager(CAPACITY)),
    }
    rows = []
    for policy, (kv_factory, py_factory) in impls.items():
        for wl, chains in loads.items():
            n_keys = sum(len(c) for c in chains)
            for per_key in (True, False):
                mode = "per_key" if per_key else "batch"
                kvm, pym = filled(kv_factory, chains), filled(py_factory, chains)
                walked = examined(kvm, chains) if per_key else chains
                t_kv = best_of(run_lookup, kvm, chains, per_key)
                t_py = best_of(run_lookup, pym, chains, per_key)
                t_floor = best_of(run_floor, walked, per_key, 1)
                rows.append(("lookup", mode, policy, wl, t_kv / n_keys * 1e6, t_py / n_keys * 1e6, t_py / t_floor))
                t_kv = best_of(run_store, kv_factory, chains, per_key)
                t_py = best_of(run_store, py_factory, chains, per_key)
                t_floor = best_of(run_floor, chains, per_key, 2)
                rows.append(("store_evict", mode, policy, wl, t_kv / n_keys * 1e6, t_py / n_keys * 1e6, t_py / t_floor))

    def geomean(op: str, mode: str, ratio) -> float:
        # Geometric mean over policies and workloads.
        ratios = [ratio(row) for row in rows if row[0] == op and row[1] == mode]
        prod = 1.0
        for r in ratios:
            prod *= r
        return prod ** (1 / len(ratios))

    summary = {}
    for op, mode in (("lookup", "per_key"), ("lookup", "batch"), ("store_evict", "per_key"), ("store_evict", "batch")):
        summary[f"{op}_{mode}_speedup"] = round(geomean(op, mode, lambda r: r[5] / r[4]), 2)
    for op, mode in (("lookup", "per_key"), ("lookup", "batch"), ("store_evict", "per_key"), ("store_evict", "batch")):
        summary[f"{op}_{mode}_ceiling"] = round(geomean(op, mode, lambda r: r[6]), 1)
    if args.json:
        print(json.dumps(summary))
        return
    print(
        f"{'op':<12} {'mode':<8} {'policy':<6} {'workload':<8} "
        f"{'kvtier us/key':>14} {'python us/key':>14} {'speedup':>8} {'ceiling':>8}"
    )
    for op, mode, pol, wl, k, py, ceiling in rows:
        print(f"{op:<12} {mode:<8} {pol:<6} {wl:<8} {k:>14.3f} {py:>14.3f} {py / k:>7.1f}x {ceiling:>7.1f}x")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
