"""Hit rate of each eviction policy, replaying the Mooncake traces through the live index.

Every request does what an engine does with a CPU tier: look up its chain (hits are the ready
prefix), touch the hit blocks, and offer the whole chain for storing (present blocks are
skipped; the chain is inserted tail-first). The hit rate is the fraction of block references
served from the tier (prefix-contiguous). The planner (`kvtier plan`) answers the sizing
question with token weighting, warm-up and the Belady optimum; this bench checks the live
index's policies side by side, with the same code that serves requests.

Usage: python benches/bench_policies.py [--json] [--traces DIR] [--capacities 250,1000,4000,16000]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import kvtier_rs as kv

TRACES = ["mooncake_conversation_trace.jsonl", "mooncake_synthetic_trace.jsonl"]
POLICIES = ["fifo", "lru", "arc", "s3fifo", "priority", "lhd"]


def load_chains(path: Path) -> list[list[int]]:
    chains = []
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                chains.append([int(h) for h in json.loads(line)["hash_ids"]])
            except (ValueError, KeyError, TypeError) as e:
                raise SystemExit(f"{path}:{line_no}: bad record ({e})") from None
    return chains


def replay(chains: list[list[int]], policy: str, capacity: int) -> float:
    ix = kv.BlockIndex(capacity, policy=policy)
    hits = total = 0
    for chain in chains:
        chain = chain[:capacity]
        n = ix.lookup_prefix(chain)
        hits += n
        total += len(chain)
        if n:
            ix.touch(chain[:n])
        out = ix.prepare_store(chain)
        ix.complete_store(out.keys)
    return hits / total if total else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--traces", type=Path, default=Path(__file__).resolve().parents[1].parent / "shared" / "traces")
    ap.add_argument("--capacities", default="250,1000,4000,16000")
    args = ap.parse_args()
    caps = [int(c) for c in args.capacities.split(",")]
    results: dict = {}
    for name in TRACES:
        path = args.traces / name
        if not path.exists():
            raise SystemExit(f"trace not found: {path} (pass --traces DIR)")
        chains = load_chains(path)
        results[name] = {p: {c: round(replay(chains, p, c), 4) for c in caps} for p in POLICIES}
    if args.json:
        print(json.dumps(results))
        return
    for name, by_policy in results.items():
        print(f"\n{name}: block hit rate by capacity (blocks)")
        print(f"{'policy':<10}" + "".join(f"{c:>10}" for c in caps))
        for p, row in by_policy.items():
            print(f"{p:<10}" + "".join(f"{row[c]:>10.4f}" for c in caps))
        lru = by_policy["lru"]
        for p in ("s3fifo", "lhd"):
            print(f"{p} - lru:".ljust(10) + "".join(f"{by_policy[p][c] - lru[c]:>+10.4f}" for c in caps))


if __name__ == "__main__":
    main()
