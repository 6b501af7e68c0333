"""Trace readers: Mooncake JSONL, Alibaba Bailian JSONL, kv-cache-tester JSON conversations and
plain token-id JSONL, gzip or not, all turned into one flat representation (`TraceData`).

Every malformed record raises `TraceError` naming the file, the line (or ``requests[i]`` inside
a kv-cache-tester file) and the field; with ``skip_bad`` such records are counted and skipped.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import math
import stat
import sys
import zlib
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvtier_rs.checks import show
from kvtier_rs.planner.errors import PlanError, TraceError

FORMATS = ("auto", "mooncake", "bailian", "kvcache-tester", "tokens")
DEFAULT_BLOCK_SIZE = {"mooncake": 512, "bailian": 16, "tokens": 16}
U64 = (1 << 64) - 1
I64 = (1 << 63) - 1
# Sanity bounds on per-record values: far beyond any real model, yet small enough that the
# core's u64 sums over a trace of any size that fits in memory cannot overflow.
MAX_TOKENS = 10**9
MAX_BLOCK_SIZE = 1 << 20
# kv-cache-tester's hash_id_scope values; absent means "local".
HASH_ID_SCOPES = ("local", "global")
# Auto-detection reads the first line up to this many bytes; a longer first line can only be
# a whole JSON document (kv-cache-tester) written on one line.
DETECT_BYTES = 16 << 20
# The largest integer float() takes without OverflowError (ints above it round to inf).
_FLOAT_MAX = int(sys.float_info.max)


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
    # Each request's session (conversation), for formats that name one; None otherwise.
    sessions: array | None = None
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

    def set_sessions(self, sessions: list[int | None]) -> None:
        """Each request's session, None for a request that names none: it is a session of its
        own (numbered below every id a trace gives, -2 - its index). No session named at all
        leaves `sessions` None: the trace cannot be split by session."""
        if any(s is not None for s in sessions):
            self.sessions = array("q", (-2 - i if s is None else s for i, s in enumerate(sessions)))


def _open_binary(path: Path) -> IO[bytes] | gzip.GzipFile:
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rb")
    return open(path, "rb")


def _utf8_problem(raw: bytes, e: UnicodeDecodeError) -> tuple[int, str]:
    """(line number within `raw`, reason) for bytes that are not UTF-8."""
    line_start = raw.rfind(b"\n", 0, e.start) + 1
    col = e.start - line_start + 1
    return raw.count(b"\n", 0, e.start) + 1, f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {col})"


def _read_problem(e: BaseException) -> str:
    if isinstance(e, EOFError):
        return "truncated gzip file (it ends before the end-of-stream marker)"
    if isinstance(e, (gzip.BadGzipFile, zlib.error)):
        return f"corrupt gzip file ({e})"
    return f"cannot read: {getattr(e, 'strerror', None) or e}"


class _Bad(Exception):
    def __init__(self, field: str | None, reason: str) -> None:
        self.field, self.reason = field, reason


def _int(rec: dict, name: str, *, maximum: int, minimum: int = 0, required: bool = True, default: int = 0) -> int:
    if name not in rec:
        if required:
            raise _Bad(name, "missing")
        return default
    v = rec[name]
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise _Bad(name, f"expected an integer, got {show(v)}")
    # show(): a JSON integer (or 1e300 as a float) can have hundreds of digits; the message
    # stays one readable line.
    if v < minimum:
        raise _Bad(name, f"must be >= {minimum}, got {show(v)}")
    if v > maximum:
        raise _Bad(name, f"must be <= {maximum}, got {show(v)}")
    return v


def _number(rec: dict, name: str) -> float:
    if name not in rec:
        raise _Bad(name, "missing")
    v = rec[name]
    # A JSON integer beyond a float's range (1e309 written out) is not a usable time either;
    # math.isfinite would raise OverflowError on it, so it is checked first.
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > _FLOAT_MAX:
        raise _Bad(name, f"expected a finite number, got {show(v)}")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _Bad(name, f"expected a number, got {show(v)}")
    return float(v)


def _in_order(ts: float, prev: tuple[float, str] | None, name: str) -> None:
    """Requests are replayed in file order and reuse times are differences of timestamps, so a
    record earlier than the last one kept is bad. `prev`: that record's time and where it is."""
    if prev is not None and ts < prev[0]:
        raise _Bad(name, f"{_show_time(ts)} is earlier than {_show_time(prev[0])} {prev[1]}")


def _show_time(t: float) -> str:
    return str(int(t)) if t.is_integer() and abs(t) < 1e15 else repr(t)


