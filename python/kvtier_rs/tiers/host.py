"""HostTier: the CPU DRAM tier, a host pool plus the block index over its slots.

Gives slot-level zero-copy views (numpy, torch) so that transfer engines and the disk tier
read and write blocks in place. Block bookkeeping (what is stored where, what may be evicted)
is entirely the Rust index's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvtier_rs._core import BlockIndex, HostPool, InvalidArgumentError, StoreOutcome
from kvtier_rs.checks import integer, invalid_argument, show
from kvtier_rs.config import TierConfig
from kvtier_rs.tiers.keys import Key, as_list, key_list


class HostTier:
    def __init__(self, config: TierConfig) -> None:
        # Checked here, so that anything else (a dict of its fields) is refused by name rather
        # than with an AttributeError below.
        if not isinstance(config, TierConfig):
            raise invalid_argument("config", f"expected a TierConfig, got {show(config)}")
        self.config = config
        self.pool = HostPool(int(config.capacity_bytes), int(config.block_bytes))
        self.index = BlockIndex(
            pool=self.pool,
            policy=config.policy,
            admission=config.admission,
            tier="cpu",
            block_bytes=int(config.block_bytes),
        )
        # Through a memoryview: numpy's stubs on 3.11 take only the buffer types they list.
        self._bytes = np.frombuffer(memoryview(self.pool), dtype=np.uint8)
        self._block_bytes = int(config.block_bytes)

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    def slot_array(self, slot: int) -> np.ndarray:
        """Writable uint8 view of a slot's payload bytes (no copy)."""
        # Checked here: the core takes the slot as an unsigned int, which would turn -1 into an
        # OverflowError naming nothing and True into slot 1.
        slot = integer(slot, "slot")
        if slot < 0:
            raise invalid_argument("slot", f"slot {slot} out of range 0..{self.num_slots}")
        off = self.pool.slot_offset(slot)
        return self._bytes[off : off + self._block_bytes]

    def slot_tensor(self, slot: int) -> Any:
        """Writable torch uint8 view of a slot's payload bytes (no copy)."""
        import torch

        return torch.from_numpy(self.slot_array(slot))

    def store(self, keys: Iterable[Key], payloads: Iterable[bytes | np.ndarray], **hint: Any) -> StoreOutcome:
        """Store whole blocks from host memory (a convenience path; engines write slots directly).
        Payloads are checked before the index is asked for slots, so bad input changes nothing."""
        keys = key_list(keys)
        # Listed once, as keys are, so that any iterable (a generator too) works; one bytes
        # payload where a list of them is expected is refused by name rather than iterated
        # into ints.
        payloads = as_list(payloads, "payloads", "payload")
        if len(keys) != len(payloads):
            raise InvalidArgumentError(f"payloads: {len(payloads)} payloads for {len(keys)} keys")
        by_key: dict[Key, np.ndarray] = {}
        for key, payload in zip(keys, payloads, strict=True):
            try:
                given_twice = key in by_key
            except TypeError:  # unhashable: not a key at all
                raise invalid_argument("key", f"keys must be int or bytes, got {show(key)}") from None
            if given_twice:
                # The index would take the first and skip the second as present, while the
                # payload map kept the last: which payload the key got was an accident.
                raise InvalidArgumentError(f"keys: key {show(key)} is given twice")
            by_key[key] = self._payload_bytes(key, payload)
        out = self.index.prepare_store(keys, **hint)
        ok = []
        try:
            for key, slot in zip(out.keys, out.slots, strict=True):
                self.slot_array(slot)[:] = by_key[key]
                ok.append(key)
        finally:
            done = set(ok)
            failed = [k for k in out.keys if k not in done]
            if ok:
                self.index.complete_store(ok, True)
            if failed:
                self.index.complete_store(failed, False)
        return out

    def _payload_bytes(self, key: Key, payload: Any) -> np.ndarray:
        """A payload as a flat, contiguous uint8 array of exactly one block, or an
        InvalidArgumentError naming its key. Everything that can fail is done here, before the
        index hands out slots, so that a bad payload (a str or list, whose encoding could have
        the right size; an object or a non-contiguous array) is refused before any block of the
        chain is stored."""
        where = f"payloads: the payload for key {show(key)}"
        if isinstance(payload, (bytes, bytearray)):
            data = np.frombuffer(payload, dtype=np.uint8)
        elif isinstance(payload, memoryview) or hasattr(payload, "__array__"):
            data = np.asarray(payload)
        else:
            raise InvalidArgumentError(f"{where}: expected bytes or an array, got {type(payload).__name__}")
        if data.dtype.kind in "OU":
            raise InvalidArgumentError(f"{where}: expected bytes or an array of numbers, got an array of {data.dtype}")
        if data.nbytes != self._block_bytes:
            raise InvalidArgumentError(f"{where} is {data.nbytes} bytes, blocks are {self._block_bytes}")
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)

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
