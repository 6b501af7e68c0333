"""GPU check for the CUDA transfer engine: correctness, ordering, bandwidth and overlap.

Self-contained; run on a machine with an NVIDIA GPU after `make build`:

    .venv/bin/python benches/gpu_check.py            # prints one JSON line (and a table on stderr)

It checks, then measures, in one run:
1. Correctness: random layouts (per-layer, K/V split, one pool tensor; several dtypes), device ->
   host -> other device blocks, byte-identical, through cudaMemcpyBatchAsync and through the
   2-D copy fallback; also several blocks per host slot (vLLM's chunks, `sub_blocks`) and a
   load of one region at a time (TensorRT-LLM's per-layer loads).
2. Ordering with a compute stream: blocks written by a kernel on the compute stream are stored
   with `after_stream=compute` and must reach the host with the kernel's values; loads followed
   by `wait_on(job, compute)` must be visible to a kernel on the compute stream.
3. Bandwidth of H2D and D2H for large blocks (2 MiB rows) and for batches of small per-layer
   chunks (16-token blocks of a Llama-8B-like layout: 32 layers x K/V x 8 heads x 128 dims, fp16,
   64 KiB per layer per block), against torch's own pinned `copy_(non_blocking=True)` (after a
   device-side gather for the scattered case) in the same run.
4. Overlap: copies on kvtier's streams while a matmul loop runs on the compute stream.

Targets: >= 90% of torch's bandwidth on large blocks, >= 80% on batched small blocks,
and copies overlapping with compute.
"""

from __future__ import annotations

import json
import random
import sys
import time

import torch

