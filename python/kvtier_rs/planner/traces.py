"""Trace readers: Mooncake JSONL, Alibaba Bailian JSONL, kv-cache-tester JSON conversations and
plain token-id JSONL, gzip or not, all turned into one flat representation (`TraceData`).

Every malformed record raises `TraceError` naming the file, the line (or ``requests[i]`` inside
a kv-cache-tester file) and the field; with ``skip_bad`` such records are counted and skipped.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvtier_rs.planner.errors import PlanError, TraceError

FORMATS = ("auto", "mooncake", "bailian", "kvcache-tester", "tokens")
DEFAULT_BLOCK_SIZE = {"mooncake": 512, "bailian": 16, "tokens": 16}
U64 = (1 << 64) - 1


@dataclass
class TraceData:
    path: str
    format: str
    block_size: int
    offsets: array = field(default_factory=lambda: array("Q", [0]))
    keys: array = field(default_factory=lambda: array("Q"))
    input_tokens: array = field(default_factory=lambda: array("Q"))
    output_tokens: array = field(default_factory=lambda: array("Q"))
    timestamps_s: array = field(default_factory=lambda: array("d"))
    skipped: int = 0
    skipped_examples: list[str] = field(default_factory=list)

    @property
    def n_requests(self) -> int:
        return len(self.input_tokens)

    def add(self, keys: list[int], input_tokens: int, output_tokens: int, ts: float) -> None:
        self.keys.extend(keys)
        self.offsets.append(len(self.keys))
        self.input_tokens.append(input_tokens)
        self.output_tokens.append(output_tokens)
        self.timestamps_s.append(ts)


def _open_text(path: Path) -> IO[str]:
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


class _Bad(Exception):
    def __init__(self, field: str | None, reason: str) -> None:
        self.field, self.reason = field, reason


def _int(rec: dict, name: str, *, minimum: int = 0, required: bool = True, default: int = 0) -> int:
    if name not in rec:
        if required:
            raise _Bad(name, "missing")
        return default
    v = rec[name]
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise _Bad(name, f"expected an integer, got {v!r}")
    if v < minimum:
        raise _Bad(name, f"must be >= {minimum}, got {v}")
    return v


def _number(rec: dict, name: str) -> float:
    if name not in rec:
        raise _Bad(name, "missing")
    v = rec[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _Bad(name, f"expected a number, got {v!r}")
    return float(v)


def _ids(rec: dict, name: str) -> list[int]:
    if name not in rec:
        raise _Bad(name, "missing")
    v = rec[name]
    if not isinstance(v, list):
        raise _Bad(name, f"expected a list of integers, got {type(v).__name__}")
    for i, x in enumerate(v):
        if isinstance(x, bool) or not isinstance(x, int) or x < 0 or x > U64:
            raise _Bad(name, f"item {i} is {x!r}; expected an unsigned 64-bit integer")
    return v


def _check_blocks(n_blocks: int, tokens: int, bs: int, tokens_field: str) -> None:
    # Each listed block must hold at least one token; fewer blocks than tokens is allowed
    # (traces that list only full blocks): the uncovered tokens always miss.
    if n_blocks > 0 and tokens <= (n_blocks - 1) * bs:
        raise _Bad(tokens_field, f"{tokens} tokens cannot fill {n_blocks} blocks of {bs} tokens")


def detect_format(path: Path) -> str:
    """Guess the format from the first record."""
    with _open_text(path) as f:
        head = f.read(1 << 16)
    stripped = head.lstrip()
    if not stripped:
        raise PlanError(f"{path}: the trace is empty")
    first_line = stripped.split("\n", 1)[0]
    try:
        first = json.loads(first_line)
    except json.JSONDecodeError:
        first = None
    if isinstance(first, list) or (first is None and stripped[0] == "["):
        return "kvcache-tester"
    if first is None:
        # A pretty-printed JSON document spans lines: only the kv-cache-tester format does that.
        return "kvcache-tester"
    if not isinstance(first, dict):
        raise PlanError(f"{path}:1: expected a JSON object per line, got {type(first).__name__}")
    if "requests" in first:
        return "kvcache-tester"
    if "token_ids" in first:
        return "tokens"
    if "chat_id" in first or "parent_chat_id" in first:
        return "bailian"
    if "hash_ids" in first:
        return "mooncake"
    raise PlanError(
        f"{path}:1: cannot tell the trace format from the first record (keys: {sorted(first)[:8]}); "
        "pass --trace-format mooncake|bailian|kvcache-tester|tokens"
    )


def read_trace(
    path: str | Path,
    fmt: str = "auto",
    *,
    block_size: int | None = None,
    skip_bad: bool = False,
    limit: int | None = None,
) -> TraceData:
    """Read a trace file. `block_size` overrides the format's default (and per-record values
    must then agree with it); `limit` keeps the first `limit` requests."""
    p = Path(path)
    if not p.is_file():
        raise PlanError(f"{p}: no such trace file")
    if fmt not in FORMATS:
        raise PlanError(f"--trace-format: unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if block_size is not None and block_size <= 0:
        raise PlanError(f"--block-size: must be positive, got {block_size}")
    if fmt == "auto":
        fmt = detect_format(p)
    if fmt == "kvcache-tester":
        return _read_tester(p, block_size, skip_bad, limit)
    return _read_jsonl(p, fmt, block_size, skip_bad, limit)


def _records(p: Path) -> Iterator[tuple[int, Any]]:
    with _open_text(p) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                yield lineno, _Bad(None, f"not valid JSON ({e.msg} at column {e.colno})")


def _skip_or_raise(data: TraceData, skip_bad: bool, path: Path, where: str, bad: _Bad) -> None:
    err = TraceError(str(path), where, bad.field, bad.reason)
    if not skip_bad:
        raise err
    data.skipped += 1
    if len(data.skipped_examples) < 5:
        data.skipped_examples.append(str(err))


def _read_jsonl(p: Path, fmt: str, block_size: int | None, skip_bad: bool, limit: int | None) -> TraceData:
    bs = block_size or DEFAULT_BLOCK_SIZE[fmt]
    data = TraceData(str(p), fmt, bs)
    record_bs: int | None = None
    for lineno, rec in _records(p):
        if limit is not None and data.n_requests >= limit:
            break
        try:
            if isinstance(rec, _Bad):
                raise rec
            if not isinstance(rec, dict):
                raise _Bad(None, f"expected a JSON object, got {type(rec).__name__}")
            if fmt == "tokens":
                ts = _number(rec, "timestamp")
                toks = rec.get("token_ids")
                if not isinstance(toks, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= U64 for t in toks
                ):
                    raise _Bad("token_ids", "expected a list of non-negative integer token ids")
                keys = chain_hash(toks, bs)
                data.add(keys, len(toks), _int(rec, "output_length", required=False), ts)
                continue
            ts = _number(rec, "timestamp")
            n_in = _int(rec, "input_length")
            n_out = _int(rec, "output_length", required=False)
            ids = _ids(rec, "hash_ids")
            if fmt == "mooncake" and "block_size" in rec:
                rbs = _int(rec, "block_size", minimum=1)
                if block_size is not None and rbs != block_size:
                    raise _Bad("block_size", f"{rbs} disagrees with --block-size {block_size}")
                if record_bs is not None and rbs != record_bs:
                    raise _Bad("block_size", f"{rbs} differs from {record_bs} in earlier records")
                if record_bs is None and data.n_requests > 0 and rbs != bs:
                    raise _Bad("block_size", f"{rbs} differs from the {bs} of earlier records")
                record_bs = rbs
                data.block_size = bs = rbs
            _check_blocks(len(ids), n_in, bs, "input_length")
            # Mooncake timestamps are milliseconds; Bailian's are seconds.
            data.add(ids, n_in, n_out, ts / 1000.0 if fmt == "mooncake" else ts)
        except _Bad as bad:
            _skip_or_raise(data, skip_bad, p, str(lineno), bad)
    if data.n_requests == 0:
        raise PlanError(f"{p}: no usable requests (skipped {data.skipped} bad records)")
    return data


def _read_tester(p: Path, block_size: int | None, skip_bad: bool, limit: int | None) -> TraceData:
    with _open_text(p) as f:
        text = f.read()
    try:
        docs: list[Any] = [json.loads(text)]
    except json.JSONDecodeError:
        # JSONL of conversations, one per line.
        docs = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    docs.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise TraceError(str(p), str(lineno), None, f"not valid JSON ({e.msg})") from None
    if len(docs) == 1 and isinstance(docs[0], list):
        docs = docs[0]
    convs = []
    for ci, d in enumerate(docs):
        where = f"conversation {ci}" if len(docs) > 1 else ""
        if not isinstance(d, dict) or not isinstance(d.get("requests"), list):
            raise TraceError(str(p), where, "requests", "expected an object with a list of requests")
        try:
            bs = _int(d, "block_size", minimum=1)
        except _Bad as bad:
            raise TraceError(str(p), where, bad.field, bad.reason) from None
        convs.append((where, d, bs))
    sizes = {bs for _, _, bs in convs}
    if len(sizes) > 1:
        raise PlanError(f"{p}: conversations use different block sizes {sorted(sizes)}; replay them separately")
    bs = sizes.pop()
    if block_size is not None and block_size != bs:
        raise PlanError(f"--block-size {block_size} disagrees with the file's block_size {bs}")
    data = TraceData(str(p), "kvcache-tester", bs)
    # Local hash ids are only unique inside one conversation: give each conversation its own space.
    local = len(convs) > 1 and any(d.get("hash_id_scope", "local") == "local" for _, d, _ in convs)
    remap: dict[tuple[int, int], int] = {}
    rows = []
    for ci, (where, d, _) in enumerate(convs):
        for ri, rec in enumerate(d["requests"]):
            loc = f"{where + ': ' if where else ''}requests[{ri}]"
            try:
                if not isinstance(rec, dict):
                    raise _Bad(None, "expected an object")
                t = _number(rec, "t")
                n_in = _int(rec, "in")
                n_out = _int(rec, "out", required=False)
                ids = _ids(rec, "hash_ids")
                _check_blocks(len(ids), n_in, bs, "in")
                if local:
                    ids = [remap.setdefault((ci, x), len(remap)) for x in ids]
                rows.append((t, ci, ri, ids, n_in, n_out))
            except _Bad as bad:
                _skip_or_raise(data, skip_bad, p, loc, bad)
    if len(convs) > 1:
        # Conversations run side by side: replay their requests merged in time order.
        rows.sort(key=lambda r: (r[0], r[1], r[2]))
    for t, _ci, _ri, ids, n_in, n_out in rows[:limit]:
        data.add(ids, n_in, n_out, t)
    if data.n_requests == 0:
        raise PlanError(f"{p}: no usable requests (skipped {data.skipped} bad records)")
    return data


def chain_hash(token_ids: list[int], block_size: int) -> list[int]:
    """Chained block keys for a token sequence: each key digests its parent's key and its own
    tokens, so a key names a block and its whole prefix (as vLLM's block hashes do). The last,
    partial block gets a key too; its token count is part of what is hashed."""
    keys = []
    parent = b"kvtier-root"
    for start in range(0, len(token_ids), block_size):
        h = hashlib.blake2b(parent, digest_size=8)
        h.update(array("Q", token_ids[start : start + block_size]).tobytes())
        parent = h.digest()
        keys.append(int.from_bytes(parent, "little"))
    return keys
