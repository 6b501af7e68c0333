//! Priority eviction with TensorRT-LLM's retention semantics: levels 0..=100 (default 35), the
//! lowest level is evicted first, LRU inside a level, and a block given a duration falls back to
//! the default level once the duration has passed (lazily, before victims are chosen).
//!
//! Order is a single ordered map on (level, access sequence): ascending iteration is the
//! eviction order. An expired block keeps its access sequence when it moves to the default level,
//! so it lands among the default-level blocks by how recently it was used. That ordered insert
//! is why this policy keeps an ordered map where the others thread lists through their keys'
//! dense ids (`dense_lists`); its per-key level and order do sit at the key's dense id.
//!
//! A renewal (`renew`: a later claim of a resident block with a new hint) overrides the old
//! level and duration: the block moves to the new level as the most recent there, as a fresh
//! insert would place it, and its expiry restarts from the renewal (or is cleared when the new
//! hint has no duration, or is at the default level).

use std::collections::BTreeMap;

use super::{first_n_evictable, EvictionPolicy, InsertHint, PolicyKey, PolicyKind};

pub const DEFAULT_PRIORITY: u8 = 35;
pub const MAX_PRIORITY: u8 = 100;

#[derive(Clone, Copy)]
struct Meta {
    level: u8,
    seq: u64,
    expires_at: Option<u64>,
}

pub struct Priority<K: PolicyKey> {
    seq: u64,
    /// Each resident key's level and order, at its dense id (`PolicyKey::dense_id`).
    meta: Vec<Option<Meta>>,
    resident: usize,
    order: BTreeMap<(u8, u64), K>,
    expiry: BTreeMap<(u64, u64), K>, // (expires_at, seq)
}

impl<K: PolicyKey> Default for Priority<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: PolicyKey> Priority<K> {
    pub fn new() -> Self {
        Self::with_ids(0)
    }

    /// For keys whose dense ids are below `ids` (the table grows past that on demand).
    pub fn with_ids(ids: usize) -> Self {
        Priority { seq: 0, meta: vec![None; ids], resident: 0, order: BTreeMap::new(), expiry: BTreeMap::new() }
    }

    /// Current level of a resident key (for tests and stats).
    pub fn level_of(&self, key: &K) -> Option<u8> {
        self.meta_of(key).map(|m| m.level)
    }

    fn meta_of(&self, key: &K) -> Option<&Meta> {
        self.meta.get(key.dense_id() as usize)?.as_ref()
    }

    fn meta_mut(&mut self, key: &K) -> Option<&mut Meta> {
        self.meta.get_mut(key.dense_id() as usize)?.as_mut()
    }

    fn expire(&mut self, now_ns: u64) {
        while let Some((&(at, seq), _)) = self.expiry.first_key_value() {
            if at > now_ns {
                break;
            }
            let key = self.expiry.remove(&(at, seq)).expect("present");
            let m = self.meta_mut(&key).expect("expiry entries are resident");
            let (old_level, seq) = (m.level, m.seq);
            m.level = DEFAULT_PRIORITY;
            m.expires_at = None;
            self.order.remove(&(old_level, seq));
            self.order.insert((DEFAULT_PRIORITY, seq), key);
        }
    }

    fn detach(&mut self, key: &K) -> Option<Meta> {
        let m = self.meta.get_mut(key.dense_id() as usize)?.take()?;
        self.resident -= 1;
        self.order.remove(&(m.level, m.seq));
        if let Some(at) = m.expires_at {
            self.expiry.remove(&(at, m.seq));
        }
        Some(m)
    }
}

impl<K: PolicyKey> EvictionPolicy<K> for Priority<K> {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Priority
    }

    fn insert(&mut self, key: &K, hint: InsertHint, now_ns: u64) {
        if self.meta_of(key).is_some() {
            return;
        }
        self.seq += 1;
        let level = hint.priority.min(MAX_PRIORITY);
        let expires_at = match hint.duration_ns {
            Some(d) if level != DEFAULT_PRIORITY => Some(now_ns.saturating_add(d)),
            _ => None,
        };
        if let Some(at) = expires_at {
            self.expiry.insert((at, self.seq), *key);
        }
        self.order.insert((level, self.seq), *key);
        let i = key.dense_id() as usize;
        if i >= self.meta.len() {
            self.meta.resize((i + 1).max(self.meta.len() * 2), None);
        }
        self.meta[i] = Some(Meta { level, seq: self.seq, expires_at });
        self.resident += 1;
    }

    fn touch(&mut self, key: &K, _now_ns: u64) {
        let seq = self.seq + 1;
        let Some(m) = self.meta_mut(key) else { return };
        let old = *m;
        m.seq = seq;
        self.seq = seq;
        let k = self.order.remove(&(old.level, old.seq)).expect("resident");
        if let Some(at) = old.expires_at {
            self.expiry.remove(&(at, old.seq));
            self.expiry.insert((at, seq), k);
        }
        self.order.insert((old.level, seq), k);
    }

    fn refresh(&mut self, key: &K, now_ns: u64) {
        // A touch only moves the key to the most recent place of its level: recency alone.
        self.touch(key, now_ns);
    }

    fn renew(&mut self, key: &K, hint: InsertHint, now_ns: u64) {
        if self.detach(key).is_some() {
            self.insert(key, hint, now_ns);
        }
    }

    fn remove(&mut self, key: &K) {
        self.detach(key);
    }

    fn select_victims(&mut self, n: usize, now_ns: u64, evictable: &mut dyn FnMut(&K) -> bool) -> Option<Vec<K>> {
        self.expire(now_ns);
        let victims = first_n_evictable(self.order.values().copied(), n, evictable)?;
        for v in &victims {
            self.detach(v);
        }
        Some(victims)
    }

    fn len(&self) -> usize {
        self.resident
    }
    fn contains(&self, key: &K) -> bool {
        self.meta_of(key).is_some()
    }
    fn clear(&mut self) {
        self.meta.fill(None);
        self.resident = 0;
        self.order.clear();
        self.expiry.clear();
    }
}