def _ids(rec: dict, name: str) -> list[int]:
    if name not in rec:
        raise _Bad(name, "missing")
    v = rec[name]
    if not isinstance(v, list):
        raise _Bad(name, f"expected a list of integers, got {type(v).__name__}")
    # The common case in C loops: only ints (not bools: their type is bool) within range.
    if not v or (set(map(type, v)) == {int} and min(v) >= 0 and max(v) <= U64):
        return v
    for i, x in enumerate(v):
        if isinstance(x, bool) or not isinstance(x, int) or x < 0 or x > U64:
            raise _Bad(name, f"item {i} is {show(x)}; expected an unsigned 64-bit integer")
    return v


def _check_blocks(n_blocks: int, tokens: int, bs: int, tokens_field: str) -> None:
    # Each listed block must hold at least one token; fewer blocks than tokens is allowed
    # (traces that list only full blocks): the uncovered tokens always miss.
    if n_blocks > 0 and tokens <= (n_blocks - 1) * bs:
        raise _Bad(tokens_field, f"{tokens} tokens cannot fill {n_blocks} blocks of {bs} tokens")


def _record_format(rec: Any) -> str | None:
    """The JSONL format a parsed line is a record of (a kv-cache-tester line is a whole
    conversation), or None when the line tells none. A Mooncake record needs a timestamp or an
    input length besides its hash ids: a kv-cache-tester request ("t", "in", "hash_ids") on a
    line of its own is not one."""
    if not isinstance(rec, dict):
        return None
    if "requests" in rec:
        return "kvcache-tester"
    if "token_ids" in rec:
        return "tokens"
    if "chat_id" in rec or "parent_chat_id" in rec:
        return "bailian"
    if "hash_ids" in rec and ("timestamp" in rec or "input_length" in rec):
        return "mooncake"
    return None


def detect_format(path: Path) -> str:
    """Guess the format from the first record (its whole line, up to `DETECT_BYTES`). When the
    first line tells nothing (a bad record: not UTF-8, not JSON, fields missing), the first line
    further on that is a record of a JSONL format decides, and the reader then reports or, with
    --skip-bad, skips the bad lines before it. With no such line, a first line that is not JSON
    on its own opens a multi-line JSON document (kv-cache-tester)."""
    lineno, first_line = 0, b""
    with _open_binary(path) as f:
        while not first_line.strip():
            first_line = f.readline(DETECT_BYTES)
            if not first_line:
                raise PlanError(f"{path}: the trace is empty")
            lineno += 1
            if len(first_line) >= DETECT_BYTES and not first_line.endswith(b"\n"):
                # Only a whole JSON document written on one line can be that long.
                return "kvcache-tester"
    first = next(_parse_lines([first_line]))[1]
    if isinstance(first, list):
        return "kvcache-tester"
    fmt = _record_format(first)
    if fmt is not None:
        return fmt
    later = next((lf for _, rec in _records(path) if (lf := _record_format(rec)) is not None), None)
    if later is not None:
        return later
    if isinstance(first, dict):
        raise PlanError(
            f"{path}:{lineno}: cannot tell the trace format from the first record (keys: {sorted(first)[:8]}) "
            "nor from any later line; pass --trace-format mooncake|bailian|kvcache-tester|tokens"
        )
    if not isinstance(first, _Bad):
        raise PlanError(f"{path}:{lineno}: expected a JSON object per line, got {type(first).__name__}")
    # Not JSON on its own: a pretty-printed document spans lines, and only the kv-cache-tester
    # format is one (its reader names the line where a broken document breaks).
    return "kvcache-tester"


