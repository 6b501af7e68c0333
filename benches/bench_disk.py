"""Disk-tier bandwidth against fio and against a one-file-per-block store, in one run.

For each block size (256 KiB .. 8 MiB) and each I/O engine that works here, the tier writes
`--total-mib` of blocks sequentially, reads them back sequentially and in random order, then
rewrites them at random disk slots. fio runs the same patterns on a file in the same
directory with the same block size, queue depth and O_DIRECT (io_uring engine against fio's
io_uring, the thread pool against fio's psync with one thread per queue slot). The baseline
store writes each block to a temporary file and renames it into place (the layout vLLM's file
tier uses) and reads whole files back, with the page cache dropped before reads.

Each figure is the median of `--reps` repetitions; a repetition runs the tier and fio back to
back (in alternating order), so each ratio compares runs minutes apart at most, and the table
gives the median ratio and its range over the repetitions. It also opens a tier with
`engine="auto"` at each block size and reports which engine the open-time probe chose.

    python benches/bench_disk.py            # table
    python benches/bench_disk.py --json     # one JSON object (ratios at 2 MiB)
    python benches/bench_disk.py --sizes 2MiB --total-mib 256 --reps 3   # a short run

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


PATTERNS = ("seq_write", "seq_read", "rand_read", "rand_write")


def mean(*xs: float) -> float:
    return sum(xs) / len(xs)


def median(xs: list[float]) -> float:
    xs = sorted(x for x in xs if x == x)  # NaN (a failed fio run) is left out
    if not xs:
        return float("nan")
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def rep_ratios(tier: dict, ref: dict) -> dict[str, float]:
    """One repetition's tier/fio ratios: the mean of the sequential and the random pattern."""
    r = {}
    for side in ("read", "write"):
        seq, rnd = f"seq_{side}", f"rand_{side}"
        r[f"{side}_vs_fio"] = mean(tier[seq] / ref[seq], tier[rnd] / ref[rnd]) if ref else float("nan")
    return r


