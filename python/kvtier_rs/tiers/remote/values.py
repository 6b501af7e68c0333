"""One self-describing value per block in the shared store, and the keys every replica agrees on.

A value is a fixed header, the block's full key, then the payload::

    magic "KVTR" | version u16 | flags u16 | namespace 16 B | key length u16 | payload length u64
    | key bytes | check 32 B | payload

The check is BLAKE3 over everything before it plus the payload: the header fields are covered, so
a value copied under another key, or into another namespace, fails as surely as flipped bytes.
With a deployment secret it is BLAKE3 in keyed mode (a MAC): a client that can write to the store
but does not hold the secret cannot make a value that verifies. Without one it is a plain hash: it
catches damage and mix-ups, not a writer who means harm.

`open_value` never raises on what it reads: every way a value can be wrong is a `Miss` reason,
counted by the tier, and the block is recomputed.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from dataclasses import dataclass

import blake3

MAGIC = b"KVTR"
#: Bumped when the layout changes; a value of another version is a miss, never parsed.
FORMAT_VERSION = 1
_FLAG_KEYED = 1
_FIXED = struct.Struct("<4sHH16sHQ")  # magic, version, flags, namespace, key length, payload length
CHECK_BYTES = 32
#: Largest block key accepted (vLLM's are 36 bytes: a 32-byte hash and a 4-byte group).
MAX_KEY_BYTES = 1024
#: BLAKE3 hashes big payloads on several threads (with the GIL released).
_THREADS_FROM = 1 << 20


class Miss(enum.Enum):
    """Why a value read from the store was not served. Each is counted (`remote_miss_<value>`)."""

    ABSENT = "absent"  # no value under the key (never written, evicted, flushed)
    FOREIGN = "foreign"  # not a kvtier value (another program's bytes under the key)
    FORMAT = "format"  # a kvtier value of another format version
    NAMESPACE = "namespace"  # another model, layout, tenant or deployment
    KEY = "key"  # a value stored for another block key
    LENGTH = "length"  # truncated, padded, or a payload of another block size
    CHECK = "check"  # flipped bytes, or a value made without this deployment's secret
    ERROR = "error"  # the operation failed: a timeout, a node down, the breaker open


def namespace_digest(identity: str, salt: str = "") -> bytes:
    """16 bytes naming what a block's bytes mean: `identity` (the model, KV geometry, dtype, byte
    layout, block size and parallel split: the disk tier's directory digest) and the tenant or
    cache salt. Nothing per-process goes in, so every replica computes the same digest."""
    return hashlib.sha256(f"kvtier-remote/1\0{identity}\0{salt}".encode()).digest()[:16]


def store_key(prefix: str, namespace: bytes, block_key: bytes) -> bytes:
    """The store's key for a block: ``<prefix>:<namespace hex>:<block key hex>``. No hash tag:
    blocks spread over every shard of the cluster."""
    return f"{prefix}:{namespace.hex()}:{block_key.hex()}".encode()


def _hasher(secret: bytes | None, size: int) -> blake3.blake3:
    threads = blake3.blake3.AUTO if size >= _THREADS_FROM else 1
    if secret is None:
        return blake3.blake3(max_threads=threads)
    return blake3.blake3(key=secret, max_threads=threads)


def derive_secret(material: bytes) -> bytes:
    """The 32-byte MAC key from a deployment secret of any length."""
    return blake3.blake3(material, derive_key_context="kvtier remote tier value MAC v1").digest()


@dataclass(frozen=True)
class ValueFormat:
    """How this deployment seals and opens values: its namespace and, optionally, its secret (the
    32-byte MAC key from `derive_secret`)."""

    namespace: bytes
    secret: bytes | None = None

    def __post_init__(self) -> None:
        if len(self.namespace) != 16:
            raise ValueError(f"namespace must be 16 bytes, got {len(self.namespace)}")
        if self.secret is not None and len(self.secret) != 32:
            raise ValueError("secret must be 32 bytes (see derive_secret)")

    def header(self, block_key: bytes, payload_len: int) -> bytes:
        if len(block_key) > MAX_KEY_BYTES:
            raise ValueError(f"block key of {len(block_key)} bytes; at most {MAX_KEY_BYTES}")
        flags = _FLAG_KEYED if self.secret is not None else 0
        return _FIXED.pack(MAGIC, FORMAT_VERSION, flags, self.namespace, len(block_key), payload_len) + block_key

    def seal(self, block_key: bytes, payload: memoryview | bytes) -> bytes:
        """The value to store for `block_key`: header, check, payload."""
        head = self.header(block_key, len(payload))
        return b"".join((head, self.check(head, payload), payload))

    def check(self, head: bytes, payload: memoryview | bytes) -> bytes:
        """The check of a value with this header and payload (``CHECK_BYTES`` long)."""
        h = _hasher(self.secret, len(payload))
        h.update(head)
        h.update(payload)
        return h.digest()

    def open(self, block_key: bytes, value: bytes | None, payload_len: int) -> Miss | memoryview:
        """The payload of `value` if it is this deployment's value for `block_key` with
        `payload_len` bytes of payload and a matching check; otherwise why not."""
        if value is None:
            return Miss.ABSENT
        if len(value) < _FIXED.size or value[:4] != MAGIC:
            return Miss.FOREIGN
        magic, version, flags, namespace, key_len, length = _FIXED.unpack_from(value)
        if version != FORMAT_VERSION:
            return Miss.FORMAT
        if namespace != self.namespace or bool(flags & _FLAG_KEYED) != (self.secret is not None):
            return Miss.NAMESPACE
        body = _FIXED.size + key_len + CHECK_BYTES
        if len(value) < body:
            return Miss.LENGTH
        if key_len != len(block_key) or value[_FIXED.size : _FIXED.size + key_len] != block_key:
            return Miss.KEY
        if length != payload_len or len(value) != body + length:
            return Miss.LENGTH
        view = memoryview(value)
        h = _hasher(self.secret, length)
        h.update(view[: _FIXED.size + key_len])
        h.update(view[body:])
        if not hmac.compare_digest(h.digest(), value[body - CHECK_BYTES : body]):
            return Miss.CHECK
        return view[body:]