def check_reader_options(fmt: str, block_size: int | None) -> None:
    """The reader's own options (`--trace-format`, `--block-size`), refused naming the option."""
    if fmt not in FORMATS:
        raise PlanError(f"--trace-format: unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if block_size is not None and not 0 < block_size <= MAX_BLOCK_SIZE:
        raise PlanError(f"--block-size: must be between 1 and {MAX_BLOCK_SIZE} tokens, got {block_size}")


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
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise PlanError(f"{p}: no such trace file") from None
    except OSError as e:
        raise PlanError(f"{p}: {_read_problem(e)}") from None
    if stat.S_ISDIR(mode):
        raise PlanError(f"{p}: is a directory, not a trace file")
    if not stat.S_ISREG(mode):
        raise PlanError(f"{p}: not a regular file (a FIFO, socket or device); give the trace as a file")
    check_reader_options(fmt, block_size)
    try:
        if fmt == "auto":
            fmt = detect_format(p)
        if fmt == "kvcache-tester":
            return _read_tester(p, block_size, skip_bad, limit)
        return _read_jsonl(p, fmt, block_size, skip_bad, limit)
    except (OSError, EOFError, zlib.error) as e:
        # Unreadable, or a corrupt or truncated .gz: the file itself is bad, not one record.
        raise PlanError(f"{p}: {_read_problem(e)}") from None


def _parse_lines(lines: Iterable[bytes]) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON or `_Bad`) for each non-blank line."""
    for lineno, raw in enumerate(lines, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield lineno, _Bad(None, _utf8_problem(raw, e)[1])
            continue
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
            yield lineno, _Bad(None, f"not valid JSON ({e.msg} at column {e.colno})")


def _records(p: Path) -> Iterator[tuple[int, Any]]:
    with _open_binary(p) as f:
        yield from _parse_lines(f)


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
    prev: tuple[float, str] | None = None  # the last kept record's timestamp, as in the file
    roots: dict[int, int] = {}  # Bailian: chat id -> the chat that opened its conversation
    sessions: list[int | None] = []
    for lineno, rec in _records(p):
        if limit is not None and data.n_requests >= limit:
            break
        try:
            if isinstance(rec, _Bad):
                raise rec
            if not isinstance(rec, dict):
                raise _Bad(None, f"expected a JSON object, got {type(rec).__name__}")
            ts = _number(rec, "timestamp")
            _in_order(ts, prev, "timestamp")
            if fmt == "tokens":
                toks = rec.get("token_ids")
                if not isinstance(toks, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= U64 for t in toks
                ):
                    raise _Bad("token_ids", "expected a list of non-negative integer token ids")
                if len(toks) > MAX_TOKENS:
                    raise _Bad("token_ids", f"{len(toks)} tokens; at most {MAX_TOKENS} per request")
                keys = chain_hash(toks, bs)
                session = _session_id(rec)
                data.add(keys, len(toks), _int(rec, "output_length", maximum=MAX_TOKENS, required=False), ts)
                sessions.append(session)
                prev = (ts, f"on line {lineno}")
                continue
            n_in = _int(rec, "input_length", maximum=MAX_TOKENS)
            n_out = _int(rec, "output_length", maximum=MAX_TOKENS, required=False)
            ids = _ids(rec, "hash_ids")
            if fmt == "mooncake" and "block_size" in rec:
                rbs = _int(rec, "block_size", minimum=1, maximum=MAX_BLOCK_SIZE)
                if block_size is not None and rbs != block_size:
                    raise _Bad("block_size", f"{rbs} disagrees with --block-size {block_size}")
                if record_bs is not None and rbs != record_bs:
                    raise _Bad("block_size", f"{rbs} differs from {record_bs} in earlier records")
                if record_bs is None and data.n_requests > 0 and rbs != bs:
                    raise _Bad("block_size", f"{rbs} differs from the {bs} of earlier records")
                record_bs = rbs
                data.block_size = bs = rbs
            _check_blocks(len(ids), n_in, bs, "input_length")
            session = _bailian_session(rec, roots) if fmt == "bailian" else _session_id(rec)
            # Mooncake timestamps are milliseconds; Bailian's are seconds.
            data.add(ids, n_in, n_out, ts / 1000.0 if fmt == "mooncake" else ts)
            sessions.append(session)
            prev = (ts, f"on line {lineno}")
        except _Bad as bad:
            _skip_or_raise(data, skip_bad, p, str(lineno), bad)
    data.set_sessions(sessions)
    if data.n_requests == 0:
        raise PlanError(f"{p}: no usable requests (skipped {data.skipped} bad records)")
    return data


def _session_id(rec: dict) -> int | None:
    """A Mooncake or token record's optional `session_id` (kvtier's own extension, written by
    `kvtier trace synth` for the turns of a chat), None when absent."""
    sid = _int(rec, "session_id", minimum=-1, maximum=I64, required=False, default=-1)
    return sid if sid >= 0 else None


def _bailian_session(rec: dict, roots: dict[int, int]) -> int | None:
    """A Bailian request's conversation: the chat that opened it, followed up the
    parent_chat_id links (-1 or absent: it opens one). A parent not in the trace (it began
    before the trace) stands for its conversation. None without a chat_id or parent."""
    parent = _int(rec, "parent_chat_id", minimum=-1, maximum=I64, required=False, default=-1)
    chat = _int(rec, "chat_id", minimum=-1, maximum=I64, required=False, default=-1)
    root = roots.get(parent, parent) if parent >= 0 else chat
    if chat >= 0:
        roots[chat] = root
    return root if root >= 0 else None


def _tester_documents(p: Path, raw: bytes, data: TraceData, skip_bad: bool) -> list[tuple[str, Any]]:
    """The conversations of a kv-cache-tester file with where each one is: one JSON document
    (a conversation, or a list of them), or JSONL with a conversation per line, whose bad lines
    --skip-bad skips and counts. A broken document is reported at the line where it breaks:
    nothing inside one document can be skipped."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        lines = list(_parse_lines(io.BytesIO(raw)))
        if not any(_record_format(rec) == "kvcache-tester" for _, rec in lines):
            if isinstance(e, UnicodeDecodeError):
                bad_line, reason = _utf8_problem(raw, e)
                raise TraceError(str(p), str(bad_line), None, reason) from None
            raise TraceError(str(p), str(e.lineno), None, f"not valid JSON ({e.msg} at column {e.colno})") from None
        docs = []
        for lineno, rec in lines:
            if isinstance(rec, _Bad):
                _skip_or_raise(data, skip_bad, p, str(lineno), rec)
            else:
                docs.append((str(lineno), rec))
        return docs
    if isinstance(doc, list):
        return [(f"conversation {ci}" if len(doc) > 1 else "", d) for ci, d in enumerate(doc)]
    return [("", doc)]


