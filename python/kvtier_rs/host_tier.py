"""HostTier: the CPU DRAM tier, a host pool plus the block index over its slots.

Gives slot-level zero-copy views (numpy, torch) so that transfer engines and the disk tier
read and write blocks in place. Block bookkeeping (what is stored where, what may be evicted)
is entirely the Rust index's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier_rs._core import BlockIndex, HostPool, InvalidArgumentError, StoreOutcome
from kvtier_rs.config import TierConfig
from kvtier_rs.keys import Key, key_list


class HostTier:
    def __init__(self, config: TierConfig) -> None:
        self.config = config
        self.pool = HostPool(int(config.capacity_bytes), int(config.block_bytes))
        self.index = BlockIndex(
            pool=self.pool,
            policy=config.policy,
            admission=config.admission,
            tier="cpu",
            block_bytes=int(config.block_bytes),
        )
        self._bytes = np.frombuffer(self.pool, dtype=np.uint8)
        self._block_bytes = int(config.block_bytes)

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    def slot_array(self, slot: int) -> np.ndarray:
        """Writable uint8 view of a slot's payload bytes (no copy)."""
        off = self.pool.slot_offset(slot)
        return self._bytes[off : off + self._block_bytes]

    def slot_tensor(self, slot: int) -> Any:
        """Writable torch uint8 view of a slot's payload bytes (no copy)."""
        import torch

        return torch.from_numpy(self.slot_array(slot))

    def store(self, keys: Sequence[Key], payloads: Sequence[bytes | np.ndarray], **hint: Any) -> StoreOutcome:
        """Store whole blocks from host memory (a convenience path; engines write slots directly).
        Payloads are checked before the index is asked for slots, so bad input changes nothing."""
        keys = key_list(keys)
        if len(keys) != len(payloads):
            raise InvalidArgumentError(f"payloads: {len(payloads)} payloads for {len(keys)} keys")
        by_key = {}
        for key, payload in zip(keys, payloads, strict=True):
            data = np.frombuffer(payload, dtype=np.uint8) if isinstance(payload, bytes) else np.asarray(payload)
            if data.nbytes != self._block_bytes:
                raise InvalidArgumentError(
                    f"payloads: the payload for key {key!r} is {data.nbytes} bytes, blocks are {self._block_bytes}"
                )
            by_key[key] = data
        out = self.index.prepare_store(keys, **hint)
        ok = []
        try:
            for key, slot in zip(out.keys, out.slots, strict=True):
                self.slot_array(slot)[:] = by_key[key].reshape(-1).view(np.uint8)
                ok.append(key)
        finally:
            done = set(ok)
            failed = [k for k in out.keys if k not in done]
            if ok:
                self.index.complete_store(ok, True)
            if failed:
                self.index.complete_store(failed, False)
        return out

    def read(self, keys: Sequence[Key]) -> list[bytes]:
        """Copy out ready blocks (pins them for the duration of the copy)."""
        keys = key_list(keys)  # listed once: the unpin must name exactly the keys pinned
        slots = self.index.pin_for_load(keys)
        try:
            return [self.slot_array(s).tobytes() for s in slots]
        finally:
            self.index.unpin(keys)

    def stats(self) -> dict[str, int]:
        return dict(self.index.stats())
