"""Where the LRU -> Belady gap lies: how much of it a policy could close if it knew the future
of the blocks it has already seen twice (when they return, or only whether), how much the best
scores learnable from a block's turn, use count and age close, and how much online predictions do.

Each bound replays the planner's rules in plain Python (prefix tree, placement from the first
miss, victims outside the request and leaves only, the chain tail applied first, warm-up 0.5,
token-weighted) with exact, unbounded use counts. It replays LRU and opt too and fails unless
both equal the planner's to the token: the rules must match. The policies (all but `odds` and
`density` evict blocks used once so far first):

- `oracle`: a block used once so far goes first (oldest first), except that a repeated block
  with no further use goes before it; repeated blocks by their true next use, farthest first.
  Knows nothing about a block's first reuse, everything about later ones.
- `lastgap`: online. A repeated block is expected back one previous gap after its last use; one
  more than twice that gap (plus 50 requests) overdue goes first, then one-use blocks, then the
  farthest expected.
- `second`: online. Repeated blocks in LRU order behind the one-use blocks.
- `alive`: knows whether a repeated block is used again, not when: the dead ones go first, then
  the one-use blocks, then the repeated ones in LRU order.
- `odds` and `density`: every block by a score of the blocks like it, measured over the whole
  trace: "like it" is the same conversation turn (1-16+), use count (1-4+) and age since its
  last use. `odds`: the share of them used again; `density`: their hit density (returns within
  DENSITY_HORIZON requests per request of space held). Lowest first (ties: least recently
  used). They know what an online policy could at best learn from these signals, not any
  block's outcome.

A request continues a conversation when the deepest of its blocks seen before lies below its
first block (every request of these traces starts with one shared block): it is one turn after
the request that last used that block.

    .venv/bin/python benches/policy_bounds.py [--trace PATH] [--capacities 2048,4096]
"""

from __future__ import annotations

import argparse
import heapq
import sys
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from kvtier_rs._core import replay_sweep
from kvtier_rs.planner.plan import build_trace
from kvtier_rs.planner.traces import read_trace

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
NEVER = 1 << 62

Requests = list[tuple[list[int], int]]
NextUses = list[dict[int, int]]


class Policy(ABC):
    """What the replay asks of a policy: `begin` a request, a `victim` among evictable blocks
    (None: nothing can go), whether the incoming block takes its place (`replaces`), and `place`
    each block the request holds, tail first."""

    def __init__(self, next_use: NextUses) -> None:
        self.next_use = next_use
        self.now = 0

    def begin(self, r: int, keys: list[int]) -> None:
        self.now = r

    @abstractmethod
    def victim(self, ok: Callable[[int], bool]) -> int | None:
        """The block to evict next, among those `ok` accepts."""

    def replaces(self, incoming_next_use: int, victim: int) -> bool:
        """Whether the incoming block evicts `victim` (the policy forgets it then)."""
        return True

    @abstractmethod
    def place(self, k: int) -> None:
        """`k` is held by the current request: inserted or touched."""


class Belady(Policy):
    """The planner's opt, replayed here to check these rules: the farthest next use goes (ties:
    the key first seen latest), and an incoming block used later than that victim is refused."""

    def __init__(self, next_use: NextUses, first_seen: dict[int, int]) -> None:
        super().__init__(next_use)
        self.first_seen = first_seen
        self.version: dict[int, int] = {}
        self.when: dict[int, int] = {}
        self.heap: list[tuple[int, int, int, int]] = []

    def place(self, k: int) -> None:
        v = self.version[k] = self.version.get(k, 0) + 1
        self.when[k] = self.next_use[self.now][k]
        heapq.heappush(self.heap, (-self.when[k], -self.first_seen[k], v, k))

    def victim(self, ok: Callable[[int], bool]) -> int | None:
        skipped, found = [], None
        while self.heap:
            e = heapq.heappop(self.heap)
            if self.version.get(e[3]) != e[2]:
                continue
            if ok(e[3]):
                found = e
                break
            skipped.append(e)
        for s in skipped:
            heapq.heappush(self.heap, s)
        if found is None:
            return None
        heapq.heappush(self.heap, found)  # stays until `replaces` says it goes
        return found[3]

    def replaces(self, incoming_next_use: int, victim: int) -> bool:
        if incoming_next_use > self.when[victim]:
            return False
        self.version[victim] += 1
        return True


