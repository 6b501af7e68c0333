//! ARC (Megiddo & Modha) adapted to a tier whose residency the index controls.
//!
//! T1 holds keys seen once, T2 keys seen again; B1/B2 are ghosts of keys evicted from them.
//! Exact semantics (mirrored by the Python reference model in tests/support/models.py):
//! - insert: a B1 ghost raises the target `p` by max(1, |B2| / |B1|) (capped at c) and enters T2;
//!   a B2 ghost lowers `p` by max(1, |B1| / |B2|) (floored at 0) and enters T2; others enter T1.
//! - touch: T1 -> MRU of T2; T2 -> MRU of T2.
//! - refresh: MRU of the key's own list (not a use: T1 stays T1).
//! - victims, one at a time: from T1 when |T1| > p, else from T2; the first evictable key from
//!   the LRU end of the chosen list, falling back to the other list when it has none.
//!   A T1 victim becomes a B1 ghost, a T2 victim a B2 ghost.
//! - ghosts are trimmed after every change: B1 while |T1| + |B1| > c, then B2 while the four
//!   lists hold more than 2c.
//!
//! The REPLACE tie rule on B2 hits is omitted: victims are chosen before the incoming keys are
//! known to the policy (stores are batched, all-or-nothing).

use hashlink::LinkedHashMap;

use super::dense_lists::DenseLists;
use super::{EvictionPolicy, InsertHint, PolicyKey, PolicyKind};

type Ghosts = LinkedHashMap<u64, (), foldhash::fast::RandomState>;

const T1: usize = 0;
const T2: usize = 1;

pub struct Arc<K: PolicyKey> {
    capacity: usize,
    p: usize,
    /// T1 and T2, the resident lists (front = LRU end).
    lists: DenseLists<K, 2>,
    b1: Ghosts,
    b2: Ghosts,
}

impl<K: PolicyKey> Arc<K> {
    /// ARC for `capacity` blocks, over keys whose dense ids are mostly below `ids`.
    pub fn new(capacity: usize, ids: usize) -> Self {
        Arc {
            capacity: capacity.max(1),
            p: 0,
            lists: DenseLists::with_ids(ids),
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
        let (t1, t2) = (self.lists.len(T1), self.lists.len(T2));
        while t1 + self.b1.len() > c && self.b1.pop_front().is_some() {}
        while t1 + t2 + self.b1.len() + self.b2.len() > 2 * c && self.b2.pop_front().is_some() {}
    }

    fn first_evictable(&self, list: usize, evictable: &mut dyn FnMut(&K) -> bool) -> Option<K> {
        self.lists.keys(list).find(|k| evictable(k))
    }
}

impl<K: PolicyKey> EvictionPolicy<K> for Arc<K> {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Arc
    }

    fn insert(&mut self, key: &K, _hint: InsertHint, _now_ns: u64) {
        if self.lists.list_of(key).is_some() {
            return;
        }
        let ghost = key.ghost_id();
        if self.b1.contains_key(&ghost) {
            let delta = (self.b2.len() / self.b1.len()).max(1);
            self.p = (self.p + delta).min(self.capacity);
            self.b1.remove(&ghost);
            self.lists.push_back(T2, *key, 0);
        } else if self.b2.contains_key(&ghost) {
            let delta = (self.b1.len() / self.b2.len()).max(1);
            self.p = self.p.saturating_sub(delta);
            self.b2.remove(&ghost);
            self.lists.push_back(T2, *key, 0);
        } else {
            self.lists.push_back(T1, *key, 0);
        }
        self.trim_ghosts();
    }

    fn touch(&mut self, key: &K, _now_ns: u64) {
        // T1 -> MRU of T2; T2 -> MRU of T2.
        if self.lists.unlink(key).is_some() {
            self.lists.push_back(T2, *key, 0);
        }
    }

    fn refresh(&mut self, key: &K, _now_ns: u64) {
        // MRU of the list it is in: T1 stays T1 (seen once), T2 stays T2.
        self.lists.move_to_back(key);
    }

    fn remove(&mut self, key: &K) {
        self.lists.unlink(key);
    }

    fn select_victims(&mut self, n: usize, _now_ns: u64, evictable: &mut dyn FnMut(&K) -> bool) -> Option<Vec<K>> {
        // Feasibility first, so that a failed call changes nothing.
        let available = self.lists.keys(T1).chain(self.lists.keys(T2)).filter(|k| evictable(k)).take(n).count();
        if available < n {
            return None;
        }
        let mut victims = Vec::with_capacity(n);
        while victims.len() < n {
            let (first, second) = if self.lists.len(T1) > self.p { (T1, T2) } else { (T2, T1) };
            let pick = self
                .first_evictable(first, evictable)
                .map(|k| (k, first))
                .or_else(|| self.first_evictable(second, evictable).map(|k| (k, second)));
            let (key, list) = pick.expect("feasibility was checked");
            self.lists.unlink(&key);
            if list == T1 {
                self.b1.insert(key.ghost_id(), ());
            } else {
                self.b2.insert(key.ghost_id(), ());
            }
            self.trim_ghosts();
            victims.push(key);
        }
        Some(victims)
    }

    fn len(&self) -> usize {
        self.lists.len(T1) + self.lists.len(T2)
    }
    fn contains(&self, key: &K) -> bool {
        self.lists.list_of(key).is_some()
    }
    fn clear(&mut self) {
        self.lists.clear();
        self.b1.clear();
        self.b2.clear();
        self.p = 0;
    }
}
