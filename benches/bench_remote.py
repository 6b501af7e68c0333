"""The remote tier's store/load bandwidth and probe cost against redis-py's own cluster pipeline.

For each block size (default 2, 16 and 64 MiB) the tier stores a batch of `--batch` blocks from
host slots (`RemoteTier.submit_write`, then `wait_idle`) and loads them back into the slots
(`submit_read`); the baseline is redis-py's `RedisCluster` pipeline doing the same SET NX / GET of
values of the same size under keys of the same shape, with nothing around it: no copy out of the
slots, no sealing (the XXH3 check), no verification, no copy into the slots. The whole of that difference
is what kvtier costs. `redis-benchmark --cluster` runs as an extra reference row where it applies.

Same work on both sides: one batch is one tier job, which one worker thread runs as one pipeline
per 64 MiB of values (`tier.PIPELINE_BYTES`) one after the other; the baseline runs the batch on
one thread cut into the same pipelines, on one `RedisCluster` client (as the tier's workers share
one). The tier's other workers idle in both, so the thread and connection counts match.

Each figure is the best of `--reps` repetitions (the least disturbed run on a shared machine), or
of as many as move `--min-gib` GiB each way when that is more (a batch of 2 MiB blocks takes tens
of milliseconds, where one scheduler hiccup is a large share);
a repetition runs the tier and the baseline back to back, alternating which goes first. Every
store writes fresh keys (SET NX skips present ones, so a rewrite would measure nothing): the
keys of each run are deleted after it (UNLINK of its own keys, untimed; not FLUSHALL, so that
`--url` leaves other data on a cluster alone). The cluster this script starts has no
maxmemory: the server takes the 2 GiB a batch of 64 MiB blocks needs. Each size first checks
that about 4 batches' worth of memory is available (host pool, the tier's copies and sealed
values, the server's copy) and shrinks the batch, saying so, if not; a full default run peaks
at about 6.5 GiB in this process.

The probe's cost: `RemoteTier.probe` of N present keys and `wait_idle`, per key, against one raw
pipeline of N EXISTS.

    python benches/bench_remote.py                       # own 3-primary cluster on loopback
    python benches/bench_remote.py --sizes 2MiB --batch 8 --reps 2   # a short run
    python benches/bench_remote.py --url redis://host:port            # an existing cluster
                                        # (password from $KVTIER_REMOTE_PASSWORD, if set)

No timing is asserted; the table is for reading.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from redis.cluster import RedisCluster

from kvtier_rs._core import HostPool
from kvtier_rs.config import parse_bytes
from kvtier_rs.tiers.remote import RemoteOptions, RemoteTier, ValueFormat, namespace_digest, store_key
from kvtier_rs.tiers.remote.client import connect, parse_url, read_password
from kvtier_rs.tiers.remote.tier import PIPELINE_BYTES, _batches

MiB = 1 << 20
GiB = 1 << 30
PREFIX = "kvtier-bench"
TIMEOUT_S = 120.0  # socket and job deadline: a 64 MiB value on a busy 2-core box takes a while


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 40


class Run:
    """Fresh 36-byte block keys (vLLM's length) for each store, and the cleanup after it."""

    def __init__(self, client: RedisCluster, fmt: ValueFormat) -> None:
        self.client = client
        self.fmt = fmt
        self.serial = 0

    def keys(self, n: int) -> list[bytes]:
        self.serial += 1
        tag = os.getpid().to_bytes(4, "little") + self.serial.to_bytes(4, "little")
        return [tag + i.to_bytes(4, "little") + bytes(24) for i in range(n)]

    def store_keys(self, keys: list[bytes]) -> list[bytes]:
        return [store_key(PREFIX, self.fmt.namespace, k) for k in keys]

    def delete(self, keys: list[bytes]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for k in self.store_keys(keys):
            pipe.unlink(k)
        pipe.execute()


# ---- the tier and the raw pipeline ----------------------------------------------------------


def tier_store(tier: RemoteTier, pool: HostPool, keys: list[bytes]) -> float:
    tier.forget()
    t0 = time.perf_counter()
    ticket = tier.submit_write(keys, pool, list(range(len(keys))))
    tier.wait_idle()
    dt = time.perf_counter() - t0
    (r,) = tier.poll()
    if ticket.refused or not r.success or len(r.ok_keys) != len(keys):
        raise RuntimeError(f"tier store failed: {len(ticket.refused)} refused, {len(r.failed_keys)} failed")
    return dt


def tier_load(tier: RemoteTier, pool: HostPool, keys: list[bytes]) -> float:
    t0 = time.perf_counter()
    tier.submit_read(keys, pool, list(range(len(keys))))
    tier.wait_idle()
    dt = time.perf_counter() - t0
    (r,) = tier.poll()
    if not r.success:
        raise RuntimeError(f"tier load failed: {len(r.failed_keys)} blocks, stats {tier.stats()}")
    return dt


def raw_store(client: RedisCluster, skeys: list[bytes], values: list[bytes], block_bytes: int) -> float:
    """The tier's pipelines, without the tier: same grouping (`_batches` by the block's size, as
    the tier cuts them), same SET NX."""
    t0 = time.perf_counter()
    for lo, hi in _batches(len(values), block_bytes):
        pipe = client.pipeline(transaction=False)
        for k, v in zip(skeys[lo:hi], values[lo:hi], strict=True):
            pipe.set(k, v, nx=True)
        replies = pipe.execute(raise_on_error=True)
        if not all(r is True for r in replies):
            raise RuntimeError("raw store: a SET NX did not store (key present?)")
    return time.perf_counter() - t0


def raw_load(client: RedisCluster, skeys: list[bytes], block_bytes: int) -> float:
    t0 = time.perf_counter()
    got = 0
    for lo, hi in _batches(len(skeys), block_bytes):
        pipe = client.pipeline(transaction=False)
        for k in skeys[lo:hi]:
            pipe.get(k)
        got += sum(v is not None for v in pipe.execute(raise_on_error=True))
    dt = time.perf_counter() - t0
    if got != len(skeys):
        raise RuntimeError(f"raw load: {len(skeys) - got} values missing")
    return dt


def warm_up(tier: RemoteTier, client: RedisCluster, run: Run) -> None:
    """Connect both sides to every primary before timing: the tier makes its client on first use,
    and a first pipeline per node opens its connection."""
    skeys = run.store_keys(run.keys(64))  # 64 keys: every primary gets some
    tier.probe(run.keys(64))
    tier.wait_idle()
    pipe = client.pipeline(transaction=False)
    for k in skeys:
        pipe.exists(k)
    pipe.execute()
    tier.forget()


def reps_for(args: argparse.Namespace, batch_bytes: int) -> int:
    """`--reps`, or enough repetitions to move `--min-gib` GiB, whichever is more."""
    return max(args.reps, math.ceil(args.min_gib * GiB / batch_bytes))


def bandwidth(args: argparse.Namespace, client: RedisCluster, factory, fmt: ValueFormat, size: int) -> list[dict]:
    run = Run(client, fmt)
    batch = args.batch
    # Peak: the host pool, the tier's copies out of it and its sealed values (or the baseline's
    # values), and the server's copy: about 4 batches; keep 2 GiB spare for the rest of the box.
    need = 4 * batch * size + 2 * GiB
    if mem_available() < need:
        fit = max(1, (mem_available() - 2 * GiB) // (4 * size))
        log(f"{size // MiB} MiB: {mem_available() / GiB:.1f} GiB available, {need / GiB:.1f} needed; batch {fit}")
        batch = int(fit)
    pool = HostPool(batch * HostPool.stride_for(size), size)
    mem = np.frombuffer(memoryview(pool), dtype=np.uint8)
    mem[:] = np.random.default_rng(1).integers(0, 256, mem.size, dtype=np.uint8)
    tier = RemoteTier(
        factory,
        fmt,
        size,
        RemoteOptions(prefix=PREFIX, deadline_s=TIMEOUT_S, max_write_bytes=4 * batch * size, workers=args.workers),
    )
    warm_up(tier, client, run)
    seal_s = float("inf")
    best = {"store": [float("inf")] * 2, "load": [float("inf")] * 2}  # [tier, raw]
    try:
        for rep in range(reps_for(args, batch * size)):
            for side in (0, 1) if rep % 2 == 0 else (1, 0):
                keys = run.keys(batch)
                skeys = run.store_keys(keys)
                if side == 0:
                    ts = tier_store(tier, pool, keys)
                    tl = tier_load(tier, pool, keys)
                else:
                    # The same bytes the tier stores, made as the tier makes them (a copy out of
                    # the slot, then seal) but outside the store's timer: the raw client has
                    # nothing to seal. Timed apart: the part of the tier's store that is its own.
                    t0 = time.perf_counter()
                    view = memoryview(pool)
                    payloads = [bytes(view[pool.slot_offset(i) : pool.slot_offset(i) + size]) for i in range(batch)]
                    values = [fmt.seal(k, p) for k, p in zip(keys, payloads, strict=True)]
                    del payloads, view
                    seal_s = min(seal_s, time.perf_counter() - t0)
                    ts = raw_store(client, skeys, values, size)
                    del values
                    tl = raw_load(client, skeys, size)
                run.delete(keys)
                best["store"][side] = min(best["store"][side], ts)
                best["load"][side] = min(best["load"][side], tl)
                log(f"  {size // MiB} MiB rep {rep} {('tier', 'raw')[side]}: store {ts:.3f} s, load {tl:.3f} s")
    finally:
        tier.close()
        del mem, pool
    rows = []
    for op in ("store", "load"):
        t_tier, t_raw = best[op]
        rows.append(
            {
                "size_mib": size // MiB,
                "op": op,
                "batch": batch,
                "tier_gib_s": batch * size / t_tier / GiB,
                # Both in block payload bytes: the values both sides move are the same (each
                # carries ~110 B of header, key and check on top), so the ratio is of times.
                "raw_gib_s": batch * size / t_raw / GiB,
                "ratio": t_raw / t_tier,
                "pipelines_per_batch": len(_batches(batch, size)),
                "reps": reps_for(args, batch * size),
                "copy_seal_s": seal_s if op == "store" else None,
                "tier_s": t_tier,
                "raw_s": t_raw,
            }
        )
    return rows


def probe_cost(args: argparse.Namespace, client: RedisCluster, factory, fmt: ValueFormat, n: int) -> dict:
    run = Run(client, fmt)
    keys = run.keys(n)
    skeys = run.store_keys(keys)
    pipe = client.pipeline(transaction=False)
    for k in skeys:
        pipe.set(k, b"x")
    pipe.execute()
    tier = RemoteTier(factory, fmt, 4096, RemoteOptions(prefix=PREFIX, deadline_s=TIMEOUT_S, workers=args.workers))
    t_tier = t_raw = float("inf")
    try:
        for _ in range(max(args.reps, 5)):
            tier.forget()
            t0 = time.perf_counter()
            tier.probe(keys)
            tier.wait_idle()
            t_tier = min(t_tier, time.perf_counter() - t0)
            if sum(tier.contains(keys)) != n:
                raise RuntimeError("probe: not every key found")
            t0 = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for k in skeys:
                pipe.exists(k)
            found = pipe.execute()
            t_raw = min(t_raw, time.perf_counter() - t0)
            if sum(found) != n:
                raise RuntimeError("raw EXISTS: not every key found")
    finally:
        tier.close()
        run.delete(keys)
    return {"keys": n, "tier_us_per_key": t_tier / n * 1e6, "raw_us_per_key": t_raw / n * 1e6, "ratio": t_raw / t_tier}


# ---- redis-benchmark ----------------------------------------------------------------------


def redis_benchmark(host: str, port: int, password: str | None, size: int, batch: int) -> list[dict]:
    """`redis-benchmark --cluster` SET/GET of `size`-byte values, one client pipelining as many
    values as the tier's pipeline holds (at most `batch`). Its SETs overwrite one key per node
    (no -r), so the server holds one value per node; an overwrite also frees the old value."""
    exe = shutil.which("redis-benchmark") or shutil.which("valkey-benchmark")
    if exe is None:
        return [{"size_mib": size // MiB, "note": "redis-benchmark not installed"}]
    depth = max(1, min(batch, PIPELINE_BYTES // size))
    cmd = [exe, "--cluster", "-h", host, "-p", str(port), "-t", "set,get", "-d", str(size)]
    # A few pipelines' worth: with fewer, start-up and the first connection dominate its figure.
    cmd += ["-P", str(depth), "-c", "1", "-n", str(max(4 * depth, 8)), "--csv"]
    env = dict(os.environ)
    if password:
        env["REDISCLI_AUTH"] = password
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    rows = []
    for line in out.stdout.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if cells[0] in ("SET", "GET"):
            rps = float(cells[1])
            rows.append(
                {"size_mib": size // MiB, "op": "store" if cells[0] == "SET" else "load", "gib_s": rps * size / GiB}
            )
    if not rows:
        rows.append({"size_mib": size // MiB, "note": f"no result (rc {out.returncode}): {out.stderr.strip()[-200:]}"})
    return rows


# ---- main ---------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="an existing cluster (redis://host:port[,...]); default: start one on loopback")
    ap.add_argument("--sizes", default="2MiB,16MiB,64MiB", help="block sizes (default 2MiB,16MiB,64MiB)")
    ap.add_argument("--batch", type=int, default=32, help="blocks per batch (default 32)")
    ap.add_argument("--reps", type=int, default=2, help="repetitions; the best is reported (default 2)")
    ap.add_argument(
        # 2 GiB gave a 16 MiB batch 4 repetitions, and one busy moment on a shared 2-core machine
        # swung the best of 4 by 15%; 8 GiB gives 16 (the run takes a few minutes).
        "--min-gib",
        type=float,
        default=8.0,
        help="at least this many GiB moved per size and side (default 8)",
    )
    ap.add_argument("--workers", type=int, default=RemoteOptions.workers, help="the tier's worker threads")
    ap.add_argument("--probe-keys", default="64,1024", help="probe batch sizes (default 64,1024)")
    ap.add_argument("--no-redis-benchmark", action="store_true", help="skip the redis-benchmark row")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args()
    sizes = [parse_bytes(s, name="--sizes") for s in args.sizes.split(",")]

    cluster = None
    tmp = tempfile.TemporaryDirectory(prefix="kvtier-bench-remote-")
    try:
        if args.url:
            url, password = args.url, read_password(None, None)
        else:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
            from support.valkey import start_cluster

            cluster = start_cluster(Path(tmp.name))  # no maxmemory: the server takes what it is given
            url, password = cluster.url, None
            log(f"started a 3-primary cluster: {url}")
        endpoint = parse_url(url, "--url")

        def factory() -> RedisCluster:
            return connect(endpoint, password=password, timeout_s=TIMEOUT_S)

        client = factory()
        fmt = ValueFormat(namespace_digest(f"bench-remote/{os.getpid()}/{time.time()}"))
        rows = [r for s in sizes for r in bandwidth(args, client, factory, fmt, s)]
        probes = [probe_cost(args, client, factory, fmt, int(n)) for n in args.probe_keys.split(",")]
        refs: list[dict] = []
        if not args.no_redis_benchmark:
            host, port = endpoint.nodes[0]
            for s in sizes:
                refs += redis_benchmark(host, port, password, s, args.batch)
        info = client.info("server", target_nodes=RedisCluster.PRIMARIES)
        versions = sorted({v.get("redis_version", "?") for v in info.values()}) if isinstance(info, dict) else []
        client.close()
    finally:
        if cluster is not None:
            cluster.stop()
        tmp.cleanup()

    if args.json:
        print(json.dumps({"bandwidth": rows, "probe": probes, "redis_benchmark": refs, "server": versions}))
        return
    print(
        f"server {', '.join(versions)}; batch {args.batch}, best of {args.reps} or of enough to move "
        f"{args.min_gib:g} GiB, {args.workers} tier workers"
    )
    print(f"{'size':>6} {'op':<6} {'batch':>5} {'kvtier GiB/s':>13} {'raw GiB/s':>10} {'ratio':>6}  notes")
    for r in rows:
        note = f"{r['tier_s']:.3f} s vs {r['raw_s']:.3f} s a batch (best of {r['reps']})"
        note += f", {r['pipelines_per_batch']} pipeline(s)"
        if r["copy_seal_s"] is not None:
            note += f"; copy+seal alone {r['copy_seal_s']:.2f} s"
        if r["ratio"] < 0.8:
            note += "; below the 0.8x target"
        print(
            f"{r['size_mib']:>4}M  {r['op']:<6} {r['batch']:>5} {r['tier_gib_s']:>13.2f} {r['raw_gib_s']:>10.2f} "
            f"{r['ratio']:>5.2f}x  {note}"
        )
    for r in refs:
        if "note" in r:
            print(f"{r['size_mib']:>4}M  redis-benchmark: {r['note']}")
        else:
            print(f"{r['size_mib']:>4}M  {r['op']:<6} redis-benchmark --cluster, 1 client: {r['gib_s']:.2f} GiB/s")
    print(f"{'keys':>6} {'kvtier us/key':>14} {'raw EXISTS us/key':>18} {'ratio':>6}")
    for p in probes:
        print(f"{p['keys']:>6} {p['tier_us_per_key']:>14.2f} {p['raw_us_per_key']:>18.2f} {p['ratio']:>5.2f}x")


if __name__ == "__main__":
    main()
