"""What the shared store holds under one prefix, read-only: blocks and bytes per namespace, and
each node's memory. For `kvtier status --remote`.

Every primary is scanned (SCAN with MATCH, a page at a time; replicas hold copies and are not
counted twice), and each page's keys are sized in one pipelined round trip (STRLEN, the value's
length: header, key, check and payload; MEMORY USAGE, what the server spends on it). SCAN
guarantees every key present for the whole scan is seen once; keys written or evicted meanwhile
may or may not be.

Nothing is written. STRLEN is an access for the server's LRU/LFU clock (MEMORY USAGE and SCAN
are not), so each page's pipeline first turns on CLIENT NO-TOUCH (Redis / Valkey >= 7.2); an
older server refuses it, and there one inventory makes every block look used once: fine for an
operator's command, not for a loop.
"""

from __future__ import annotations

import string
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.cluster import RedisCluster

#: Keys per SCAN page and per sizing pipeline.
SCAN_COUNT = 1000
_HEX = frozenset(string.hexdigits.encode())


@dataclass
class NamespaceUse:
    namespace: str  # 32 hex digits (see values.namespace_digest)
    blocks: int = 0
    bytes: int = 0  # sum of the values' lengths
    memory_bytes: int | None = 0  # sum of MEMORY USAGE; None where the server refused it


@dataclass
class NodeMemory:
    node: str  # host:port
    role: str  # "primary" | "replica"
    used_memory: int | None = None
    maxmemory: int | None = None  # 0: no limit
    maxmemory_policy: str | None = None
    error: str | None = None


@dataclass
class Inventory:
    prefix: str
    namespaces: list[NamespaceUse]
    #: Keys under the prefix that are not `<prefix>:<32 hex>:<hex>` (not kvtier blocks).
    other_keys: int
    nodes: list[NodeMemory]
    #: Nodes whose scan failed ("host:port: reason"): the counts miss their keys.
    scan_errors: list[str] = field(default_factory=list)


def match_pattern(prefix: str) -> str:
    """The SCAN MATCH pattern for keys under `prefix`, its glob characters escaped."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in prefix) + ":*"


def parse_key(prefix: bytes, key: bytes) -> str | None:
    """The namespace (hex) of a block key `<prefix>:<32 hex>:<block key hex>`, else None."""
    if not key.startswith(prefix + b":"):
        return None
    ns, sep, block = key[len(prefix) + 1 :].partition(b":")
    if not sep or len(ns) != 32 or not block or len(block) % 2 or not _HEX.issuperset(ns + block):
        return None
    return ns.decode().lower()


def node_name(node: Any) -> str:
    return f"{node.host}:{node.port}"


def scan(client: RedisCluster, prefix: str, *, count: int = SCAN_COUNT) -> Inventory:
    """Scan every primary of `client`'s cluster. A node that fails is reported in `scan_errors`
    (and in its `NodeMemory.error`) rather than raised: the others are still worth reading."""
    by_ns: dict[str, NamespaceUse] = {}
    other = 0
    errors: list[str] = []
    pattern = match_pattern(prefix)
    raw_prefix = prefix.encode()
    for node in client.get_primaries():
        conn = client.get_redis_connection(node)
        try:
            cursor = 0
            while True:
                cursor, keys = conn.scan(cursor, match=pattern, count=count)
                other += _size_page(conn, raw_prefix, keys, by_ns)
                if cursor == 0:
                    break
        except (redis.RedisError, OSError) as e:
            errors.append(f"{node_name(node)}: {one_line(e)}")
    nodes = [_memory(client, n) for n in client.get_nodes()]
    namespaces = sorted(by_ns.values(), key=lambda u: (-u.bytes, u.namespace))
    return Inventory(prefix, namespaces, other, nodes, errors)


def _size_page(conn: redis.Redis, prefix: bytes, keys: Iterable[bytes | str], by_ns: dict[str, NamespaceUse]) -> int:
    """Add one SCAN page's block keys to `by_ns`; returns how many keys were not block keys."""
    blocks: list[tuple[str, bytes]] = []
    other = 0
    for key in keys:
        k = key if isinstance(key, bytes) else key.encode()  # str only from a decoding client
        ns = parse_key(prefix, k)
        if ns is None:
            other += 1
        else:
            blocks.append((ns, k))
    if not blocks:
        return other
    pipe = conn.pipeline(transaction=False)
    # On the pipeline's own connection, so it covers the STRLENs after it (refused before 7.2).
    pipe.execute_command("CLIENT", "NO-TOUCH", "ON")
    for _, k in blocks:
        pipe.strlen(k)
        pipe.memory_usage(k)
    replies = pipe.execute(raise_on_error=False)[1:]
    for i, (ns, _) in enumerate(blocks):
        length, mem = replies[2 * i], replies[2 * i + 1]
        if isinstance(length, Exception):
            raise length  # STRLEN refused: the node is failing (or the key is not a string)
        if not length:
            continue  # evicted or deleted since the SCAN
        u = by_ns.setdefault(ns, NamespaceUse(ns))
        u.blocks += 1
        u.bytes += int(length)
        # MEMORY USAGE may be refused (renamed or ACL-denied on managed services): then unknown.
        if u.memory_bytes is not None:
            u.memory_bytes = None if not isinstance(mem, int) else u.memory_bytes + mem
    return other


def _memory(client: RedisCluster, node: Any) -> NodeMemory:
    role = "primary" if node.server_type == "primary" else "replica"
    out = NodeMemory(node_name(node), role)
    conn = client.get_redis_connection(node)
    try:
        info = conn.info("memory")
    except (redis.RedisError, OSError) as e:
        out.error = one_line(e)
        return out
    out.used_memory = _int(info.get("used_memory"))
    # INFO memory carries maxmemory and its policy (Redis >= 4, Valkey): no CONFIG GET, which
    # managed services often refuse. Only a server without them in INFO is asked with CONFIG.
    out.maxmemory = _int(info.get("maxmemory"))
    policy = info.get("maxmemory_policy")
    if out.maxmemory is None or policy is None:
        try:
            cfg = conn.config_get("maxmemory*")
        except (redis.RedisError, OSError):
            cfg = {}  # refused: left unknown
        out.maxmemory = out.maxmemory if out.maxmemory is not None else _int(cfg.get("maxmemory"))
        policy = policy or cfg.get("maxmemory-policy")
    out.maxmemory_policy = None if policy is None else str(policy)
    return out


def _int(v: object) -> int | None:
    try:
        return int(v)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


def one_line(e: BaseException) -> str:
    """An exception as one short line (redis-py's cluster errors can span lines)."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."