import kvtier_rs as kv
from kvtier_rs.transfer import BlockLayout, Region
from kvtier_rs.transfer.cuda import CudaTransferEngine, device_available


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def padded(n: int) -> int:
    return -(-n // 4096) * 4096


def block_bytes(layout: BlockLayout, block: int) -> bytes:
    return b"".join(r.byte_rows()[block].cpu().numpy().tobytes() for r in layout.regions)


def random_layout(rng: random.Random, blocks: int) -> tuple[BlockLayout, list[torch.Tensor]]:
    dtype = rng.choice([torch.float16, torch.bfloat16, torch.float32])
    layers, tokens, heads, dim = rng.randint(1, 4), rng.choice([16, 32]), rng.randint(1, 4), rng.choice([64, 128])
    kind = rng.choice(["per_layer", "kv_split", "pool"])
    dev = "cuda"
    if kind == "per_layer":
        ts = [torch.randn(blocks, heads, tokens, 2 * dim, device=dev).to(dtype) for _ in range(layers)]
        return BlockLayout.per_layer(ts), ts
    if kind == "kv_split":
        ts = [torch.randn(2, blocks, tokens, heads, dim, device=dev).to(dtype) for _ in range(layers)]
        return BlockLayout.kv_split(ts), ts
    pool = torch.randn(blocks, layers, 2, tokens, heads * dim, device=dev).to(dtype)
    per = pool[0].numel() * pool.element_size() // layers
    return BlockLayout([Region.rows_of(pool, offset_bytes=i * per, bytes_per_block=per) for i in range(layers)]), [pool]


def finished(eng: CudaTransferEngine, jobs: list[int]) -> None:
    """Wait for jobs and stop if one failed (a job failing at once would time as huge bandwidth)."""
    bad = [r for r in eng.wait(jobs) if not r.success]
    if bad:
        raise SystemExit(f"transfer failed: {bad[0].error}")


def check_round_trips(rounds: int = 8) -> int:
    rng = random.Random(0)
    checked = 0
    for use_batch in (True, False):
        for _ in range(rounds):
            layout, tensors = random_layout(rng, 64)
            pool = kv.HostPool(64 * padded(layout.bytes_per_block), layout.bytes_per_block)
            with CudaTransferEngine(layout, pool, use_batch=use_batch) as eng:
                src = rng.sample(range(64), 24)
                slots = rng.sample(range(64), 24)
                want = [block_bytes(layout, b) for b in src]
                finished(eng, [eng.store(src, slots)])
                for t in tensors:
                    t.zero_()
                dst = rng.sample(range(64), 24)
                # Ordered after the zeroing on torch's stream (the copy streams do not sync with it).
                finished(eng, [eng.load(slots, dst, after_stream=torch.cuda.current_stream())])
                torch.cuda.synchronize()
                got = [block_bytes(layout, b) for b in dst]
                if got != want:
                    raise SystemExit(f"round trip mismatch on {layout} (use_batch={use_batch})")
                checked += 24
    return checked


def check_sub_blocks_and_regions(bps: int = 4) -> int:
    """vLLM's layout (`bps` blocks per host slot, padded pages at explicit offsets) stored with
    sub-blocks, then loaded back one region at a time."""
    blocks = 32
    a = torch.randint(-128, 127, (blocks, 96), dtype=torch.int8, device="cuda")
    b = torch.randint(-128, 127, (blocks, 80), dtype=torch.int8, device="cuda")
    regions = [
        Region(tensor=a, bytes_per_block=96, block_stride_bytes=96),
        Region(tensor=b, bytes_per_block=48, block_stride_bytes=80),  # packed rows
    ]
    layout = BlockLayout(regions, blocks_per_slot=bps, host_offsets=[0, 128 * bps], sub_block_strides=[128, 64])
    pool = kv.HostPool(16 * 4096, layout.slot_extent)
    src = list(range(0, 16))
    slots = [i // bps for i in range(16)]
    subs = [i % bps for i in range(16)]
    want = [block_bytes(layout, x) for x in src]
    with CudaTransferEngine(layout, pool) as eng:
        finished(eng, [eng.store(src, slots, sub_blocks=subs)])
        a.zero_()
        b.zero_()
        dst = list(range(16, 32))
        after = torch.cuda.current_stream()
        finished(eng, [eng.load(slots, dst, sub_blocks=subs, regions=[r], after_stream=after) for r in (0, 1)])
        torch.cuda.synchronize()
        if [block_bytes(layout, x) for x in dst] != want:
            raise SystemExit("sub-block / per-region round trip mismatch")
    return len(src)


def check_ordering() -> dict[str, bool]:
    blocks, row = 32, 1 << 20
    t = torch.zeros(blocks, row // 2, dtype=torch.float16, device="cuda")
    layout = BlockLayout.per_layer([t])
    pool = kv.HostPool(blocks * row, row)
    host = torch.frombuffer(pool, dtype=torch.uint8).view(pool.num_slots, pool.slot_bytes)
    compute = torch.cuda.Stream()
    with CudaTransferEngine(layout, pool) as eng:
        # A slow kernel chain on the compute stream writes the blocks, then the store is
        # ordered after it: without the ordering the host would see zeros.
        with torch.cuda.stream(compute):
            x = torch.randn(4096, 4096, device="cuda")
            for _ in range(20):
                x = x @ x
                x = x / x.norm()
            t.fill_(3.0)
        job = eng.store(list(range(blocks)), list(range(blocks)), after_stream=compute)
        finished(eng, [job])
        stored_ok = bool((host[:blocks].view(torch.float16) == 3.0).all())
        # Load zeros back, make the compute stream wait on the load, read on the compute stream.
        host[:blocks].zero_()
        job = eng.load(list(range(blocks)), list(range(blocks)))
        eng.wait_on(job, compute)
        with torch.cuda.stream(compute):
            total = t.float().abs().sum()
        compute.synchronize()
        finished(eng, [job])
        load_ok = float(total) == 0.0
    return {"store_after_compute": stored_ok, "load_before_compute": load_ok}


def check_job_timing(blocks: int = 64, row: int = 1 << 20, late_s: float = 0.05) -> dict[str, float]:
    """A load noticed `late_s` after it was queued must be timed to its copies' completion on
    the device (a few ms for 64 MiB), not to the poll: the SLO guard and the cost model read it."""
    t = torch.zeros(blocks, row // 2, dtype=torch.float16, device="cuda")
    pool = kv.HostPool(blocks * row, row)
    with CudaTransferEngine(BlockLayout.per_layer([t]), pool) as eng:
        finished(eng, [eng.load(list(range(blocks)), list(range(blocks)))])  # warm up
        job = eng.load(list(range(blocks)), list(range(blocks)))
        torch.cuda.synchronize()
        time.sleep(late_s)
        [r] = eng.wait([job])
        # Ordered after a busy compute stream, its copies start when that work is done: the job
        # counts the wait, and started_at..finished_at its copies alone (the cost model's span).
        compute = torch.cuda.Stream()
        with torch.cuda.stream(compute):
            a = torch.randn(4096, 4096, device="cuda")
            for _ in range(20):
                a = torch.tanh(a @ a)
        t0 = time.perf_counter()
        [ordered] = eng.wait([eng.load(list(range(blocks)), list(range(blocks)), after_stream=compute)])
    return {
        "late_poll_s": late_s,
        "late_polled_load_seconds": r.seconds,
        "ordered_load_wait_s": ordered.started_at - t0,
        "ordered_load_copy_s": ordered.finished_at - ordered.started_at,
        "ordered_load_seconds": ordered.seconds,
    }


def time_cuda(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def bandwidth_large(total_bytes: int = 1 << 30, row: int = 2 << 20) -> dict[str, float]:
    blocks = total_bytes // row
    t = torch.randn(blocks, row // 4, device="cuda")
    layout = BlockLayout.per_layer([t])
    pool = kv.HostPool(total_bytes, row)
    pinned = torch.empty(blocks, row, dtype=torch.uint8).pin_memory()
    src8 = t.view(torch.uint8).view(blocks, row)
    ids = list(range(blocks))
    with CudaTransferEngine(layout, pool) as eng:
        kv_d2h = time_cuda(lambda: finished(eng, [eng.store(ids, ids)]))
        kv_h2d = time_cuda(lambda: finished(eng, [eng.load(ids, ids)]))
    torch_d2h = time_cuda(lambda: pinned.copy_(src8, non_blocking=True))
    torch_h2d = time_cuda(lambda: src8.copy_(pinned, non_blocking=True))
    gib = total_bytes / 2**30
    return {
        "large_d2h_gibps": gib / kv_d2h,
        "large_h2d_gibps": gib / kv_h2d,
        "torch_large_d2h_gibps": gib / torch_d2h,
        "torch_large_h2d_gibps": gib / torch_h2d,
        "large_d2h_vs_torch": torch_d2h / kv_d2h,
        "large_h2d_vs_torch": torch_h2d / kv_h2d,
    }


def bandwidth_small(num_blocks: int = 2048, batch: int = 256) -> dict[str, float]:
    """Llama-8B-like: 32 layers of [blocks, 2, 16 tokens, 8 heads, 128] fp16 = 64 KiB per layer per block."""
    layers = [torch.randn(num_blocks, 2, 16, 8, 128, device="cuda", dtype=torch.float16) for _ in range(32)]
    layout = BlockLayout.per_layer(layers)
    pool = kv.HostPool(batch * padded(layout.bytes_per_block), layout.bytes_per_block)
    rng = random.Random(1)
    # Scattered engine blocks (as a real allocator leaves them), runs of 1-4 adjacent blocks.
    ids: list[int] = []
    while len(ids) < batch:
        start = rng.randrange(num_blocks - 4)
        ids += [b for b in range(start, start + rng.randint(1, 4)) if b not in ids]
    ids = ids[:batch]
    slots = list(range(batch))
    per_layer = 64 << 10
    # torch's side gets contiguous pinned buffers of its own: a strided view of kvtier's pool
    # would send its copies through pageable temporaries, which is not torch at its best.
    pinned_layers = [torch.empty(batch, per_layer, dtype=torch.uint8).pin_memory() for _ in range(32)]
    idx = torch.tensor(ids, device="cuda")
    staging = torch.empty(batch, per_layer, dtype=torch.uint8, device="cuda")
    with CudaTransferEngine(layout, pool) as eng:
        kv_d2h = time_cuda(lambda: finished(eng, [eng.store(ids, slots)]))
        kv_h2d = time_cuda(lambda: finished(eng, [eng.load(slots, ids)]))
        batched = eng.batch_calls > 0

    def torch_d2h() -> None:
        # torch's strongest equivalent: gather on the device, one pinned copy per layer.
        for layer, dst in zip(layers, pinned_layers, strict=True):
            torch.index_select(layer.view(num_blocks, -1).view(torch.uint8), 0, idx, out=staging)
            dst.copy_(staging, non_blocking=True)

    def torch_h2d() -> None:
        for layer, src in zip(layers, pinned_layers, strict=True):
            staging.copy_(src, non_blocking=True)
            layer.view(num_blocks, -1).view(torch.uint8).index_copy_(0, idx, staging)

    t_d2h, t_h2d = time_cuda(torch_d2h), time_cuda(torch_h2d)
    gib = batch * layout.bytes_per_block / 2**30
    return {
        "small_batch_d2h_gibps": gib / kv_d2h,
        "small_batch_h2d_gibps": gib / kv_h2d,
        "torch_small_batch_d2h_gibps": gib / t_d2h,
        "torch_small_batch_h2d_gibps": gib / t_h2d,
        "small_batch_d2h_vs_torch": t_d2h / kv_d2h,
        "small_batch_h2d_vs_torch": t_h2d / kv_h2d,
        "used_cudaMemcpyBatchAsync": batched,
    }


def overlap() -> dict[str, float]:
    row, blocks = 2 << 20, 256
    t = torch.randn(blocks, row // 4, device="cuda")
    layout = BlockLayout.per_layer([t])
    pool = kv.HostPool(blocks * row, row)
    ids = list(range(blocks))
    compute = torch.cuda.Stream()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)

    def matmuls() -> None:
        with torch.cuda.stream(compute):
            for _ in range(30):
                a @ a

    with CudaTransferEngine(layout, pool) as eng:
        t_mm = time_cuda(matmuls, 3)
        t_copy = time_cuda(lambda: finished(eng, [eng.store(ids, ids), eng.load(ids, ids)]), 3)

        def both() -> None:
            matmuls()
            finished(eng, [eng.store(ids, ids), eng.load(ids, ids)])

        t_both = time_cuda(both, 3)
    hidden = (t_mm + t_copy - t_both) / min(t_mm, t_copy)
    return {"overlap_matmul_s": t_mm, "overlap_copy_s": t_copy, "overlap_both_s": t_both, "overlap_fraction": hidden}


def main() -> None:
    if not device_available() or not torch.cuda.is_available():
        log("gpu_check: no CUDA device here; nothing measured")
        print(json.dumps({"gpu": None, "ran": False}))
        sys.exit(2)
    out: dict[str, object] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    out["round_trip_blocks_checked"] = check_round_trips()
    out["sub_block_region_blocks_checked"] = check_sub_blocks_and_regions()
    out.update(check_ordering())
    out.update(check_job_timing())
    out.update(bandwidth_large())
    out.update(bandwidth_small())
    out.update(overlap())
    out["targets_met"] = {
        "large_ge_90pct": min(out["large_d2h_vs_torch"], out["large_h2d_vs_torch"]) >= 0.9,
        "small_batch_ge_80pct": min(out["small_batch_d2h_vs_torch"], out["small_batch_h2d_vs_torch"]) >= 0.8,
        "overlaps_compute": out["overlap_fraction"] > 0.5,
        "ordering": bool(out["store_after_compute"] and out["load_before_compute"]),
        "jobs_timed_to_completion": out["late_polled_load_seconds"] < out["late_poll_s"] / 2,
        "copies_timed_from_their_start": out["ordered_load_copy_s"] <= 2 * out["late_polled_load_seconds"] + 1e-3,
    }
    for k, v in out.items():
        log(f"{k:>32}: {v}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