class OneUseFirst(Policy):
    """Blocks used once so far, oldest first, go before repeated ones; subclasses order the
    repeated ones (`place_repeated`, `repeated_victim`) and may name some to go first (`doomed`)."""

    def __init__(self, next_use: NextUses) -> None:
        super().__init__(next_use)
        self.uses: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.gap: dict[int, int] = {}
        self.once: OrderedDict[int, None] = OrderedDict()

    def begin(self, r: int, keys: list[int]) -> None:
        super().begin(r, keys)
        for k in set(keys):
            self.uses[k] = self.uses.get(k, 0) + 1
            if k in self.last:
                self.gap[k] = r - self.last[k]
            self.last[k] = r

    def place(self, k: int) -> None:
        self.forget(k)
        if self.uses[k] == 1:
            self.once[k] = None
        else:
            self.place_repeated(k)

    def victim(self, ok: Callable[[int], bool]) -> int | None:
        k = self.doomed(ok)
        if k is None:
            k = next((x for x in self.once if ok(x)), None)
        if k is None:
            k = self.repeated_victim(ok)
        if k is not None:
            self.forget(k)
        return k

    def forget(self, k: int) -> None:
        self.once.pop(k, None)

    @abstractmethod
    def place_repeated(self, k: int) -> None:
        """`k`, used at least twice, is held by the current request."""

    @abstractmethod
    def repeated_victim(self, ok: Callable[[int], bool]) -> int | None:
        """The repeated block to evict next, among those `ok` accepts."""

    def doomed(self, ok: Callable[[int], bool]) -> int | None:
        return None


class Second(OneUseFirst):
    def __init__(self, next_use: NextUses) -> None:
        super().__init__(next_use)
        self.repeated: OrderedDict[int, None] = OrderedDict()

    def place_repeated(self, k: int) -> None:
        self.repeated[k] = None

    def forget(self, k: int) -> None:
        super().forget(k)
        self.repeated.pop(k, None)

    def repeated_victim(self, ok: Callable[[int], bool]) -> int | None:
        return next((x for x in self.repeated if ok(x)), None)


class Ranked(OneUseFirst):
    """Repeated blocks in two lazily cleaned heaps: farthest expected use, earliest deadline."""

    def __init__(self, next_use: NextUses) -> None:
        super().__init__(next_use)
        self.version: dict[int, int] = {}
        self.far: list[tuple[int, int, int]] = []
        self.due: list[tuple[int, int, int]] = []

    @abstractmethod
    def expected(self, k: int) -> tuple[int, int]:
        """(expected next use, deadline after which the block counts as dead)."""

    def place_repeated(self, k: int) -> None:
        v = self.version[k] = self.version.get(k, 0) + 1
        when, deadline = self.expected(k)
        heapq.heappush(self.far, (-when, v, k))
        heapq.heappush(self.due, (deadline, v, k))

    def forget(self, k: int) -> None:
        super().forget(k)
        if k in self.version:
            self.version[k] += 1

    def _pop(self, heap: list[tuple[int, int, int]], ok: Callable[[int], bool], due_only: bool) -> int | None:
        skipped, found = [], None
        while heap:
            key, v, k = heap[0]
            if self.version.get(k) != v:
                heapq.heappop(heap)
                continue
            if due_only and key >= self.now:
                break
            heapq.heappop(heap)
            if ok(k):
                found = k
                break
            skipped.append((key, v, k))
        for e in skipped:
            heapq.heappush(heap, e)
        return found

    def doomed(self, ok: Callable[[int], bool]) -> int | None:
        return self._pop(self.due, ok, due_only=True)

    def repeated_victim(self, ok: Callable[[int], bool]) -> int | None:
        return self._pop(self.far, ok, due_only=False)


class Oracle(Ranked):
    def expected(self, k: int) -> tuple[int, int]:
        when = self.next_use[self.now].get(k, NEVER)
        return when, (self.now if when == NEVER else NEVER)


class LastGap(Ranked):
    def expected(self, k: int) -> tuple[int, int]:
        g = self.gap[k]
        return self.now + g, self.now + 2 * g + 50


class Alive(Ranked):
    def expected(self, k: int) -> tuple[int, int]:
        dead = self.next_use[self.now].get(k, NEVER) == NEVER
        return -self.now, (self.now if dead else NEVER)  # farthest `when` = least recently used


MAX_TURN = 16
MAX_USES = 4
AGE_BUCKETS = 64
#: How far ahead `density` counts a return as a hit, in requests (about the gap to a next turn's
#: 75th percentile on the conversation trace; 100 to 3000 give the same share within a point).
DENSITY_HORIZON = 1000


def age_bucket(age: int) -> int:
    """Exact below 8, then two buckets per doubling (the live index's `lhd` buckets)."""
    if age < 8:
        return age
    bits = age.bit_length()
    return min(8 + 2 * (bits - 4) + ((age >> (bits - 2)) & 1), AGE_BUCKETS - 1)


def bucket_start(b: int) -> int:
    """The youngest age in bucket `b`."""
    if b < 8:
        return b
    bits, half = 4 + (b - 8) // 2, (b - 8) % 2
    return (1 << (bits - 1)) | (half << (bits - 2))


