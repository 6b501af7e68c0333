"""One self-describing value per block in the shared store, and the keys every replica agrees on.

A value is a fixed header, the block's full key, then the payload::

    magic "KVTR" | version u16 | flags u16 | namespace 16 B | key length u16 | payload length u64
    | key bytes | check 16 B | payload

The check covers everything before it plus the payload: the header fields are covered, so a value
copied under another key, or into another namespace, fails as surely as flipped bytes.

* With a deployment secret it is BLAKE3 in keyed mode, 128 bits (a MAC): a client that can write
  to the store but does not hold the secret cannot make a value that verifies.
* Without one it is XXH3-128: it catches damage and mix-ups (a 2^-128 chance of missing one),
  not a writer who means harm. A cryptographic hash would not either, since anyone can compute
  it, and XXH3 costs a fifth of BLAKE3's CPU per byte, on every block read and written.

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
import xxhash

MAGIC = b"KVTR"
#: Bumped when the layout or the check changes; a value of another version is a miss, never
#: parsed. (1: a 32-byte BLAKE3 check in both modes.)
FORMAT_VERSION = 2
_FLAG_KEYED = 1
_FIXED = struct.Struct("<4sHH16sHQ")  # magic, version, flags, namespace, key length, payload length
CHECK_BYTES = 16
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


def _check(secret: bytes | None, head: bytes | memoryview, payload: bytes | memoryview) -> bytes:
    """The ``CHECK_BYTES`` check of a header and payload: keyed BLAKE3 with a secret, else XXH3."""
    if secret is None:
        h = xxhash.xxh3_128(head)
        h.update(payload)
        return h.digest()
    mac = blake3.blake3(key=secret, max_threads=blake3.blake3.AUTO if len(payload) >= _THREADS_FROM else 1)
    mac.update(head)
    mac.update(payload)
    return mac.digest(length=CHECK_BYTES)


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
        return _check(self.secret, head, payload)

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
        if not hmac.compare_digest(
            _check(self.secret, view[: _FIXED.size + key_len], view[body:]), value[body - CHECK_BYTES : body]
        ):
            return Miss.CHECK
        return view[body:]
