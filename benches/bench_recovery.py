"""How fast a disk tier comes back after a restart: reopen time for N slots (default 100k),
against the cheapest possible header scan in Python (one pread per slot header, no parsing), on
the same files in the same run.

Usage: python benches/bench_recovery.py [--slots 100000] [--block-bytes 4096] [--dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

import kvtier_rs as kv
from kvtier_rs._core import DiskTier

HEADER = 4096


def drop_caches() -> bool:
    """Cold-cache numbers need root; say so when they are warm."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def fill(path: str, slots: int, block: int) -> None:
    pool = kv.HostPool(1024 * -(-block // 4096) * 4096, block)
    mem = np.frombuffer(pool, dtype=np.uint8)
    with DiskTier(path, slots * (block + HEADER) * 2, block, admission="always") as tier:
        for start in range(0, slots, 1024):
            keys = list(range(start, min(slots, start + 1024)))
            mem[:] = start % 251
            tier.wait(tier.submit_write(keys, pool, list(range(len(keys)))).job_id)
        assert len(tier) == slots, (len(tier), slots)


def naive_scan(path: str, stride: int) -> int:
    """Read every slot's header page with os.pread: the floor for any header-scanning recovery."""
    n = 0
    for f in sorted(Path(path).glob("slab-*")):
        fd = os.open(f, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            for off in range(stride - HEADER, size, stride):
                n += bool(os.pread(fd, HEADER, off)[:8].strip(b"\0"))
        finally:
            os.close(fd)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=100_000)
    ap.add_argument("--block-bytes", type=int, default=4096)
    ap.add_argument("--dir", default=None, help="parent directory for the tier (default: a temp dir)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="kvtier-recovery-", dir=args.dir)
    try:
        fill(root, args.slots, args.block_bytes)
        cold = drop_caches()
        t0 = time.perf_counter()
        with DiskTier(root, args.slots * (args.block_bytes + HEADER) * 2, args.block_bytes) as tier:
            reopen = time.perf_counter() - t0
            recovered, stride = len(tier), tier.slot_stride
        drop_caches()
        t0 = time.perf_counter()
        found = naive_scan(root, stride)
        naive = time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = {
        "slots": args.slots,
        "recovered": recovered,
        "reopen_s": round(reopen, 3),
        "naive_header_scan_s": round(naive, 3),
        "naive_found": found,
        "speedup_vs_naive_scan": round(naive / reopen, 2),
        "cold_cache": cold,
    }
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>24}: {v}")


if __name__ == "__main__":
    main()
