"""kvtier quick start: a real host (CPU DRAM) tier holding real KV tensors.

A tiny "engine" KV cache (torch, per-layer K/V tensors) produces blocks for two requests that
share a system prompt. Blocks are offloaded into the host tier, the tier evicts under pressure,
a later request looks its prefix up, and the blocks read back are byte-identical to what the
engine wrote. Per-tier counters are printed at the end.

Run: make demo   (or: .venv/bin/python examples/quickstart.py)
"""

from __future__ import annotations

import hashlib

import torch

import kvtier_rs as kv

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


def main() -> None:
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
    print("\nhost tier counters:")
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


if __name__ == "__main__":
    main()
