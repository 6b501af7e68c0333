"""Plain-Python reference models of the core's eviction policies and of one tier index.

Written from the documented semantics (rust/policy/*.rs module docs, rust/index/mod.rs), not
from the Rust code, and kept deliberately simple (OrderedDicts and sorted lists). The hypothesis
state machines in test_policy_models.py drive the Rust index and these models with the same
operations and require identical results: same victims in the same order, same resident set,
same states and pins, same errors.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from itertools import islice

DEFAULT_PRIORITY = 35
Evictable = Callable[[object], bool]


def at_least(n: int, items) -> bool:
    """Whether `items` yields at least n things (stops as soon as it knows)."""
    return sum(1 for _ in islice(items, n)) == n


class PlainExtension:
    """`insert_extending` for the policies that rank by use: a plain insert (the index then
    touches the chain's present blocks, which ranks them behind the new key)."""

    def insert_extending(self, key, prefix, priority, duration_ns, now):
        self.insert(key, priority, duration_ns, now)


class FifoModel:
    """First insertion order; a hit never moves a key. A key that extends a cached chain goes
    just ahead of `prefix` (the nearest block before it in the store that was present), so it
    leaves with its chain and before it; LRU (`refresh_on_touch`) puts it at the back."""

    refresh_on_touch = False

    def __init__(self, capacity: int) -> None:
        self.order: OrderedDict = OrderedDict()  # first = next victim

    def insert(self, key, priority, duration_ns, now):
        self.order.setdefault(key, None)

    def insert_extending(self, key, prefix, priority, duration_ns, now):
        if self.refresh_on_touch or prefix not in self.order or key in self.order:
            self.insert(key, priority, duration_ns, now)
            return
        keys = list(self.order)
        keys.insert(keys.index(prefix), key)
        self.order = OrderedDict.fromkeys(keys)

    def touch(self, key, now):
        if self.refresh_on_touch and key in self.order:
            self.order.move_to_end(key)

    def renew(self, key, priority, duration_ns, now):
        pass  # the order ignores the hint, and a renewal is not a use

    def refresh(self, key, now):
        self.touch(key, now)  # an LRU touch is recency alone; FIFO keeps arrival order

    def remove(self, key):
        self.order.pop(key, None)

    def select_victims(self, n, now, evictable: Evictable):
        picked = [k for k in self.order if evictable(k)][:n]
        if len(picked) < n:
            return None
        for k in picked:
            del self.order[k]
        return picked

    def clear(self):
        self.order.clear()

    def resident(self):
        return set(self.order)


class LruModel(FifoModel):
    refresh_on_touch = True


class ArcModel(PlainExtension):
    def __init__(self, capacity: int) -> None:
        self.c = max(1, capacity)
        self.p = 0
        self.t1: OrderedDict = OrderedDict()
        self.t2: OrderedDict = OrderedDict()
        self.b1: OrderedDict = OrderedDict()
        self.b2: OrderedDict = OrderedDict()

    def _trim(self):
        while len(self.t1) + len(self.b1) > self.c and self.b1:
            self.b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.c and self.b2:
            self.b2.popitem(last=False)

    def insert(self, key, priority, duration_ns, now):
        if key in self.t1 or key in self.t2:
            return
        if key in self.b1:
            self.p = min(self.p + max(1, len(self.b2) // len(self.b1)), self.c)
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(self.p - max(1, len(self.b1) // len(self.b2)), 0)
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        self._trim()

    def touch(self, key, now):
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def renew(self, key, priority, duration_ns, now):
        pass  # the order ignores the hint, and a renewal is not a use

    def refresh(self, key, now):
        # Most recent of its own list: not a use, so a T1 key stays in T1.
        for lst in (self.t1, self.t2):
            if key in lst:
                lst.move_to_end(key)

    def remove(self, key):
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def select_victims(self, n, now, evictable: Evictable):
        if not at_least(n, (k for k in (*self.t1, *self.t2) if evictable(k))):
            return None
        out = []
        while len(out) < n:
            first = next((k for k in self.t1 if evictable(k)), None)
            second = next((k for k in self.t2 if evictable(k)), None)
            if len(self.t1) > self.p:
                key, from_t1 = (first, True) if first is not None else (second, False)
            else:
                key, from_t1 = (second, False) if second is not None else (first, True)
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
            self._trim()
            out.append(key)
        return out

    def clear(self):
        self.__init__(self.c)

    def resident(self):
        return set(self.t1) | set(self.t2)


class PriorityModel(PlainExtension):
    def __init__(self, capacity: int) -> None:
        self.seq = 0
        self.meta: dict = {}  # key -> [level, seq, expires_at or None]

    def _place(self, key, priority, duration_ns, now):
        self.seq += 1
        expires = now + duration_ns if duration_ns is not None and priority != DEFAULT_PRIORITY else None
        self.meta[key] = [priority, self.seq, expires]

    def insert(self, key, priority, duration_ns, now):
        if key not in self.meta:
            self._place(key, priority, duration_ns, now)

    def touch(self, key, now):
        if key in self.meta:
            self.seq += 1
            self.meta[key][1] = self.seq

    def renew(self, key, priority, duration_ns, now):
        # A later claim overrides the earlier one: placed as if inserted now with this hint.
        if key in self.meta:
            self._place(key, priority, duration_ns, now)

    def refresh(self, key, now):
        self.touch(key, now)  # most recent of its level: recency alone

    def remove(self, key):
        self.meta.pop(key, None)

    def select_victims(self, n, now, evictable: Evictable):
        for m in self.meta.values():
            if m[2] is not None and m[2] <= now:
                m[0], m[2] = DEFAULT_PRIORITY, None
        order = sorted(self.meta, key=lambda k: (self.meta[k][0], self.meta[k][1]))
        picked = [k for k in order if evictable(k)][:n]
        if len(picked) < n:
            return None
        for k in picked:
            del self.meta[k]
        return picked

    def clear(self):
        self.meta.clear()

    def resident(self):
        return set(self.meta)


class S3FifoModel(PlainExtension):
    def __init__(self, capacity: int) -> None:
        self.c = max(1, capacity)
        self.small: OrderedDict = OrderedDict()  # key -> freq
        self.main: OrderedDict = OrderedDict()
        self.ghost: OrderedDict = OrderedDict()

    def insert(self, key, priority, duration_ns, now):
        if key in self.small or key in self.main:
            return
        if key in self.ghost:
            del self.ghost[key]
            self.main[key] = 0
        else:
            self.small[key] = 0

    def touch(self, key, now):
        q = self.small if key in self.small else self.main if key in self.main else None
        if q is not None:
            q[key] = min(q[key] + 1, 3)

    def renew(self, key, priority, duration_ns, now):
        pass  # the order ignores the hint, and a renewal is not a use

    def refresh(self, key, now):
        pass  # both queues keep arrival order, and a refresh is no use to count

    def remove(self, key):
        self.small.pop(key, None)
        self.main.pop(key, None)

    def _small_step(self, key):
        freq = self.small.pop(key)
        if freq >= 1:
            self.main[key] = 0
            return None
        self.ghost[key] = None
        while len(self.ghost) > self.c:
            self.ghost.popitem(last=False)
        return key

    def _main_step(self, key):
        freq = self.main.pop(key)
        if freq >= 1:
            self.main[key] = freq - 1
            return None
        return key

    def select_victims(self, n, now, evictable: Evictable):
        if not at_least(n, (k for k in (*self.small, *self.main) if evictable(k))):
            return None
        out = []
        while len(out) < n:
            # In S, a used key is promoted even when it cannot be evicted (promotion frees nothing).
            s = next((k for k in self.small if self.small[k] >= 1 or evictable(k)), None)
            m = next((k for k in self.main if evictable(k)), None)
            if len(self.small) >= max(1, self.c // 10) and s is not None:
                v = self._small_step(s)
            elif m is not None:
                v = self._main_step(m)
            else:
                v = self._small_step(s)
            if v is not None:
                out.append(v)
        return out

    def clear(self):
        self.__init__(self.c)

    def resident(self):
        return set(self.small) | set(self.main)


class HitDensityModel(PlainExtension):
    """Hit density (rust/policy/lhd.rs): per use class, a list in placement order; the oldest of
    each class is a candidate and the one whose learned density at its age is lowest goes.
    Use counts are exact here; the core's count-min sketch (at least 2^20 wide, halved every
    2^20 or more uses) agrees on the few dozen keys and few thousand uses of a test. Time stamps
    are exact too; the core's epoch moves only after 2^32 placements."""

    leaves_only = True  # the index offers only blocks that no resident block extends
    CLASSES = 3
    BUCKETS = 64
    DECAY = 0.9

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lists = [OrderedDict() for _ in range(self.CLASSES)]  # key -> stamp, first = oldest
        self.uses: Counter = Counter()
        self.clock = 0
        self.hits = [[0.0] * self.BUCKETS for _ in range(self.CLASSES)]
        self.evictions = [[0.0] * self.BUCKETS for _ in range(self.CLASSES)]
        self.density = [[1.0] * self.BUCKETS for _ in range(self.CLASSES)]
        self.evicted = 0
        self.every = max(64, capacity // 8)

    @classmethod
    def bucket(cls, age: int) -> int:
        if age < 8:
            return age
        bits = age.bit_length()
        return min(8 + 2 * (bits - 4) + ((age >> (bits - 2)) & 1), cls.BUCKETS - 1)

    def _record_use(self, key) -> int:
        self.uses[key] = min(self.uses[key] + 1, 255)
        return min(self.uses[key].bit_length() - 1, self.CLASSES - 1)

    def _find(self, key):
        return next((c for c, lst in enumerate(self.lists) if key in lst), None)

    def _place(self, key, c):
        self.clock += 1
        self.lists[c][key] = self.clock

    def insert(self, key, priority, duration_ns, now):
        if self._find(key) is None:
            self._place(key, self._record_use(key))

    def touch(self, key, now):
        c = self._find(key)
        if c is None:
            return
        self.hits[c][self.bucket(self.clock - self.lists[c].pop(key))] += 1.0
        self._place(key, self._record_use(key))

    def renew(self, key, priority, duration_ns, now):
        """Nothing: the order ignores the hint, and a renewal is not a use."""

    def refresh(self, key, now):
        c = self._find(key)
        if c is not None:
            del self.lists[c][key]
            self._place(key, c)

    def remove(self, key):
        c = self._find(key)
        if c is not None:
            del self.lists[c][key]

    def _rebuild(self):
        for c in range(self.CLASSES):
            hits = events = life = 0.0
            for b in reversed(range(self.BUCKETS)):
                hits += self.hits[c][b]
                events += self.hits[c][b] + self.evictions[c][b]
                life += events
                self.density[c][b] = hits / life if life > 0 else 0.0
            for b in range(self.BUCKETS):
                self.hits[c][b] *= self.DECAY
                self.evictions[c][b] *= self.DECAY

    def select_victims(self, n, now, evictable: Evictable):
        if not at_least(n, (k for lst in self.lists for k in lst if evictable(k))):
            return None
        out = []
        while len(out) < n:
            best = None
            for c, lst in enumerate(self.lists):
                k = next((k for k in lst if evictable(k)), None)
                if k is not None:
                    b = self.bucket(self.clock - lst[k])
                    if best is None or self.density[c][b] < best[0]:
                        best = (self.density[c][b], k, c, b)
            _, k, c, b = best
            del self.lists[c][k]
            self.evictions[c][b] += 1.0
            self.evicted += 1
            if self.evicted == self.every:
                self.evicted = 0
                self._rebuild()
            out.append(k)
        return out

    def clear(self):
        self.__init__(self.capacity)

    def resident(self):
        return {k for lst in self.lists for k in lst}


POLICY_MODELS = {
    "fifo": FifoModel,
    "lru": LruModel,
    "arc": ArcModel,
    "priority": PriorityModel,
    "s3fifo": S3FifoModel,
    "lhd": HitDensityModel,
}


class NoSpace(Exception):
    pass


class NotReady(Exception):
    pass


class NotPinned(Exception):
    pass


class IndexModel:
    """One tier index: states, pins, slots (a FIFO free list, as the core's lock-free queue)."""

    def __init__(self, capacity: int, policy: str, min_priority: int | None = None) -> None:
        self.capacity = capacity
        self.policy = POLICY_MODELS[policy](capacity)
        self.leaves_only = getattr(self.policy, "leaves_only", False)
        self.min_priority = min_priority
        # key -> {"state", "pins", "slot", "life" (which stay of the key this is), "parent"
        # ((key, life) of the block it extends, or None), "children" (resident extensions)}
        self.entries: dict = {}
        self.free = deque(range(capacity))
        self.now = 0
        self.lives = 0

    def _evictable(self, key) -> bool:
        e = self.entries.get(key)
        return e is not None and e["state"] == "ready" and e["pins"] == 0

    def _drop(self, key):
        """`key`'s block leaves; the block it extends, if still that stay, loses a child."""
        e = self.entries.pop(key)
        if e["parent"] is not None:
            pk, life = e["parent"]
            if pk in self.entries and self.entries[pk]["life"] == life:
                self.entries[pk]["children"] -= 1
        self.free.append(e["slot"])

    def _peelable(self, usable) -> int:
        """How many blocks could leave, leaves first: those with no unusable block below."""
        blocked = set()
        for k in self.entries:
            at = k
            while not usable(k) and at not in blocked:
                blocked.add(at)
                parent = self.entries[at]["parent"]
                if parent is None or parent[0] not in self.entries or self.entries[parent[0]]["life"] != parent[1]:
                    break
                at = parent[0]
        return sum(1 for k in self.entries if k not in blocked)

    def _evict(self, need, usable) -> list:
        if not self.leaves_only:
            victims = self.policy.select_victims(need, self.now, usable)
            if victims is None:
                raise NoSpace
            for v in victims:
                self._drop(v)
            return victims
        leaf = lambda k: usable(k) and self.entries[k]["children"] == 0  # noqa: E731
        victims = self.policy.select_victims(need, self.now, leaf)
        if victims is not None:
            for v in victims:
                self._drop(v)
            return victims
        if self._peelable(usable) < need:
            raise NoSpace
        out = []
        for _ in range(need):
            (v,) = self.policy.select_victims(1, self.now, leaf)
            self._drop(v)
            out.append(v)
        return out

    def lookup_prefix(self, keys) -> int:
        n = 0
        for k in keys:
            e = self.entries.get(k)
            if e is None or e["state"] != "ready":
                break
            n += 1
        return n

    def prepare_store(self, keys, priority=DEFAULT_PRIORITY, duration_ns=None):
        keys = list(keys)
        present_before = {k for k in keys if k in self.entries}
        seen, new, skipped, refused = set(), [], [], []
        for k in keys:
            # A repeated key shares its first occurrence's fate: skipped when that one is
            # present or placed, refused when that one was refused.
            if k in self.entries or (k in seen and k not in refused):
                skipped.append(k)
            elif k in refused or (self.min_priority is not None and priority < self.min_priority):
                refused.append(k)
            else:
                new.append(k)
            seen.add(k)
        evicted = []
        if len(new) > len(self.free):
            batch = set(keys)
            evicted = self._evict(len(new) - len(self.free), lambda k: k not in batch and self._evictable(k))
        # The batch's slots are taken from the free list, then given to the chain in ascending
        # order (the core's chained lookups rely on it).
        placed = list(zip(new, sorted(self.free.popleft() for _ in new), strict=True))
        # The chain is applied tail first: each new key inserted, and each key present before
        # the store that comes before the last new key touched, once, at its first position; so
        # the head ranks as the most recent even when the store extends a stored chain.
        # A new key extends the chain of the nearest key before it that was present, if any.
        new_slot = dict(placed)
        last_new = max((keys.index(k) for k in new_slot), default=-1)
        done = set()
        for i in range(len(keys) - 1, -1, -1):
            k = keys[i]
            if k in new_slot and k not in done and keys.index(k) == i:
                self.lives += 1
                self.entries[k] = {
                    "state": "writing",
                    "pins": 0,
                    "slot": new_slot[k],
                    "life": self.lives,
                    "parent": None,
                    "children": 0,
                }
                prefix = next((p for p in reversed(keys[:i]) if p in present_before), None)
                if prefix is None:
                    self.policy.insert(k, priority, duration_ns, self.now)
                else:
                    self.policy.insert_extending(k, prefix, priority, duration_ns, self.now)
                done.add(k)
            elif k in present_before and i < last_new and keys.index(k) == i:
                self.policy.touch(k, self.now)
        # Each new key extends the key before it in the batch, if that one is resident.
        for k in new_slot:
            i = keys.index(k)
            parent = keys[i - 1] if i > 0 else None
            if parent in self.entries and parent != k:
                self.entries[k]["parent"] = (parent, self.entries[parent]["life"])
                self.entries[parent]["children"] += 1
        return placed, skipped, refused, evicted

    def complete_store(self, keys, success) -> int:
        done = 0
        for k in keys:
            e = self.entries.get(k)
            if e is None or e["state"] != "writing":
                continue
            if success:
                e["state"] = "ready"
            else:
                self._drop(k)
                self.policy.remove(k)
            done += 1
        return done

    def pin_for_load(self, keys):
        if not all(self._ready(k) for k in keys):
            raise NotReady
        for k in keys:
            self.entries[k]["pins"] += 1
        return [self.entries[k]["slot"] for k in keys]

    def _ready(self, k) -> bool:
        e = self.entries.get(k)
        return e is not None and e["state"] == "ready"

    def unpin(self, keys):
        wanted = Counter(keys)
        if not all(k in self.entries and self.entries[k]["pins"] >= n for k, n in wanted.items()):
            raise NotPinned
        for k in keys:
            self.entries[k]["pins"] -= 1

    def touch(self, keys):
        for k in reversed(keys):
            if k in self.entries:
                self.policy.touch(k, self.now)

    def refresh(self, keys):
        for k in reversed(keys):
            if k in self.entries:
                self.policy.refresh(k, self.now)

    def renew(self, keys, priority=DEFAULT_PRIORITY, duration_ns=None) -> int:
        """Every present key (ready or being written), tail-first like a store's inserts;
        returns how many distinct keys were renewed."""
        for k in reversed(keys):
            if k in self.entries:
                self.policy.renew(k, priority, duration_ns, self.now)
        return len({k for k in keys if k in self.entries})

    def remove(self, keys):
        removed = []
        for k in keys:
            if self._evictable(k):
                self._drop(k)
                self.policy.remove(k)
                removed.append(k)
        return removed

    def clear(self) -> int:
        removed = self.remove(list(self.entries))
        if not self.entries:
            self.policy.clear()
        return len(removed)
