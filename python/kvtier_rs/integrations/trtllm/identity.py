"""Block identity for the TensorRT-LLM connector: which kvtier key names a block of KV.

TensorRT-LLM's connector is first asked about a request in ``get_num_new_matched_tokens``, which
receives the request (tokens, LoRA task, cache salt) but no block hashes. So the connector
computes the chain of keys itself, and does so with the engine's own hash whenever it can:

- ``engine`` scheme: TensorRT-LLM's block hash (``tensorrt_llm.runtime.kv_cache_hash.
  hash_v1_block_key`` where the release has it, else the bindings' ``BlockKeyHasher.hash(BlockKey(
  tokens, lora_task_id), parent_hash)``), chained block to block exactly as the engine chains
  them, so a kvtier key and the engine's radix-tree / KV-event hash name the same block. The key
  is 16 bytes, like a kvtier-scheme key: an 8-byte digest of the namespace (the engine's hash
  does not say which model made the KV, and a disk tier outlives an engine) followed by the
  8-byte engine hash. Releases whose ``SchedulerOutput`` carries ``block_hashes`` (V1 KV cache
  manager, mid-2026 on) let the scheduler check its chain against the engine's at every step;
  any difference stops saving that request and is counted, so kvtier never files KV under a
  hash the engine would not give it.
- ``kvtier`` scheme: kvtier's own BLAKE2b chain over the namespace, tokens per block, cache salt,
  LoRA task and the tokens. Used where TensorRT-LLM's hasher cannot be imported (older or
  trimmed installs, and this repository's tests, since TensorRT-LLM cannot be installed here).

Either way equal keys mean equal token prefixes under the same model, salt and LoRA; requests
whose identity cannot be reproduced (a cache salt the release's hasher cannot take, multimodal
inputs) are neither matched nor saved.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from kvtier_rs.checks import invalid_argument
from kvtier_rs.integrations.trtllm.metadata import KEY_BYTES

HASH_MASK = (1 << 64) - 1

# (tokens of one block, parent engine hash (0 for the first block), lora task id, cache salt
# (id or string; first block only)) -> the block's engine hash, or None when it cannot be
# reproduced for them.
EngineHash = Callable[[Sequence[int], int, Any, Any], "int | None"]

SCHEMES = ("auto", "engine", "kvtier")


def engine_block_hasher() -> EngineHash | None:
    """TensorRT-LLM's block hash as a function, or None where TensorRT-LLM is not importable.
    The salt argument is the request's ``cache_salt_id`` (int) or ``cache_salt`` (str)."""
    try:
        from tensorrt_llm.runtime import kv_cache_hash  # newer releases: the engine's hash in Python
    except ImportError:
        kv_cache_hash = None
    if kv_cache_hash is not None:
        not_text = getattr(kv_cache_hash, "NonTextTokenHashError", ())
        salt_id_of = getattr(kv_cache_hash, "get_cache_salt_id", None)

        def hash_v1(tokens: Sequence[int], parent: int, lora: Any, salt: Any) -> int | None:
            if isinstance(salt, str):
                if salt_id_of is None:
                    return None
                salt = salt_id_of(salt)
            try:
                return int(
                    kv_cache_hash.hash_v1_block_key(
                        list(tokens), parent_hash=parent, lora_task_id=lora, cache_salt_id=salt
                    )
                )
            except not_text:
                return None  # non-text tokens: the engine hashes them some other way

        return hash_v1
    try:
        from tensorrt_llm.bindings.internal.batch_manager import BlockKey, BlockKeyHasher
    except ImportError:
        return None

    def hash_bindings(tokens: Sequence[int], parent: int, lora: Any, salt: Any) -> int | None:
        if salt is not None:
            return None  # these bindings take no cache salt: the engine's hash is not reproducible
        return int(BlockKeyHasher.hash(BlockKey(list(tokens), lora), parent))

    return hash_bindings


def _digest(parts: Sequence[Any], *, size: int, person: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=size, person=person)
    for part in parts:
        b = repr(part).encode()
        h.update(len(b).to_bytes(4, "little") + b)
    return h.digest()


class KvtierChain:
    """kvtier's own chain: each key hashes its parent key and its block's tokens."""

    scheme = "kvtier"

    def __init__(self, namespace: str, tokens_per_block: int) -> None:
        self.namespace, self.tokens_per_block = namespace, tokens_per_block

    def extend(
        self, parent: bytes | None, tokens: Sequence[int], first_block: int, count: int, lora: Any, salt: Any
    ) -> list[bytes] | None:
        """Keys of blocks first_block..first_block+count-1; `parent` is the key of block
        first_block-1 (None for the first block)."""
        tpb = self.tokens_per_block
        if parent is None:
            parent = _digest((self.namespace, tpb, salt, lora), size=KEY_BYTES, person=b"kvtier-trtllm")
        out = []
        for i in range(first_block, first_block + count):
            h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
            h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens[i * tpb : (i + 1) * tpb]))
            parent = h.digest()
            out.append(parent)
        return out

    def engine_hash(self, key: bytes) -> int | None:
        return None


class EngineChain:
    """The engine's own chain, namespaced: key = namespace digest (8 bytes) + engine hash (8 bytes)."""

    scheme = "engine"

    def __init__(self, namespace: str, tokens_per_block: int, hash_block: EngineHash) -> None:
        self.tokens_per_block = tokens_per_block
        self._prefix = _digest((namespace,), size=8, person=b"kvtier-trt-ns")
        self._hash = hash_block

    def extend(
        self, parent: bytes | None, tokens: Sequence[int], first_block: int, count: int, lora: Any, salt: Any
    ) -> list[bytes] | None:
        tpb = self.tokens_per_block
        h = 0 if parent is None else self.engine_hash(parent)
        out = []
        for i in range(first_block, first_block + count):
            # The engine mixes the salt into the first block only; later blocks inherit it
            # through the chain.
            nh = self._hash(tokens[i * tpb : (i + 1) * tpb], h, lora, salt if i == 0 else None)
            if nh is None:
                return None
            h = int(nh) & HASH_MASK
            out.append(self.key_for(h))
        return out

    def key_for(self, engine_hash: int) -> bytes:
        """The kvtier key of the block the engine hashes to `engine_hash`."""
        return self._prefix + (engine_hash & HASH_MASK).to_bytes(8, "little")

    def engine_hash(self, key: bytes) -> int:
        return int.from_bytes(key[8:], "little")


BlockIdentity = KvtierChain | EngineChain


def block_identity(scheme: str, namespace: str, tokens_per_block: int) -> BlockIdentity:
    """The identity for the `block_identity` option: "auto" takes the engine's hash when
    TensorRT-LLM's hasher imports, "engine" requires it, "kvtier" never uses it."""
    if scheme not in SCHEMES:
        raise invalid_argument("block_identity", f"{scheme!r} is not one of " + ", ".join(SCHEMES))
    hasher = engine_block_hasher() if scheme != "kvtier" else None
    if hasher is not None:
        return EngineChain(namespace, tokens_per_block, hasher)
    if scheme == "engine":
        raise invalid_argument(
            "block_identity",
            "'engine' needs TensorRT-LLM's block hasher "
            "(tensorrt_llm.runtime.kv_cache_hash or tensorrt_llm.bindings), which is not importable here",
        )
    return KvtierChain(namespace, tokens_per_block)
