//! LRU and FIFO: one list in insertion order; LRU moves a key to the back on use, FIFO does not.
//!
//! FIFO evicts in order of first insertion: a hit (touch, refresh, renewal, a repeated store)
//! never moves a key. A key that extends a cached chain (`insert_extending`) joins the chain's
//! place in the queue, just ahead of the chain's block before it, rather than the back: a
//! conversation leaves in the order its first blocks arrived, its newest blocks first, and a
//! block never outlives the prefix that makes it reachable. Under prefix-tree rules (only
//! leaves evicted) a key is then always ahead of its ancestors, so the front is a leaf. LRU
//! ranks an extension through the touches of its present blocks and inserts at the back.

use super::dense_lists::DenseLists;
use super::{first_n_evictable, EvictionPolicy, InsertHint, PolicyKey, PolicyKind};

const ORDER: usize = 0;

pub struct Lru<K: PolicyKey> {
    order: DenseLists<K, 1>, // front = next victim
    refresh_on_touch: bool,
}

impl<K: PolicyKey> Lru<K> {
    /// LRU over keys whose dense ids are mostly below `ids` (a tier's capacity).
    pub fn recency(ids: usize) -> Self {
        Lru { order: DenseLists::with_ids(ids), refresh_on_touch: true }
    }
    /// FIFO over keys whose dense ids are mostly below `ids`.
    pub fn fifo(ids: usize) -> Self {
        Lru { order: DenseLists::with_ids(ids), refresh_on_touch: false }
    }
}

impl<K: PolicyKey> EvictionPolicy<K> for Lru<K> {
    fn kind(&self) -> PolicyKind {
        if self.refresh_on_touch {
            PolicyKind::Lru
        } else {
            PolicyKind::Fifo
        }
    }

    fn insert(&mut self, key: &K, _hint: InsertHint, _now_ns: u64) {
        // A resident key stays where it is.
        if self.order.list_of(key).is_none() {
            self.order.push_back(ORDER, *key, 0);
        }
    }

    fn insert_extending(&mut self, key: &K, prefix: &K, hint: InsertHint, now_ns: u64) {
        if self.refresh_on_touch {
            self.insert(key, hint, now_ns);
        } else if self.order.list_of(key).is_none() {
            self.order.insert_before(ORDER, *key, prefix, 0);
        }
    }

    fn touch(&mut self, key: &K, _now_ns: u64) {
        if self.refresh_on_touch {
            self.order.move_to_back(key);
        }
    }

    fn refresh(&mut self, key: &K, now_ns: u64) {
        // An LRU touch is recency alone already; FIFO keeps arrival order.
        self.touch(key, now_ns);
    }

    fn remove(&mut self, key: &K) {
        self.order.unlink(key);
    }

    fn select_victims(&mut self, n: usize, _now_ns: u64, evictable: &mut dyn FnMut(&K) -> bool) -> Option<Vec<K>> {
        let victims = first_n_evictable(self.order.keys(ORDER), n, evictable)?;
        for v in &victims {
            self.order.unlink(v);
        }
        Some(victims)
    }

    fn len(&self) -> usize {
        self.order.len(ORDER)
    }
    fn contains(&self, key: &K) -> bool {
        self.order.list_of(key).is_some()
    }
    fn clear(&mut self) {
        self.order.clear();
    }
}
