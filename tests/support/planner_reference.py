"""An independent plain-Python model of the planner's replay semantics, for exact comparison
with the Rust engine. It shares no code with it: the policies are the plain-Python models of tests/support/models.py
(re-implemented from their documented rules with OrderedDicts), and the prefix-tree rules are
applied here by direct scans.

Semantics (as documented in `kvtier plan --help`):
- lookup: hits are the longest cached prefix of the request's blocks;
- placement from the first miss: a cached block is kept, otherwise it must pass admission and,
  when the cache is full, one victim is chosen among cached blocks outside the request (leaves
  only in tree mode); placement stops at the first block that cannot be placed;
- apply: the chain tail first, each key once: insert blocks placed by this request, touch others;
  a placed block extends the nearest block before it that the request did not place (FIFO puts
  it just ahead of that block in its queue, see models.FifoModel);
- opt: evict the candidate with the farthest next use (ties: the key first seen latest); refuse a
  block whose next use is later than that candidate's.
"""

from __future__ import annotations

from support.models import DEFAULT_PRIORITY, POLICY_MODELS

NEVER = float("inf")


class _OneVictimAtATime:
    """The planner asks for one victim per placement; the policy models themselves are the plain
    Python references shared with the live index's tests (tests/support/models.py)."""

    def __init__(self, model) -> None:
        self.model = model

    def insert(self, k):
        self.model.insert(k, DEFAULT_PRIORITY, None, 0)

    def insert_extending(self, k, prefix):
        self.model.insert_extending(k, prefix, DEFAULT_PRIORITY, None, 0)

    def touch(self, k):
        self.model.touch(k, 0)

    def victim(self, evictable):
        victims = self.model.select_victims(1, 0, evictable)
        return victims[0] if victims else None


POLICIES = {
    name: (lambda cls: lambda capacity: _OneVictimAtATime(cls(capacity)))(POLICY_MODELS[name])
    for name in ("fifo", "lru", "arc", "s3fifo", "lhd")
}


def next_uses(requests):
    """Per request, per position: index of the next request using the key (NEVER if none)."""
    last: dict = {}
    out = [None] * len(requests)
    for r in range(len(requests) - 1, -1, -1):
        keys = requests[r][0]
        out[r] = [last.get(k, NEVER) for k in keys]
        for k in keys:
            last[k] = r
    return out


def block_tokens(n_in: int, i: int, bs: int) -> int:
    return min(bs, n_in - i * bs)


class Cache:
    def __init__(self, policy: str, capacity: float, mode: str, admit_after: int, requests) -> None:
        self.policy_name = policy
        self.capacity = capacity
        self.mode = mode
        self.admit_after = admit_after
        self.cached: set = set()
        self.parent: dict = {}
        self.kids: dict = {}
        self.uses: dict = {}
        self.filled_at = None  # the request whose placement first filled the cache
        self.insertions = 0
        self.evictions = 0
        if policy == "opt":
            self.nu: dict = {}
            self.next = next_uses(requests)
            order: dict = {}
            for keys, _ in requests:
                for k in keys:
                    order.setdefault(k, len(order))
            self.first_seen = order
        elif policy != "ceiling":
            self.pol = POLICIES[policy](int(capacity))

    def children(self, k) -> int:
        return self.kids.get(k, 0)

    def step(self, r: int, keys: list, n_in: int) -> int:  # noqa: C901, PLR0912 - the reference model, written out plainly
        current = set(keys)
        for k in keys:
            self.uses[k] = self.uses.get(k, 0) + 1
        hits = 0
        while hits < len(keys) and keys[hits] in self.cached:
            hits += 1

        def evictable(k):
            if k in current:
                return False
            return self.mode == "flat" or self.children(k) == 0

        placed: set = set()
        end = hits
        while end < len(keys):
            k = keys[end]
            if k not in self.cached:
                if self.uses[k] < self.admit_after:
                    break
                if len(self.cached) >= self.capacity:
                    v = self._victim(r, end, evictable)
                    if v is None:
                        break
                    self.cached.discard(v)
                    p = self.parent.pop(v, None)
                    if p is not None:
                        self.kids[p] -= 1
                    self.evictions += 1
                self.cached.add(k)
                self.insertions += 1
                placed.add(k)
                if self.mode == "tree" and end > 0:
                    self.parent[k] = keys[end - 1]
                    self.kids[keys[end - 1]] = self.kids.get(keys[end - 1], 0) + 1
            end += 1
        if len(self.cached) >= self.capacity and self.filled_at is None:
            self.filled_at = r
        if self.policy_name == "opt":
            for i, k in enumerate(keys):
                if k in self.cached:
                    self.nu[k] = self.next[r][i]
        elif self.policy_name != "ceiling":
            seen: set = set()
            for i in range(end - 1, -1, -1):
                k = keys[i]
                if k in seen:
                    continue
                seen.add(k)
                prefix = next((p for p in reversed(keys[:i]) if p not in placed), None)
                if k not in placed:
                    self.pol.touch(k)
                elif prefix is None:
                    self.pol.insert(k)
                else:
                    self.pol.insert_extending(k, prefix)
        return hits

    def _victim(self, r, pos, evictable):
        if self.policy_name == "ceiling":
            return None
        if self.policy_name != "opt":
            return self.pol.victim(evictable)
        cands = [k for k in self.cached if evictable(k)]
        if not cands:
            return None
        best = max(cands, key=lambda k: (self.nu[k], self.first_seen[k]))
        if self.next[r][pos] > self.nu[best]:
            return None
        return best