def conversation_turns(requests: Requests) -> list[int]:
    """Each request's turn in its conversation (see the module docstring)."""
    last_user: dict[int, int] = {}
    turns: list[int] = []
    for r, (keys, _) in enumerate(requests):
        seen = 0
        while seen < len(keys) and keys[seen] in last_user:
            seen += 1
        turns.append(turns[last_user[keys[seen - 1]]] + 1 if seen >= 2 else 1)
        for k in keys:
            last_user[k] = r
    return turns


def use_class(turn: int, uses: int) -> int:
    """The class `odds` and `density` score a block by: its turn (1-16+) and use count (1-4+)."""
    return MAX_USES * (min(turn, MAX_TURN) - 1) + min(uses, MAX_USES) - 1


ScoreTable = dict[int, list[float]]


def class_gaps(requests: Requests, next_use: NextUses, turns: list[int]) -> list[tuple[int, int]]:
    """(class, gap to the next use or NEVER) of every block use in the trace."""
    gaps: list[tuple[int, int]] = []
    uses: dict[int, int] = {}
    for r, (keys, _) in enumerate(requests):
        for k in set(keys):
            uses[k] = uses.get(k, 0) + 1
            nxt = next_use[r][k]
            gaps.append((use_class(turns[r], uses[k]), NEVER if nxt == NEVER else nxt - r))
    return gaps


def odds_table(gaps: list[tuple[int, int]]) -> ScoreTable:
    """Per class and age bucket: the share of the blocks still unused at the bucket's start that
    are used again."""
    waiting: dict[int, list[int]] = {}
    returning: dict[int, list[int]] = {}
    for c, gap in gaps:
        w = waiting.setdefault(c, [0] * AGE_BUCKETS)
        back = returning.setdefault(c, [0] * AGE_BUCKETS)
        for b in range(AGE_BUCKETS):
            if gap <= bucket_start(b):
                break
            w[b] += 1
            back[b] += gap != NEVER
    return {c: [h / n if n else 0.0 for h, n in zip(returning[c], w, strict=True)] for c, w in waiting.items()}


def density_table(gaps: list[tuple[int, int]]) -> ScoreTable:
    """Per class and age bucket, hit density (after LHD): of the blocks still unused at the
    bucket's start, the returns within DENSITY_HORIZON requests per request of cache space they
    hold until then."""
    hits: dict[int, list[int]] = {}
    held: dict[int, list[int]] = {}
    starts = [bucket_start(b) for b in range(AGE_BUCKETS)]
    for c, gap in gaps:
        h = hits.setdefault(c, [0] * AGE_BUCKETS)
        space = held.setdefault(c, [0] * AGE_BUCKETS)
        for b, start in enumerate(starts):
            if gap <= start:
                break
            if gap - start <= DENSITY_HORIZON:
                h[b] += 1
                space[b] += gap - start
            else:
                space[b] += DENSITY_HORIZON
    return {c: [n / s if s else 0.0 for n, s in zip(hits[c], space, strict=True)] for c, space in held.items()}


class Scored(Policy):
    """Every block by `score[class][age bucket]` (`odds_table`, `density_table`), lowest first,
    ties least recently used. Per class one list in placement order: its head, the class's
    oldest block, is its candidate (the scores falling with age)."""

    def __init__(self, next_use: NextUses, turns: list[int], score: ScoreTable) -> None:
        super().__init__(next_use)
        self.turns = turns
        self.score = score
        self.uses: dict[int, int] = {}
        self.lists: dict[int, OrderedDict[int, int]] = {}
        self.class_of: dict[int, int] = {}

    def begin(self, r: int, keys: list[int]) -> None:
        super().begin(r, keys)
        for k in set(keys):
            self.uses[k] = self.uses.get(k, 0) + 1

    def place(self, k: int) -> None:
        self._drop(k)
        c = self.class_of[k] = use_class(self.turns[self.now], self.uses[k])
        self.lists.setdefault(c, OrderedDict())[k] = self.now

    def _drop(self, k: int) -> None:
        c = self.class_of.pop(k, None)
        if c is not None:
            del self.lists[c][k]

    def victim(self, ok: Callable[[int], bool]) -> int | None:
        best: tuple[float, int, int] | None = None
        for c, placed in self.lists.items():
            for k, when in placed.items():
                if ok(k):
                    score = self.score[c][age_bucket(self.now - when)]
                    if best is None or (score, when) < best[:2]:
                        best = (score, when, k)
                    break
        if best is None:
            return None
        self._drop(best[2])
        return best[2]


def bounds(requests: Requests, next_use: NextUses) -> dict[str, Callable[[], Policy]]:
    """A fresh policy per bound and capacity; what they learn from the whole trace (turns, score
    tables) is measured once here."""
    turns = conversation_turns(requests)
    gaps = class_gaps(requests, next_use, turns)
    odds, density = odds_table(gaps), density_table(gaps)
    return {
        "oracle": lambda: Oracle(next_use),
        "lastgap": lambda: LastGap(next_use),
        "second": lambda: Second(next_use),
        "alive": lambda: Alive(next_use),
        "odds": lambda: Scored(next_use, turns, odds),
        "density": lambda: Scored(next_use, turns, density),
    }


