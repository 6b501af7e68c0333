"""kvtier quick start: real tiers holding real KV tensors.

Part 1, the host tier alone: a tiny "engine" KV cache (torch) produces blocks for requests that
share a system prompt. Blocks are offloaded into the CPU tier, the tier evicts under pressure, a
later request looks its prefix up, and the blocks read back are byte-identical.

Part 2, the whole data path: the tier orchestrator over the engine's blocks, a small CPU tier
and a disk tier (a temporary directory, O_DIRECT where the filesystem allows). The shared prefix
is pushed out of the CPU tier, comes back from disk through CPU into other device blocks,
byte-identical, and the per-tier counters (GPU hits, CPU and disk promotions, misses) show it.

Run: make demo   (or: .venv/bin/python examples/quickstart.py)
"""

from __future__ import annotations

import hashlib
import tempfile

import torch

import kvtier_rs as kv
from kvtier_rs._core import DiskTier
from kvtier_rs.orchestrator import TierOrchestrator
from kvtier_rs.transfer import BlockLayout, auto

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 4, 2, 64, 16
DTYPE = torch.float16


def block_keys(token_ids: list[int]) -> list[bytes]:
    """Chained 32-byte digests, one per full block: each names the block and its whole prefix."""
    keys, parent = [], b"kvtier-demo"
    for start in range(0, len(token_ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        block = token_ids[start : start + BLOCK_TOKENS]
        parent = hashlib.sha256(parent + torch.tensor(block).numpy().tobytes()).digest()
        keys.append(parent)
    return keys


def block_bytes(kv_cache: torch.Tensor, block: int) -> torch.Tensor:
    """All layers' K and V of one block as one contiguous byte row (what a host slot holds)."""
    return kv_cache[:, :, block].contiguous().view(torch.uint8).reshape(-1)


def part1_host_tier() -> None:
    torch.manual_seed(0)
    gpu_blocks = 64
    # [layers, K/V, blocks, tokens, heads, dim]: the "device" KV cache (CPU tensors here).
    kv_cache = torch.randn(LAYERS, 2, gpu_blocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM, dtype=DTYPE)
    per_block = block_bytes(kv_cache, 0).numel()
    tier = kv.HostTier(kv.TierConfig(capacity_bytes=24 * per_block, block_bytes=per_block, policy="s3fifo"))
    print(f"host tier: {tier.num_slots} slots of {per_block} bytes, policy={tier.index.policy}")

    system_prompt = list(range(1000, 1000 + 8 * BLOCK_TOKENS))  # 8 shared blocks
    requests = [system_prompt + list(range(i * 500, i * 500 + 4 * BLOCK_TOKENS)) for i in range(6)]

    next_gpu_block = 0
    saved: dict[bytes, bytes] = {}
    for r, tokens in enumerate(requests):
        keys = block_keys(tokens)
        hit = tier.index.lookup_prefix(keys)
        if hit:
            tier.index.touch(keys[:hit])
        # "Prefill" the rest: pretend the engine computed those blocks into GPU blocks.
        gpu_ids = [(next_gpu_block + i) % gpu_blocks for i in range(len(keys))]
        next_gpu_block += len(keys)
        out = tier.index.prepare_store(keys)
        for key, slot in zip(out.keys, out.slots, strict=True):
            src = block_bytes(kv_cache, gpu_ids[keys.index(key)])
            tier.slot_tensor(slot).copy_(src)
            saved[key] = src.numpy().tobytes()
        tier.index.complete_store(out.keys)
        print(
            f"request {r}: {len(keys)} blocks, {hit} hit in the host tier, "
            f"{len(out.keys)} offloaded, {len(out.evicted)} evicted"
        )
        for key in out.evicted:
            saved.pop(key, None)

    # A new request with the shared system prompt: its prefix comes back from the host tier.
    keys = block_keys(system_prompt + [7] * BLOCK_TOKENS)
    hit = tier.index.lookup_prefix(keys)
    slots = tier.index.pin_for_load(keys[:hit])
    try:
        restored = [tier.slot_array(s).tobytes() for s in slots]
    finally:
        tier.index.unpin(keys[:hit])
    identical = all(restored[i] == saved[k] for i, k in enumerate(keys[:hit]))
    print(f"\nnew request: {hit} of {len(keys)} blocks served from the host tier, byte-identical: {identical}")
    if not identical or hit == 0:
        raise SystemExit("quickstart failed: blocks did not come back intact")

    s = tier.stats()
    print("host tier counters:")
    for name in (
        "capacity_blocks",
        "resident_blocks",
        "lookups",
        "hit_blocks",
        "stores_completed",
        "store_skipped",
        "evictions",
        "pins",
        "unpins",
    ):
        print(f"  {name:<18} {s[name]}")


def part2_orchestrator() -> None:
    torch.manual_seed(1)
    # Per-layer "device" caches [blocks, K/V, tokens, heads, dim]; CPU tensors here, CUDA on a GPU.
    layers = [torch.randn(64, 2, BLOCK_TOKENS, KV_HEADS, HEAD_DIM, dtype=DTYPE) for _ in range(LAYERS)]
    layout = BlockLayout.per_layer(layers)
    host = kv.HostTier(kv.TierConfig(capacity_bytes=12 * layout.bytes_per_block, block_bytes=layout.bytes_per_block))
    with tempfile.TemporaryDirectory() as root:
        disk = DiskTier(root, 64 * host.pool.slot_bytes * 2, host.pool.slot_bytes, admission="always")
        engine = auto(layout, host.pool)
        orch = TierOrchestrator(host, engine, disk=disk)
        print(
            f"\norchestrator: CPU tier {host.num_slots} blocks, disk tier {disk.capacity_blocks} blocks "
            f"({disk.engine}, {disk.io_mode} I/O), transfer engine {engine.name}"
        )

        prefix = block_keys(list(range(1000, 1000 + 8 * BLOCK_TOKENS)))
        want = [b"".join(r.byte_rows()[b].numpy().tobytes() for r in layout.regions) for b in range(8)]
        orch.offload(prefix, list(range(8)))
        orch.drain()
        for i in range(3):  # other traffic pushes the prefix out of the CPU tier
            other = block_keys(list(range(5000 + i * 999, 5000 + i * 999 + 6 * BLOCK_TOKENS)))
            orch.offload(other, list(range(8 + 6 * i, 14 + 6 * i)))
            orch.drain()

        request = prefix + block_keys(list(range(1000, 1000 + 8 * BLOCK_TOKENS)) + [7] * BLOCK_TOKENS)[8:]
        plan = orch.plan(request, gpu_hit_blocks=2)  # pretend the engine still holds 2 blocks
        print(f"plan: {plan.gpu_hits} GPU hits, {plan.cpu_hits} in CPU, {plan.disk_hits} on disk, {plan.misses} miss")
        dst = list(range(40, 40 + plan.loaded))
        orch.load(request, dst, gpu_hit_blocks=2, request_id="demo")
        (res,) = orch.drain()
        got = [b"".join(r.byte_rows()[b].numpy().tobytes() for r in layout.regions) for b in dst]
        identical = got == want[2 : 2 + res.loaded]
        print(f"loaded {res.loaded_cpu} from CPU and {res.loaded_disk} from disk, byte-identical: {identical}")
        if not identical or res.loaded_disk == 0:
            raise SystemExit("quickstart failed: the disk path did not bring the blocks back intact")
        s = orch.snapshot()  # typed; orch.stats() is the same as a dict
        gpu, cpu, on_disk = s.tiers.gpu, s.tiers.cpu, s.tiers.disk
        if on_disk is None:  # None only without a disk tier
            raise SystemExit("quickstart failed: the orchestrator reports no disk tier")
        print("per-tier counters:")
        print(f"  GPU hits           {gpu.hits}")
        print(f"  CPU promotions     {cpu.promotions}   (CPU hits {cpu.hits})")
        print(f"  disk promotions    {on_disk.promotions}   (disk hits {on_disk.hits})")
        print(f"  misses (recompute) {s.misses}")
        print(f"  disk blocks written {on_disk.writes.completed}, CPU evictions {cpu.evictions}")
        engine.close()
        disk.close()


def main() -> None:
    part1_host_tier()
    part2_orchestrator()


if __name__ == "__main__":
    main()