def replay(requests, block_size, policy, capacity, *, warmup=0.5, mode="tree", admit_after=1):
    """`requests`: list of (keys, input_tokens). Returns the measured counts."""
    cap = float("inf") if policy == "ceiling" else capacity
    cache = Cache(policy, cap, mode, 1 if policy == "ceiling" else admit_after, requests)
    first = int(len(requests) * warmup)
    out = {"hit_tokens": 0, "total_tokens": 0, "hit_blocks": 0, "total_blocks": 0, "all_hit_blocks": 0}
    by_hits: dict = {}  # hit blocks -> (measured requests, their hit tokens)
    for r, (keys, n_in) in enumerate(requests):
        hits = cache.step(r, keys, n_in)
        out["all_hit_blocks"] += hits
        if r >= first:
            tokens = sum(block_tokens(n_in, i, block_size) for i in range(hits))
            out["total_tokens"] += n_in
            out["total_blocks"] += len(keys)
            out["hit_blocks"] += hits
            out["hit_tokens"] += tokens
            if hits:
                reqs, toks = by_hits.get(hits, (0, 0))
                by_hits[hits] = (reqs + 1, toks + tokens)
    # Underfilled: never full during the whole replay (the ceiling never is, and is not flagged).
    out["underfilled"] = policy != "ceiling" and cache.filled_at is None
    out["filled_at_request"] = cache.filled_at
    out["insertions"], out["evictions"] = cache.insertions, cache.evictions
    out["hit_histogram"] = [(n, *by_hits[n]) for n in sorted(by_hits)]
    return out


def replay_tiers(requests, block_size, tiers, *, warmup=0.5, mode="tree", replicas=None, shared=()):
    """`tiers`: list of (name, capacity, policy, admit_after), fastest first. `replicas`: the
    replica of each request (None: one replica); a tier named in `shared` is one cache for all
    replicas, any other one cache per replica."""
    n = max(replicas) + 1 if replicas else 1
    own = {
        (name, a): Cache(pol, cap, mode, k, requests)
        for name, cap, pol, k in tiers
        for a in ([0] if name in shared else range(n))
    }
    first = int(len(requests) * warmup)
    served = {name: 0 for name, *_ in tiers}
    miss = total = 0
    for r, (keys, n_in) in enumerate(requests):
        a = replicas[r] if replicas else 0
        caches = [own[(name, 0 if name in shared else a)] for name, *_ in tiers]
        if r >= first:
            got = 0
            for i, k in enumerate(keys):
                holder = next((t for t, c in enumerate(caches) if k in c.cached), None)
                if holder is None:
                    break
                tok = block_tokens(n_in, i, block_size)
                served[tiers[holder][0]] += tok
                got += tok
            total += n_in
            miss += n_in - got
        for c in caches:
            c.step(r, keys, n_in)
    return {"served": served, "miss_tokens": miss, "total_tokens": total}


def reuse_distances(requests):
    """Distinct other blocks referenced between a block's use and its use in a later request."""
    seq = [(r, k) for r, (keys, _) in enumerate(requests) for k in keys]
    last: dict = {}
    out = []
    for p, (r, k) in enumerate(seq):
        if k in last and seq[last[k]][0] != r:
            out.append(len({kk for _, kk in seq[last[k] + 1 : p]} - {k}))
        last[k] = p
    return out