def auto_choice(directory: str, bs: int, qd: int) -> dict:
    """Open a fresh tier with engine="auto" at block size `bs`: the engine its probe chose and
    the probe's figures."""
    path = os.path.join(directory, f"tier-auto-{bs}")
    shutil.rmtree(path, ignore_errors=True)
    slot = -(-bs // 4096) * 4096 + 4096
    with DiskTier(path, 4 * qd * slot, bs, engine="auto", queue_depth=qd, num_files=1) as tier:
        out = {"engine": tier.engine, "probe": getattr(tier, "engine_probe", None)}
    shutil.rmtree(path, ignore_errors=True)
    return out


def summarize(reps: list[dict]) -> dict:
    """Medians of a row's repetitions, and the range of each ratio."""
    out: dict = {"reps": len(reps)}
    for side in ("tier", "fio"):
        out[side] = {m: median([r[side].get(m, float("nan")) for r in reps]) for m in PATTERNS}
    for k in ("read_vs_fio", "write_vs_fio"):
        vals = [r["ratios"][k] for r in reps]
        out[k] = median(vals)
        out[f"{k}_range"] = [min(vals), max(vals)]
    return out


def main() -> int:  # noqa: PLR0912, PLR0915 - argument parsing, then one pass per engine
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument(
        "--dir", default=None, help="directory on the filesystem to test (default: a temp dir under /var/tmp)"
    )
    ap.add_argument("--sizes", default="256KiB,1MiB,2MiB,4MiB,8MiB", help="block sizes, comma separated")
    ap.add_argument("--total-mib", type=int, default=1024, help="MiB moved per pattern and block size")
    ap.add_argument("--queue-depth", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5, help="repetitions per block size and engine (median, range)")
    ap.add_argument("--engines", default="auto", help="'auto' (every engine that works here) or a comma list")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps must be at least 1")

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
    autos = {}
    try:
        for bs in sizes:
            fpb = bench_file_per_block(base, bs, total)
            autos[bs] = auto_choice(base, bs, qd)
            log(f"block {bs // KiB} KiB: auto chose {autos[bs]['engine']} ({autos[bs]['probe']})")
            reps: dict[str, list[dict]] = {e: [] for e in engines}
            for rep in range(args.reps):
                for engine in engines:
                    log(f"block {bs // KiB} KiB, engine {engine}, repetition {rep + 1}/{args.reps} ...")
                    # Alternate which runs first, so a drift of the device does not favour one side.
                    if rep % 2 and fio:
                        ref = bench_fio(fio, base, engine, bs, total, qd)
                        tier = bench_tier(base, engine, bs, total, qd)
                    else:
                        tier = bench_tier(base, engine, bs, total, qd)
                        ref = bench_fio(fio, base, engine, bs, total, qd) if fio else {}
                    reps[engine].append({"tier": tier, "fio": ref, "ratios": rep_ratios(tier, ref)})
            for engine in engines:
                row = {"block_bytes": bs, "engine": engine, "auto_engine": autos[bs]["engine"]}
                row.update(summarize(reps[engine]))
                row["io_mode"] = reps[engine][0]["tier"]["io_mode"]
                row["file_per_block"] = fpb
                row["repetitions"] = [{"ratios": r["ratios"]} for r in reps[engine]]
                rows.append(row)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)

    def fpb_ratios(row):
        t, p = row["tier"], row["file_per_block"]
        return {
            f"{s}_vs_file_per_block": mean(t[f"seq_{s}"] / p[f"seq_{s}"], t[f"rand_{s}"] / p[f"rand_{s}"])
            for s in ("read", "write")
        }

    two = [r for r in rows if r["block_bytes"] == 2 * MiB] or rows
    # The headline is the engine `auto` chose at that block size.
    headline = next((r for r in two if r["engine"] == two[0]["auto_engine"]), two[0])
    summary = {
        "engine": headline["engine"],
        "auto_engine": headline["auto_engine"],
        "io_mode": headline["io_mode"],
        "block_bytes": headline["block_bytes"],
        "queue_depth": qd,
        "reps": args.reps,
        "read_vs_fio": round(headline["read_vs_fio"], 3),
        "read_vs_fio_range": [round(x, 3) for x in headline["read_vs_fio_range"]],
        "write_vs_fio": round(headline["write_vs_fio"], 3),
        "write_vs_fio_range": [round(x, 3) for x in headline["write_vs_fio_range"]],
    }
    summary.update({k: round(v, 3) for k, v in fpb_ratios(headline).items()})
    if args.json:
        summary["io_uring_unavailable"] = uring_why
        summary["auto"] = {str(bs): a for bs, a in autos.items()}
        summary["results"] = [{**r, **{k: round(v, 3) for k, v in fpb_ratios(r).items()}} for r in rows]
        print(json.dumps(summary, default=lambda x: None))
        return 0

    print(
        f"queue depth {qd}, {args.total_mib} MiB per pattern, median of {args.reps} repetition(s); "
        "MiB/s as tier/fio/file-per-block; ratios as median [min-max]"
    )
    heads = " | ".join(f"{h:>20}" for h in ("seq write", "seq read", "rand read", "rand write"))
    print(f"{'block':>7} {'engine':>8} | {heads} | {'read/fio':>17} | {'write/fio':>17} | auto")
    for r in rows:
        cells = []
        for m in PATTERNS:
            t, f, p = r["tier"][m], r["fio"][m], r["file_per_block"][m]
            cells.append(f"{t / MiB:6.0f}/{f / MiB:6.0f}/{p / MiB:6.0f}")
        rr = [
            f"{r[k]:.2f} [{r[k + '_range'][0]:.2f}-{r[k + '_range'][1]:.2f}]" for k in ("read_vs_fio", "write_vs_fio")
        ]
        print(
            f"{r['block_bytes'] // KiB:>6}K {r['engine']:>8} | "
            + " | ".join(cells)
            + f" | {rr[0]:>17} | {rr[1]:>17} | {r['auto_engine']}"
        )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
