"""`kvtier trace synth`: realistic synthetic request traces in Mooncake JSONL.

A request's prompt is a list of segments (a system prompt, retrieved documents, earlier turns of
a session, fresh text). Blocks are cut across segments every `block_size` tokens and keyed by
their whole prefix, exactly like Mooncake's chained hash ids, so the planner replays synthetic
and real traces the same way. Workloads mixed by share of arrivals:

- system: a shared system prompt (Zipf-popular among a few) plus a unique question;
- rag: a RAG scaffold prompt, one to three documents from a shared set (Zipf popularity) and a
  unique question;
- chat: multi-turn sessions; each turn resends the whole conversation so far (prompt, earlier
  user messages and answers) plus a new message, after a think time; its records carry the
  session's number (`session_id`, an extension of the format the planner reads to split a
  trace across replicas by session);
- unique: prompts that share nothing (tiering cannot help them).

Arrivals of new work are Poisson, or bursty (rate alternating between bursts and lulls).
"""

from __future__ import annotations

import gzip
import heapq
import io
import itertools
import json
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from kvtier_rs.planner.errors import PlanError
from kvtier_rs.planner.files import is_stream, replaced_atomically

KINDS = ("system", "rag", "chat", "unique")


@dataclass
class SynthConfig:
    requests: int = 4000
    rate: float = 2.0  # new arrivals per second
    arrivals: str = "poisson"  # or "bursty"
    mix: dict[str, float] = field(default_factory=lambda: {"system": 0.25, "rag": 0.25, "chat": 0.35, "unique": 0.15})
    block_size: int = 512
    system_prompts: int = 8
    documents: int = 400
    zipf: float = 1.1
    think_time_s: float = 30.0
    mean_turns: float = 5.0
    max_context: int = 64_000
    seed: int = 0


def parse_mix(text: str) -> dict[str, float]:
    mix: dict[str, float] = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in KINDS:
            raise PlanError(f"--mix: unknown workload {name!r}; expected {', '.join(KINDS)}")
        try:
            mix[name] = float(value)
        except ValueError:
            raise PlanError(f"--mix: {part!r} needs a number, e.g. chat=0.4") from None
        if not (math.isfinite(mix[name]) and mix[name] >= 0):
            raise PlanError(f"--mix: share of {name} must be a finite number >= 0, got {value.strip()!r}")
    total = sum(mix.values())
    if not (0 < total < math.inf):
        raise PlanError(f"--mix: shares must add up to a finite number more than 0, got {total}")
    return mix


