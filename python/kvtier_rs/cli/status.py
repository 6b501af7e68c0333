"""`kvtier status --dir ROOT`: what a disk tier directory holds, read-only; `kvtier status
--remote URL`: what the shared remote store holds under a prefix (see
``tiers.remote.inventory``), and its nodes' memory.

ROOT is a tier directory (it holds the tier's metadata file), or a directory of them, such as
the disk root of kvtier's vLLM adapter, which makes one tier directory per model under it:
then each is reported, and those named by an earlier kvtier format (never read by this one)
are marked as such.

Safe against a directory a serving process has open: the scan opens files read-only, takes no
lock and writes nothing (see rust/disk/status.rs). Whether a process holds the tier open is read
from /proc/locks (the tier's flock on its lock file) instead of by trying the lock, because even
a brief shared lock would make a tier starting at that moment fail with "directory locked".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import stat
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier_rs.planner.errors import PlanError
from kvtier_rs.tiers.disk import earlier_format

if TYPE_CHECKING:
    from kvtier_rs.tiers.remote.inventory import Inventory

LOCK_NAME = "kvtier-disk.lock"  # rust/disk/slab.rs LOCK_NAME
META_NAME = "kvtier-disk.meta"  # rust/disk/slab.rs META_NAME: a directory holding it is a tier


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="show what a disk tier directory or the shared remote store holds (read-only)",
        description="Scan a disk tier directory's slot headers and print what it holds: blocks, bytes, "
        "generations, damaged slots; given a directory of tier directories, each of them. With --remote, "
        "scan the shared store (a Valkey/Redis Cluster) instead: blocks and bytes per namespace, and each "
        "node's memory. Changes nothing; works while other processes use the tier.",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--dir",
        dest="dir",
        metavar="ROOT",
        help="the disk tier directory, or a directory of them (such as the vLLM adapter's disk root)",
    )
    where.add_argument("--remote", metavar="URL", help="the remote tier's cluster: redis://host:port[,host:port...]")
    p.add_argument("--verify", action="store_true", help="also read and checksum every payload (slower; --dir only)")
    p.add_argument("--remote-prefix", default="kvtier", metavar="PREFIX", help="the key prefix (default kvtier)")
    p.add_argument(
        "--remote-password-env",
        metavar="VAR",
        # The literal, not client.DEFAULT_PASSWORD_ENV: importing the client (redis-py) here would
        # slow every kvtier command's start-up.
        help="environment variable holding the password (default KVTIER_REMOTE_PASSWORD)",
    )
    p.add_argument("--remote-password-file", metavar="PATH", help="file whose first line is the password")
    p.add_argument("--remote-tls-ca-file", metavar="PATH", help="CA bundle for a rediss:// URL")
    p.add_argument("--remote-timeout", type=float, default=5.0, metavar="S", help="seconds per operation (default 5)")
    p.add_argument("--format", choices=("text", "json"), default="text", help="text (default) or one JSON object")
    p.add_argument("--json", action="store_true", help="the same as --format json")
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


def _tier_dirs(root: Path) -> list[Path]:
    """The tier directories directly under `root`, by name."""
    try:
        entries = sorted(root.iterdir(), key=lambda p: p.name)
    except OSError as e:
        raise PlanError(f"--dir {root}: cannot read: {e.strerror}") from None
    return [p for p in entries if _is_tier(p)]


def _is_tier(path: Path) -> bool:
    try:
        return path.is_dir() and (path / META_NAME).exists()
    except OSError:  # a directory this user cannot enter: not one to report
        return False


def _scan(path: Path, verify: bool) -> dict:
    from kvtier_rs._core import disk_status

    s = dict(disk_status(path, verify=verify))
    state, pid = lock_holder(path)
    s["open_by"] = {"state": state, "pid": pid}
    return s


def run_status(args: argparse.Namespace) -> int:
    args.json = args.json or args.format == "json"
    if args.remote is not None:
        if args.verify:
            raise PlanError("--verify: only with --dir (a remote value is verified when it is read)")
        return run_remote_status(args)
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
    try:
        is_tier = (root / META_NAME).exists()
    except OSError as e:
        raise PlanError(f"--dir {args.dir}: cannot read: {e.strerror}") from None
    if not is_tier:
        tiers = _tier_dirs(root)
        if not tiers:
            raise PlanError(
                f"--dir {args.dir}: not a disk tier directory (no {META_NAME}), and no tier directory under it"
            )
        return _run_root(args, root, tiers)
    s = _scan(root, args.verify)
    if args.json:
        print(json.dumps(s, sort_keys=True))
        return 0
    _print_tier(s, earlier_format(root.name))
    return 0


def _run_root(args: argparse.Namespace, root: Path, tiers: list[Path]) -> int:
    """Report every tier directory under `root`; one that cannot be read is reported as such
    (the others still are) and makes the exit status 2."""
    from kvtier_rs._core import KvTierError

    reports: list[dict] = []
    for path in tiers:
        try:
            s = _scan(path, args.verify)
        except KvTierError as e:
            s = {"path": str(path), "error": str(e)}
        s["name"] = path.name
        s["earlier_format"] = earlier_format(path.name)
        reports.append(s)
    failed = sum("error" in s for s in reports)
    if args.json:
        print(json.dumps({"root": str(root), "tiers": reports}, sort_keys=True))
    else:
        earlier = [s["name"] for s in reports if s["earlier_format"]]
        print(f"disk root {root}: {len(reports)} tier director{'y' if len(reports) == 1 else 'ies'}")
        if earlier:
            print(f"  earlier format (never read by this kvtier; remove to free the space): {', '.join(earlier)}")
        for s in reports:
            print()
            if "error" in s:
                print(f"disk tier {s['path']}")
                print(f"  error:           {s['error']}")
            else:
                _print_tier(s, s["earlier_format"])
    if failed:
        print(f"kvtier status: error: {failed} of {len(reports)} tier directories could not be read", file=sys.stderr)
        return 2
    return 0


def _print_tier(s: dict, earlier: bool) -> None:
    state, pid = s["open_by"]["state"], s["open_by"]["pid"]
    cap = s["capacity_blocks"]
    print(f"disk tier {s['path']}")
    if earlier:
        print("  format:          earlier (a vLLM per-model directory of an earlier kvtier): never read by this kvtier")
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
    probe = s.get("engine_probe")
    if probe:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(probe["measured_unix"]))
        u, p = probe["io_uring"], probe["pool"]
        print(
            f"  engine (auto):   {probe['chosen']} for {probe['block_bytes']} B blocks at queue depth "
            f"{probe['queue_depth']}; write/read MiB/s io_uring {u['write_mib_s']:.0f}/{u['read_mib_s']:.0f}, "
            f"pool {p['write_mib_s']:.0f}/{p['read_mib_s']:.0f} (measured {when}, kernel {probe['kernel']})"
        )
    if state == "open" and s["damaged_slots"]:
        print("  note: the tier is open; a slot being written when scanned shows as damaged")


# ---- the remote store -------------------------------------------------------------------------


def run_remote_status(args: argparse.Namespace) -> int:
    """Scan the cluster at --remote. Bad input and an unreachable or refusing store are one-line
    errors (exit 2); a node failing mid-scan is reported with the rest, and exits 2 too."""
    import redis

    from kvtier_rs._core import InvalidArgumentError
    from kvtier_rs.tiers.remote import inventory
    from kvtier_rs.tiers.remote.client import connect, parse_url, read_password

    if not args.remote_prefix:
        raise PlanError("--remote-prefix: empty; give the prefix the tier writes under (default kvtier)")
    if not args.remote_timeout > 0:
        raise PlanError(f"--remote-timeout: must be > 0 seconds, got {args.remote_timeout}")
    endpoint = parse_url(args.remote, "--remote")
    try:
        password = read_password(args.remote_password_env, args.remote_password_file)
    except InvalidArgumentError as e:  # it names the setting; name the flag instead
        raise PlanError(f"--remote-password-file: {e.reason}") from None
    where = endpoint.describe()
    try:
        client = connect(
            endpoint, password=password, timeout_s=args.remote_timeout, tls_ca_file=args.remote_tls_ca_file
        )
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as e:
        raise PlanError(f"--remote {where}: cannot connect: {inventory.one_line(e)}") from None
    try:
        inv = inventory.scan(client, args.remote_prefix)
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as e:
        raise PlanError(f"--remote {where}: {inventory.one_line(e)}") from None
    finally:
        client.close()
    if args.json:
        print(json.dumps({"remote": where, **dataclasses.asdict(inv)}, sort_keys=True))
    else:
        _print_remote(where, inv)
    if inv.scan_errors:
        print(f"kvtier status: error: {len(inv.scan_errors)} node(s) could not be scanned", file=sys.stderr)
        return 2
    return 0


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _print_remote(where: str, inv: Inventory) -> None:
    blocks = sum(u.blocks for u in inv.namespaces)
    nbytes = sum(u.bytes for u in inv.namespaces)
    print(
        f"remote store {where}, prefix {inv.prefix!r}: {blocks} blocks, {_size(nbytes)} in {len(inv.namespaces)} "
        "namespace(s)"
    )
    if inv.namespaces:
        print(f"  {'namespace':<32} {'blocks':>10} {'value bytes':>14} {'server memory':>14}")
        for u in inv.namespaces:
            print(f"  {u.namespace:<32} {u.blocks:>10} {_size(u.bytes):>14} {_size(u.memory_bytes):>14}")
    if inv.other_keys:
        print(f"  other keys under the prefix (not kvtier blocks): {inv.other_keys}")
    for e in inv.scan_errors:
        print(f"  scan failed on {e}: the counts miss that node's keys")
    print(f"  {'node':<22} {'role':<8} {'used memory':>12} {'maxmemory':>12}  policy")
    for n in inv.nodes:
        if n.error:
            print(f"  {n.node:<22} {n.role:<8} error: {n.error}")
            continue
        limit = "none" if n.maxmemory == 0 else _size(n.maxmemory)
        print(f"  {n.node:<22} {n.role:<8} {_size(n.used_memory):>12} {limit:>12}  {n.maxmemory_policy or '-'}")
