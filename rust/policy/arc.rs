//! ARC (Megiddo & Modha) adapted to a tier whose residency the index controls.
//!
//! T1 holds keys seen once, T2 keys seen again; B1/B2 are ghosts of keys evicted from them.
//! Exact semantics (mirrored by the Python reference model in tests/models.py):
//! - insert: a B1 ghost raises the target `p` by max(1, |B2| / |B1|) (capped at c) and enters T2;
//!   a B2 ghost lowers `p` by max(1, |B1| / |B2|) (floored at 0) and enters T2; others enter T1.
//! - touch: T1 -> MRU of T2; T2 -> MRU of T2.
//! - victims, one at a time: from T1 when |T1| > p, else from T2; the first evictable key from
//!   the LRU end of the chosen list, falling back to the other list when it has none.
//!   A T1 victim becomes a B1 ghost, a T2 victim a B2 ghost.
//! - ghosts are trimmed after every change: B1 while |T1| + |B1| > c, then B2 while the four
//!   lists hold more than 2c.
//!
//! The REPLACE tie rule on B2 hits is omitted: victims are chosen before the incoming keys are
//! known to the policy (stores are batched, all-or-nothing).

use hashlink::LinkedHashMap;

use super::{EvictionPolicy, InsertHint, PolicyKey, PolicyKind};

type Map<K> = LinkedHashMap<K, (), foldhash::fast::RandomState>;
type Ghosts = LinkedHashMap<u64, (), foldhash::fast::RandomState>;

pub struct Arc<K: PolicyKey> {
    capacity: usize,
    p: usize,
    t1: Map<K>,
    t2: Map<K>,
    b1: Ghosts,
    b2: Ghosts,
}

impl<K: PolicyKey> Arc<K> {
    pub fn new(capacity: usize) -> Self {
        Arc {
            capacity: capacity.max(1),
            p: 0,
            t1: Map::default(),
            t2: Map::default(),
            b1: Ghosts::default(),
            b2: Ghosts::default(),
        }
    }

    /// Adaptation target for T1's size (exposed for tests and stats).
    pub fn target_p(&self) -> usize {
        self.p
    }

    pub fn ghost_len(&self) -> (usize, usize) {
        (self.b1.len(), self.b2.len())
    }

    fn trim_ghosts(&mut self) {
        let c = self.capacity;
        while self.t1.len() + self.b1.len() > c && self.b1.pop_front().is_some() {}
        while self.t1.len() + self.t2.len() + self.b1.len() + self.b2.len() > 2 * c && self.b2.pop_front().is_some() {}
    }

    fn first_evictable(list: &Map<K>, evictable: &mut dyn FnMut(&K) -> bool) -> Option<K> {
        list.keys().find(|k| evictable(k)).cloned()
    }
}

impl<K: PolicyKey> EvictionPolicy<K> for Arc<K> {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Arc
    }

    fn insert(&mut self, key: &K, _hint: InsertHint, _now_ns: u64) {
        if self.t1.contains_key(key) || self.t2.contains_key(key) {
            return;
        }
        let ghost = key.ghost_id();
        if self.b1.contains_key(&ghost) {
            let delta = (self.b2.len() / self.b1.len()).max(1);
            self.p = (self.p + delta).min(self.capacity);
            self.b1.remove(&ghost);
            self.t2.insert(key.clone(), ());
        } else if self.b2.contains_key(&ghost) {
            let delta = (self.b1.len() / self.b2.len()).max(1);
            self.p = self.p.saturating_sub(delta);
            self.b2.remove(&ghost);
            self.t2.insert(key.clone(), ());
        } else {
            self.t1.insert(key.clone(), ());
        }
        self.trim_ghosts();
    }

    fn touch(&mut self, key: &K, _now_ns: u64) {
        if self.t1.remove(key).is_some() {
            self.t2.insert(key.clone(), ());
        } else {
            self.t2.to_back(key);
        }
    }

    fn remove(&mut self, key: &K) {
        self.t1.remove(key);
        self.t2.remove(key);
    }

    fn select_victims(&mut self, n: usize, _now_ns: u64, evictable: &mut dyn FnMut(&K) -> bool) -> Option<Vec<K>> {
        // Feasibility first, so that a failed call changes nothing.
        let available = self.t1.keys().chain(self.t2.keys()).filter(|k| evictable(k)).take(n).count();
        if available < n {
            return None;
        }
        let mut victims = Vec::with_capacity(n);
        while victims.len() < n {
            let from_t1_first = self.t1.len() > self.p;
            let pick = if from_t1_first {
                Self::first_evictable(&self.t1, evictable)
                    .map(|k| (k, true))
                    .or_else(|| Self::first_evictable(&self.t2, evictable).map(|k| (k, false)))
            } else {
                Self::first_evictable(&self.t2, evictable)
                    .map(|k| (k, false))
                    .or_else(|| Self::first_evictable(&self.t1, evictable).map(|k| (k, true)))
            };
            let (key, was_t1) = pick.expect("feasibility was checked");
            if was_t1 {
                self.t1.remove(&key);
                self.b1.insert(key.ghost_id(), ());
            } else {
                self.t2.remove(&key);
                self.b2.insert(key.ghost_id(), ());
            }
            self.trim_ghosts();
            victims.push(key);
        }
        Some(victims)
    }

    fn len(&self) -> usize {
        self.t1.len() + self.t2.len()
    }
    fn contains(&self, key: &K) -> bool {
        self.t1.contains_key(key) || self.t2.contains_key(key)
    }
    fn clear(&mut self) {
        self.t1.clear();
        self.t2.clear();
        self.b1.clear();
        self.b2.clear();
        self.p = 0;
    }
}