class _Keys:
    """Chained block ids: a block is named by its parent's id and its own content."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.ids: dict[tuple, int] = {}

    def chain(self, segments: list[tuple[int, int]]) -> list[int]:
        out: list[int] = []
        parent = -1
        pieces: list[tuple[int, int, int]] = []
        room = self.bs
        for seg, length in segments:
            pos = 0
            while pos < length:
                take = min(room, length - pos)
                pieces.append((seg, pos, pos + take))
                pos += take
                room -= take
                if room == 0:
                    parent = self.ids.setdefault((parent, tuple(pieces)), len(self.ids))
                    out.append(parent)
                    pieces, room = [], self.bs
        if pieces:
            out.append(self.ids.setdefault((parent, tuple(pieces)), len(self.ids)))
        return out


def _zipf_weights(n: int, s: float) -> list[float]:
    acc, out = 0.0, []
    for i in range(1, n + 1):
        acc += 1.0 / i**s
        out.append(acc)
    return out


def synthesize(cfg: SynthConfig) -> list[dict]:
    """The trace as a list of Mooncake records (timestamps in milliseconds), in time order."""
    if cfg.requests <= 0 or cfg.rate <= 0 or cfg.block_size <= 0:
        raise PlanError("trace synth: --requests, --rate and --block-size must be positive")
    if cfg.arrivals not in ("poisson", "bursty"):
        raise PlanError(f"--arrivals: expected poisson or bursty, got {cfg.arrivals!r}")
    rng = random.Random(cfg.seed)
    seg_ids = itertools.count()
    chats = itertools.count()
    sys_prompts = [(next(seg_ids), rng.randint(800, 3000)) for _ in range(cfg.system_prompts)]
    sys_w = _zipf_weights(len(sys_prompts), cfg.zipf)
    rag_prompt = (next(seg_ids), rng.randint(300, 800))
    docs = [(next(seg_ids), rng.randint(1000, 6000)) for _ in range(cfg.documents)]
    doc_w = _zipf_weights(len(docs), cfg.zipf)
    kinds = list(cfg.mix)
    kind_w = list(itertools.accumulate(cfg.mix[k] for k in kinds))
    keys = _Keys(cfg.block_size)

    def fresh(lo: int, hi: int) -> tuple[int, int]:
        return next(seg_ids), rng.randint(lo, hi)

    # Event queue of (time, tiebreak, prompt segments, session state or None).
    queue: list[tuple[float, int, list[tuple[int, int]], dict | None]] = []
    tiebreak = itertools.count()
    t, burst_until, bursting = 0.0, 0.0, False
    records: list[dict] = []
    while len(records) < cfg.requests:
        # Next new arrival.
        rate = cfg.rate
        if cfg.arrivals == "bursty":
            if t >= burst_until:
                bursting = not bursting
                burst_until = t + rng.expovariate(1 / (10.0 if bursting else 30.0))
            rate = cfg.rate * (5.0 if bursting else 0.2)
        t_next = t + rng.expovariate(rate)
        # Serve queued session turns that come before it.
        while queue and queue[0][0] <= t_next and len(records) < cfg.requests:
            when, _, segs, sess = heapq.heappop(queue)
            _emit(records, keys, when, segs, rng, cfg, queue, tiebreak, sess, fresh)
        if len(records) >= cfg.requests:
            break
        t = t_next
        kind = rng.choices(kinds, cum_weights=kind_w)[0]
        if kind == "system":
            segs = [rng.choices(sys_prompts, cum_weights=sys_w)[0], fresh(30, 400)]
            _emit(records, keys, t, segs, rng, cfg, queue, tiebreak, None, fresh)
        elif kind == "rag":
            chosen = {rng.choices(range(len(docs)), cum_weights=doc_w)[0] for _ in range(rng.randint(1, 3))}
            segs = [rag_prompt, *(docs[i] for i in sorted(chosen)), fresh(30, 300)]
            _emit(records, keys, t, segs, rng, cfg, queue, tiebreak, None, fresh)
        elif kind == "chat":
            turns = 1 + int(rng.expovariate(1 / max(cfg.mean_turns - 1, 1e-9)))
            segs = [rng.choices(sys_prompts, cum_weights=sys_w)[0], fresh(50, 600)]
            _emit(records, keys, t, segs, rng, cfg, queue, tiebreak, {"left": turns - 1, "id": next(chats)}, fresh)
        else:
            _emit(records, keys, t, [fresh(300, 8000)], rng, cfg, queue, tiebreak, None, fresh)
    return records


def _emit(records, keys, when, segs, rng, cfg, queue, tiebreak, sess, fresh) -> None:  # noqa: PLR0917 - the generator loop's state, passed through
    n_in = sum(length for _, length in segs)
    out = rng.randint(50, 800)
    ms = when * 1000
    if not math.isfinite(ms):
        # A tiny --rate (1e-306 per second) spaces arrivals past a float's range: int(inf)
        # would raise OverflowError, and no reader could use such times anyway.
        raise PlanError(
            f"--rate {cfg.rate!r}: arrivals so rare put request {len(records) + 1}'s timestamps "
            "past a float's range (raise --rate)"
        )
    records.append(
        {
            "timestamp": int(ms),
            "input_length": n_in,
            "output_length": out,
            "hash_ids": keys.chain(segs),
            "block_size": cfg.block_size,
        }
    )
    if sess is not None:
        records[-1]["session_id"] = sess["id"]
    if sess is not None and sess["left"] > 0:
        # The next turn resends everything so far: the answer just generated and a new message.
        nxt = [*segs, fresh(out, out), fresh(50, 600)]
        if sum(length for _, length in nxt) <= cfg.max_context:
            heapq.heappush(
                queue,
                (
                    when + rng.expovariate(1 / cfg.think_time_s),
                    next(tiebreak),
                    nxt,
                    {"left": sess["left"] - 1, "id": sess["id"]},
                ),
            )


def write_trace(records: list[dict], path: str | Path) -> None:
    """Write `records` to `path` whole or not at all (`replaced_atomically`). A link at `path` is
    replaced by the trace, never written through; standard output (/dev/stdout) and other
    streams (a FIFO, a terminal) are written in place."""
    p = Path(path)
    gz = p.suffix == ".gz"

    def write(raw: BinaryIO) -> None:
        zipped = gzip.GzipFile(fileobj=raw, mode="wb") if gz else None
        text = io.TextIOWrapper(zipped or raw, encoding="utf-8")
        for r in records:
            text.write(json.dumps(r, separators=(",", ":")) + "\n")
        text.flush()
        text.detach()  # leaves `raw` open for its owner
        if zipped is not None:
            zipped.close()  # the gzip trailer; `raw` stays open

    if str(path) == "/dev/stdout":
        # /dev/stdout is a link to this process's fd 1, which may be a regular file: replacing
        # "it" would replace the link in /dev.
        write(sys.stdout.buffer)
        sys.stdout.buffer.flush()
        return
    if is_stream(p):
        with open(p, "wb") as out:
            write(out)
        return
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    with replaced_atomically(p) as tmp:
        write(tmp)
