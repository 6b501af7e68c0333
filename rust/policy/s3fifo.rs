//! S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO with a 2-bit use
//! counter, and a ghost FIFO of keys evicted from the small queue. One-hit blocks (scans,
//! unique prompts) leave through the small queue without disturbing the main one, which is what
//! makes it scan-resistant.
//!
//! Exact semantics (mirrored by tests/support/models.py):
//! - insert: a ghost key enters M; any other key enters S. Both start with freq 0.
//! - touch: freq = min(freq + 1, 3).
//! - victims, one at a time, until n are found:
//!   * when |S| >= max(1, c/10) and S has an actionable key: take the first key of S that is
//!     evictable or was used (freq >= 1); if freq >= 1 it moves to the back of M with freq 0
//!     (a promotion, allowed even for a pinned key or a prefix-tree interior block, since it
//!     evicts nothing: otherwise such keys would pile up at the head of S, never promoted however
//!     often they are hit); else it is the victim and becomes a ghost (ghosts capped at c,
//!     oldest dropped first);
//!   * otherwise take the first evictable key of M: freq >= 1 is decremented and the key moves
//!     to the back of M; freq 0 is the victim. If M has no evictable key, S is used as above.
//! - Otherwise non-evictable keys are skipped in place; they keep their position.

use hashlink::LinkedHashMap;

use super::dense_lists::DenseLists;
use super::{EvictionPolicy, InsertHint, PolicyKey, PolicyKind};

const MAX_FREQ: u8 = 3;
const SMALL: usize = 0;
const MAIN: usize = 1;

pub struct S3Fifo<K: PolicyKey> {
    capacity: usize,
    /// S and M, each key with its use counter (front = oldest).
    queues: DenseLists<K, 2>,
    ghost: LinkedHashMap<u64, (), foldhash::fast::RandomState>,
}

impl<K: PolicyKey> S3Fifo<K> {
    /// S3-FIFO for `capacity` blocks, over keys whose dense ids are mostly below `ids`.
    pub fn new(capacity: usize, ids: usize) -> Self {
        S3Fifo { capacity: capacity.max(1), queues: DenseLists::with_ids(ids), ghost: LinkedHashMap::default() }
    }

    fn small_target(&self) -> usize {
        (self.capacity / 10).max(1)
    }

    fn first_evictable_main(&self, evictable: &mut dyn FnMut(&K) -> bool) -> Option<(K, u8)> {
        self.queues.iter(MAIN).find(|(k, _)| evictable(k))
    }

    /// First key of S that an S step can act on: used (promote) or evictable (victim).
    fn first_actionable_small(&self, evictable: &mut dyn FnMut(&K) -> bool) -> Option<(K, u8)> {
        self.queues.iter(SMALL).find(|(k, f)| *f >= 1 || evictable(k))
    }

    /// One step on the small queue: returns a victim, or None when the key was promoted to M.
    fn step_small(&mut self, key: K, freq: u8) -> Option<K> {
        self.queues.unlink(&key);
        if freq >= 1 {
            self.queues.push_back(MAIN, key, 0);
            None
        } else {
            self.ghost.insert(key.ghost_id(), ());
            while self.ghost.len() > self.capacity {
                self.ghost.pop_front();
            }
            Some(key)
        }
    }

    fn step_main(&mut self, key: K, freq: u8) -> Option<K> {
        self.queues.unlink(&key);
        if freq >= 1 {
            self.queues.push_back(MAIN, key, freq - 1);
            None
        } else {
            Some(key)
        }
    }
}

impl<K: PolicyKey> EvictionPolicy<K> for S3Fifo<K> {
    fn kind(&self) -> PolicyKind {
        PolicyKind::S3Fifo
    }

    fn insert(&mut self, key: &K, _hint: InsertHint, _now_ns: u64) {
        if self.queues.list_of(key).is_some() {
            return;
        }
        let queue = if self.ghost.remove(&key.ghost_id()).is_some() { MAIN } else { SMALL };
        self.queues.push_back(queue, *key, 0);
    }

    fn touch(&mut self, key: &K, _now_ns: u64) {
        if let Some(f) = self.queues.aux_mut(key) {
            *f = (*f + 1).min(MAX_FREQ);
        }
    }

    fn remove(&mut self, key: &K) {
        self.queues.unlink(key);
    }

    fn select_victims(&mut self, n: usize, _now_ns: u64, evictable: &mut dyn FnMut(&K) -> bool) -> Option<Vec<K>> {
        let available = self.queues.keys(SMALL).chain(self.queues.keys(MAIN)).filter(|k| evictable(k)).take(n).count();
        if available < n {
            return None;
        }
        let mut victims = Vec::with_capacity(n);
        while victims.len() < n {
            let small_candidate = if self.queues.len(SMALL) >= self.small_target() {
                self.first_actionable_small(evictable)
            } else {
                None
            };
            let victim = if let Some((k, f)) = small_candidate {
                self.step_small(k, f)
            } else if let Some((k, f)) = self.first_evictable_main(evictable) {
                self.step_main(k, f)
            } else {
                let (k, f) = self.first_actionable_small(evictable).expect("feasible");
                self.step_small(k, f)
            };
            victims.extend(victim);
        }
        Some(victims)
    }

    fn len(&self) -> usize {
        self.queues.len(SMALL) + self.queues.len(MAIN)
    }
    fn contains(&self, key: &K) -> bool {
        self.queues.list_of(key).is_some()
    }
    fn clear(&mut self) {
        self.queues.clear();
        self.ghost.clear();
    }
}
