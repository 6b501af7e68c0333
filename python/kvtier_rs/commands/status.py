"""`kvtier status --dir ROOT`: what a disk tier directory holds, read-only.

Safe against a directory a serving process has open: the scan opens files read-only, takes no
lock and writes nothing (see rust/disk/status.rs). Whether a process holds the tier open is read
from /proc/locks (the tier's flock on its lock file) instead of by trying the lock, because even
a brief shared lock would make a tier starting at that moment fail with "directory locked".
"""

from __future__ import annotations

import argparse
import json
import os
import stat
from pathlib import Path

from kvtier_rs.planner.errors import PlanError

LOCK_NAME = "kvtier-disk.lock"  # rust/disk/slab.rs LOCK_NAME


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="show what a disk tier directory holds (read-only)",
        description="Scan a disk tier directory's slot headers and print what it holds: blocks, bytes, "
        "generations, damaged slots. Changes nothing; works while another process has the tier open.",
    )
    p.add_argument("--dir", required=True, dest="dir", metavar="ROOT", help="the disk tier directory")
    p.add_argument("--verify", action="store_true", help="also read and checksum every payload (slower)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run_status)


def lock_holder(root: Path) -> tuple[str, int | None]:
    """("open", pid) when a process holds the tier's flock, ("closed", None) when none does,
    ("unknown", None) when /proc/locks cannot tell (non-Linux, some sandboxes).

    A tier flocks both its directory and its lock file (rust/disk/slab.rs DirLock); either
    lock seen means open, so a deleted lock file does not hide an open tier."""
    inodes = set()
    for path in (root, root / LOCK_NAME):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        except OSError:
            return "unknown", None
        inodes.add(f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}")
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return "unknown", None
    for line in lines:
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (blocked waiters carry "->")
        parts = line.split()
        if "->" in parts or len(parts) < 6 or parts[1] != "FLOCK":
            continue
        if parts[5] in inodes:
            return "open", int(parts[4])
    return "closed", None


def run_status(args: argparse.Namespace) -> int:
    from kvtier_rs._core import disk_status

    if not args.dir:
        # Path("") is ".": an empty --dir would scan the current directory instead.
        raise PlanError("--dir: empty path; give the disk tier directory")
    root = Path(args.dir)
    try:
        mode = root.stat().st_mode
    except FileNotFoundError:
        raise PlanError(f"--dir {args.dir}: no such directory") from None
    except OSError as e:
        raise PlanError(f"--dir {args.dir}: cannot read: {e.strerror}") from None
    if not stat.S_ISDIR(mode):
        raise PlanError(f"--dir {args.dir}: not a directory")
    s = dict(disk_status(root, verify=args.verify))
    state, pid = lock_holder(root)
    s["open_by"] = {"state": state, "pid": pid}
    if args.json:
        print(json.dumps(s, sort_keys=True))
        return 0
    cap = s["capacity_blocks"]
    print(f"disk tier {s['path']}")
    held = f"open by pid {pid}" if state == "open" else ("not open" if state == "closed" else "unknown")
    print(f"  in use:          {held}")
    print(
        f"  geometry:        {s['num_files']} file(s) x {s['slots_per_file']} slots = {cap} slots "
        f"of {s['block_bytes']} B blocks (stride {s['slot_stride']} B)"
    )
    print(f"  blocks:          {s['blocks']} ({100.0 * s['blocks'] / cap:.1f}% of slots)")
    print(f"  bytes:           {s['bytes']} ({s['bytes'] / 2**20:.1f} MiB payload)")
    print(f"  free slots:      {s['free_slots']}")
    print(f"  damaged slots:   {s['damaged_slots']}" + ("  (payloads verified)" if s["verified_payloads"] else ""))
    print(f"  stale copies:    {s['stale_copies']}")
    if s["missing_slots"]:
        print(
            f"  missing slots:   {s['missing_slots']} (past the end of slab files shorter than the metadata says: "
            "truncated slabs or damaged metadata)"
        )
    print(f"  generations:     {s['min_generation']}..{s['max_generation']} (last written {s['last_generation']})")
    if state == "open" and s["damaged_slots"]:
        print("  note: the tier is open; a slot being written when scanned shows as damaged")
    return 0
