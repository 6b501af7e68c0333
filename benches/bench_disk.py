"""Disk-tier bandwidth against fio and against a one-file-per-block store, in one run.

For each block size (256 KiB .. 8 MiB) and each I/O engine that works here, the tier writes
`--total-mib` of blocks sequentially, reads them back sequentially and in random order, then
rewrites them at random disk slots. fio runs the same patterns on a file in the same
directory with the same block size, queue depth and O_DIRECT (io_uring engine against fio's
io_uring, the thread pool against fio's psync with one thread per queue slot). The baseline
store writes each block to a temporary file and renames it into place (the layout vLLM's file
tier uses) and reads whole files back, with the page cache dropped before reads.

    python benches/bench_disk.py            # table
    python benches/bench_disk.py --json     # one JSON object (ratios at 2 MiB)

Installs fio with apt-get when it is missing (Debian's package).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from kvtier_rs._core import DiskTier, HostPool, InvalidArgumentError, io_uring_probe
from kvtier_rs.config import parse_bytes

MiB = 1 << 20
KiB = 1 << 10


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ensure_fio() -> str | None:
    fio = shutil.which("fio")
    if fio:
        return fio
    log("fio not found: installing Debian's fio package with apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (
        ["apt-get", "install", "-y", "-qq", "fio"],
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "fio"],
    ):
        subprocess.run(cmd, env=env, capture_output=True, check=False)
        if shutil.which("fio"):
            break
    fio = shutil.which("fio")
    if not fio:
        log("could not install fio; fio columns will be empty")
    return fio


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# ---- the tier -----------------------------------------------------------------------------


def bench_tier(directory: str, engine: str, bs: int, total: int, qd: int) -> dict[str, float]:
    n = max(total // bs, 2 * qd)
    stride = -(-bs // 4096) * 4096 + 4096
    path = os.path.join(directory, f"tier-{engine}-{bs}")
    shutil.rmtree(path, ignore_errors=True)
    # Two batches of qd blocks in flight, each batch in its own half of the pool.
    pool = HostPool(2 * qd * (-(-bs // 4096) * 4096), bs)
    mem = np.frombuffer(pool, dtype=np.uint8)
    mem[:] = np.random.default_rng(1).integers(0, 256, mem.size, dtype=np.uint8)
    out: dict[str, float] = {}
    with DiskTier(path, n * stride, bs, engine=engine, queue_depth=qd, admission="always", num_files=1) as tier:
        if tier.io_mode != "direct":
            log(f"note: {engine} runs buffered here: {tier.notes}")

        def run(keys: list[int], write: bool) -> float:
            t0 = time.perf_counter()
            pending: list[int] = []
            for b, start in enumerate(range(0, len(keys), qd)):
                batch = keys[start : start + qd]
                half = (b % 2) * qd
                slots = list(range(half, half + len(batch)))
                if len(pending) == 2:
                    res = tier.wait(pending.pop(0))
                    assert res.success, res
                if write:
                    t = tier.submit_write(batch, pool, slots)
                    assert len(t.keys) == len(batch), t
                    pending.append(t.job_id)
                else:
                    pending.append(tier.submit_read(batch, pool, slots))
            for j in pending:
                res = tier.wait(j)
                assert res.success, res
            return len(keys) * bs / (time.perf_counter() - t0)

        keys = list(range(n))
        out["seq_write"] = run(keys, True)
        out["seq_read"] = run(keys, False)
        shuffled = keys[:]
        random.Random(2).shuffle(shuffled)
        out["rand_read"] = run(shuffled, False)
        # Free the slots in random order, then write new keys: they land at random offsets.
        tier.remove(shuffled)
        out["rand_write"] = run([k + n for k in keys], True)
        out["engine"] = tier.engine
        out["io_mode"] = tier.io_mode
    shutil.rmtree(path, ignore_errors=True)
    return out


# ---- fio ----------------------------------------------------------------------------------


def bench_fio(fio: str, directory: str, engine: str, bs: int, total: int, qd: int) -> dict[str, float]:
    n = max(total // bs, 2 * qd)
    size = n * bs
    fname = os.path.join(directory, f"fio-{bs}.dat")
    if engine == "io_uring":
        io_args = ["--ioengine=io_uring", f"--iodepth={qd}", "--numjobs=1"]
    else:
        io_args = [
            "--ioengine=psync",
            "--iodepth=1",
            f"--numjobs={qd}",
            "--thread",
            f"--offset_increment={size // qd // bs * bs}",
        ]
    out: dict[str, float] = {}
    for name, rw in (
        ("seq_write", "write"),
        ("seq_read", "read"),
        ("rand_read", "randread"),
        ("rand_write", "randwrite"),
    ):
        job_size = size if engine == "io_uring" else size // qd // bs * bs
        cmd = [
            fio, "--name=kvtier", f"--filename={fname}", f"--rw={rw}", f"--bs={bs}", f"--size={job_size}",
            "--direct=1", "--group_reporting", "--output-format=json", "--randrepeat=1", "--norandommap",
            *io_args,
        ]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            log(f"fio {rw} failed: {r.stderr.strip()[-300:]}")
            out[name] = float("nan")
            continue
        job = json.loads(r.stdout[r.stdout.index("{") :])["jobs"][0]
        side = "write" if "write" in rw else "read"
        out[name] = float(job[side]["bw_bytes"])
    try:
        os.unlink(fname)
    except FileNotFoundError:
        pass
    return out


# ---- one file per block (vLLM fs tier layout) ----------------------------------------------


def bench_file_per_block(directory: str, bs: int, total: int) -> dict[str, float]:
    n = max(total // bs, 8)
    root = os.path.join(directory, f"fpb-{bs}")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    data = np.random.default_rng(3).integers(0, 256, bs, dtype=np.uint8).tobytes()
    buf = bytearray(bs)
    out: dict[str, float] = {}

    def write(keys):
        t0 = time.perf_counter()
        for k in keys:
            final = os.path.join(root, f"{k:016x}.bin")
            tmp = final + ".tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, final)
        os.sync()  # count the data reaching the disk, as the tier's O_DIRECT writes do
        return len(keys) * bs / (time.perf_counter() - t0)

    def read(keys):
        cold = drop_caches()
        t0 = time.perf_counter()
        for k in keys:
            with open(os.path.join(root, f"{k:016x}.bin"), "rb", buffering=0) as f:
                f.readinto(buf)
        bw = len(keys) * bs / (time.perf_counter() - t0)
        return bw if cold else float("nan")

    keys = list(range(n))
    out["seq_write"] = write(keys)
    out["seq_read"] = read(keys)
    shuffled = keys[:]
    random.Random(2).shuffle(shuffled)
    out["rand_read"] = read(shuffled)
    out["rand_write"] = write([k + n for k in shuffled])
    shutil.rmtree(root, ignore_errors=True)
    return out


# ---- driver -------------------------------------------------------------------------------


def mean(*xs: float) -> float:
    return sum(xs) / len(xs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument(
        "--dir", default=None, help="directory on the filesystem to test (default: a temp dir under /var/tmp)"
    )
    ap.add_argument("--sizes", default="256KiB,1MiB,2MiB,4MiB,8MiB", help="block sizes, comma separated")
    ap.add_argument("--total-mib", type=int, default=1024, help="MiB moved per pattern and block size")
    ap.add_argument("--queue-depth", type=int, default=16)
    ap.add_argument("--engines", default="auto", help="'auto' (every engine that works here) or a comma list")
    args = ap.parse_args()

    try:
        sizes = [parse_bytes(s, name="--sizes") for s in args.sizes.split(",")]
    except InvalidArgumentError as e:
        ap.error(str(e))
    uring_why = io_uring_probe()
    if args.engines == "auto":
        engines = ["io_uring", "pool"] if uring_why is None else ["pool"]
    else:
        engines = [e.strip() for e in args.engines.split(",")]
    if uring_why is not None:
        log(f"io_uring unavailable here: {uring_why}")
    fio = ensure_fio()
    base = args.dir or tempfile.mkdtemp(prefix="kvtier-bench-", dir="/var/tmp")
    os.makedirs(base, exist_ok=True)
    total = args.total_mib * MiB
    qd = args.queue_depth

    rows = []
    try:
        for bs in sizes:
            fpb = bench_file_per_block(base, bs, total)
            for engine in engines:
                log(f"block {bs // KiB} KiB, engine {engine} ...")
                tier = bench_tier(base, engine, bs, total, qd)
                ref = bench_fio(fio, base, engine, bs, total, qd) if fio else {}
                rows.append({"block_bytes": bs, "engine": engine, "tier": tier, "fio": ref, "file_per_block": fpb})
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)

    def ratios(row):
        t, f, p = row["tier"], row["fio"], row["file_per_block"]
        r = {}
        for side in ("read", "write"):
            seq, rnd = f"seq_{side}", f"rand_{side}"
            r[f"{side}_vs_fio"] = mean(t[seq] / f[seq], t[rnd] / f[rnd]) if f else float("nan")
            r[f"{side}_vs_file_per_block"] = mean(t[seq] / p[seq], t[rnd] / p[rnd])
        return r

    two = [r for r in rows if r["block_bytes"] == 2 * MiB] or rows
    # The engine `auto` would pick: io_uring when it works here, else the pool.
    headline = next((r for r in two if r["engine"] == engines[0]), two[0])
    summary = {
        "engine": headline["engine"],
        "io_mode": headline["tier"]["io_mode"],
        "block_bytes": headline["block_bytes"],
        "queue_depth": qd,
    }
    summary.update({k: round(v, 3) for k, v in ratios(headline).items()})
    if args.json:
        summary["io_uring_unavailable"] = uring_why
        summary["results"] = [
            {
                **{k: v for k, v in r.items() if k != "tier"},
                "tier": r["tier"],
                **{k: round(v, 3) for k, v in ratios(r).items()},
            }
            for r in rows
        ]
        print(json.dumps(summary, default=lambda x: None))
        return 0

    print(f"queue depth {qd}, {args.total_mib} MiB per pattern; MiB/s as tier/fio/file-per-block")
    heads = " | ".join(f"{h:>20}" for h in ("seq write", "seq read", "rand read", "rand write"))
    print(f"{'block':>7} {'engine':>8} | {heads} | read/fio write/fio")
    for r in rows:
        cells = []
        for m in ("seq_write", "seq_read", "rand_read", "rand_write"):
            t, f, p = r["tier"][m], r["fio"].get(m, float("nan")), r["file_per_block"][m]
            cells.append(f"{t / MiB:6.0f}/{f / MiB:6.0f}/{p / MiB:6.0f}")
        rr = ratios(r)
        print(
            f"{r['block_bytes'] // KiB:>6}K {r['engine']:>8} | "
            + " | ".join(cells)
            + f" | {rr['read_vs_fio']:8.2f} {rr['write_vs_fio']:9.2f}"
        )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