class Lru(Second):
    """Plain LRU (every block 'repeated'), the check against the planner."""

    def place(self, k: int) -> None:
        self.forget(k)
        self.place_repeated(k)


def next_uses(requests: Requests) -> NextUses:
    out: NextUses = [{} for _ in requests]
    last: dict[int, int] = {}
    for r in range(len(requests) - 1, -1, -1):
        keys = requests[r][0]
        out[r] = {k: last.get(k, NEVER) for k in keys}
        for k in keys:
            last[k] = r
    return out


def replay(requests: Requests, block_size: int, capacity: int, policy: Policy, warmup: float) -> float:
    cached: set[int] = set()
    parent: dict[int, int] = {}
    kids: dict[int, int] = {}
    first = int(len(requests) * warmup)
    hit_tokens = total_tokens = 0
    for r, (keys, n_in) in enumerate(requests):
        policy.begin(r, keys)
        current = set(keys)

        def evictable(x: int, current: set[int] = current) -> bool:
            return x not in current and kids.get(x, 0) == 0

        hits = 0
        while hits < len(keys) and keys[hits] in cached:
            hits += 1
        placed: set[int] = set()
        end = hits
        while end < len(keys):
            k = keys[end]
            if k not in cached:
                if len(cached) >= capacity:
                    v = policy.victim(evictable)
                    if v is None or not policy.replaces(policy.next_use[r][k], v):
                        break
                    cached.discard(v)
                    p = parent.pop(v, None)
                    if p is not None:
                        kids[p] -= 1
                cached.add(k)
                placed.add(k)
                if end > 0:
                    parent[k] = keys[end - 1]
                    kids[keys[end - 1]] = kids.get(keys[end - 1], 0) + 1
            end += 1
        for k in dict.fromkeys(reversed(keys[:end])):  # tail first, each key once
            policy.place(k)
        if r >= first:
            total_tokens += n_in
            hit_tokens += sum(min(block_size, n_in - i * block_size) for i in range(hits))
    return hit_tokens / total_tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--capacities", default="2048,4096")
    ap.add_argument("--warmup", type=float, default=0.5)
    args = ap.parse_args()
    if not args.trace.is_file():
        print(f"policy_bounds: trace not found: {args.trace} (pass --trace)", file=sys.stderr)
        return 2
    caps = [int(c) for c in args.capacities.split(",")]
    data = read_trace(args.trace)
    trace = build_trace(data)
    if not trace.prefix_chained:
        print(f"policy_bounds: {args.trace.name}: block ids are not prefix-chained; opt is no bound", file=sys.stderr)
        return 2
    o = data.offsets
    requests = [(list(data.keys[o[i] : o[i + 1]]), int(data.input_tokens[i])) for i in range(data.n_requests)]
    nu = next_uses(requests)
    jobs = [(p, c, "always") for p in ("lru", "opt", "lhd") for c in caps]
    planner = {
        (j["policy"], j["capacity_blocks"]): j["hit_tokens"] / j["total_tokens"]
        for j in replay_sweep(trace, jobs, warmup=args.warmup)
    }
    first_seen: dict[int, int] = {}
    for keys, _ in requests:
        for k in keys:
            first_seen.setdefault(k, len(first_seen))
    print(f"{args.trace.name}: share of the LRU -> opt gap closed (hit rate)")
    policies = bounds(requests, nu)
    print(f"{'capacity':>9} {'lru':>7} {'opt':>7} " + " ".join(f"{n:>16}" for n in ("lhd", *policies)))
    for c in caps:
        lru, opt = planner[("lru", c)], planner[("opt", c)]
        checks = {"lru": (lru, Lru(nu)), "opt": (opt, Belady(nu, first_seen))}
        for name, (theirs, policy) in checks.items():
            ours = replay(requests, data.block_size, c, policy, args.warmup)
            if abs(ours - theirs) > 1e-12:
                print(f"policy_bounds: at {c} blocks this replay's {name} ({ours}) is not the planner's ({theirs})")
                return 1
        rates = {"lhd": planner[("lhd", c)]}
        for name, make in policies.items():
            rates[name] = replay(requests, data.block_size, c, make(), args.warmup)
        gap = opt - lru
        cells = " ".join(
            f"{100 * (v - lru) / gap:6.1f}% ({v:.4f})" if gap > 1e-12 else f"{'-':>7} ({v:.4f})" for v in rates.values()
        )
        print(f"{c:>9} {lru:7.4f} {opt:7.4f} {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