def _tester_conversations(p: Path, raw: bytes, data: TraceData, skip_bad: bool) -> list[tuple[str, dict, int]]:
    """(where, conversation, its block size) of each well-formed conversation in the file."""
    convs = []
    for where, d in _tester_documents(p, raw, data, skip_bad):
        try:
            if not isinstance(d, dict) or not isinstance(d.get("requests"), list):
                raise _Bad("requests", "expected an object with a list of requests")
            conv_bs = _int(d, "block_size", minimum=1, maximum=MAX_BLOCK_SIZE)
            # "local" (ids unique inside one conversation, the default when absent) or "global";
            # anything else ("Local", 1, a list) would merge the ids of different conversations,
            # so it is a bad conversation like any bad field.
            if d.get("hash_id_scope", "local") not in HASH_ID_SCOPES:
                raise _Bad("hash_id_scope", f"expected 'local' or 'global', got {show(d['hash_id_scope'])}")
            convs.append((where, d, conv_bs))
        except _Bad as bad:
            _skip_or_raise(data, skip_bad, p, where, bad)
    return convs


def _read_tester(p: Path, block_size: int | None, skip_bad: bool, limit: int | None) -> TraceData:
    with _open_binary(p) as f:
        raw = f.read()
    data = TraceData(str(p), "kvcache-tester", 0)  # block size: the conversations'
    convs = _tester_conversations(p, raw, data, skip_bad)
    if not convs:
        if data.skipped:
            raise PlanError(f"{p}: no usable requests (skipped {data.skipped} bad records)")
        raise PlanError(f"{p}: no conversations in the file")
    sizes = {bs for _, _, bs in convs}
    if len(sizes) > 1:
        raise PlanError(f"{p}: conversations use different block sizes {sorted(sizes)}; replay them separately")
    bs = data.block_size = sizes.pop()
    if block_size is not None and block_size != bs:
        raise PlanError(f"--block-size {block_size} disagrees with the file's block_size {bs}")
    # Local hash ids are only unique inside one conversation: give each conversation its own space.
    local = len(convs) > 1 and any(d.get("hash_id_scope", "local") == "local" for _, d, _ in convs)
    remap: dict[tuple[int, int], int] = {}
    rows = []
    for ci, (where, d, _) in enumerate(convs):
        prev: tuple[float, str] | None = None  # each conversation keeps its own order
        for ri, rec in enumerate(d["requests"]):
            loc = f"{where + ': ' if where else ''}requests[{ri}]"
            try:
                if not isinstance(rec, dict):
                    raise _Bad(None, "expected an object")
                t = _number(rec, "t")
                _in_order(t, prev, "t")
                n_in = _int(rec, "in", maximum=MAX_TOKENS)
                n_out = _int(rec, "out", maximum=MAX_TOKENS, required=False)
                ids = _ids(rec, "hash_ids")
                _check_blocks(len(ids), n_in, bs, "in")
                if local:
                    ids = [remap.setdefault((ci, x), len(remap)) for x in ids]
                rows.append((t, ci, ri, ids, n_in, n_out))
                prev = (t, f"in requests[{ri}]")
            except _Bad as bad:
                _skip_or_raise(data, skip_bad, p, loc, bad)
    if len(convs) > 1:
        # Conversations run side by side: replay their requests merged in time order.
        rows.sort(key=lambda r: (r[0], r[1], r[2]))
    for t, _ci, _ri, ids, n_in, n_out in rows[:limit]:
        data.add(ids, n_in, n_out, t)
    data.set_sessions([ci for _, ci, *_ in rows[:limit]])
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
