//! Priority eviction with TensorRT-LLM's retention semantics: levels 0..=100 (default 35), the
//! lowest level is evicted first, LRU inside a level, and a block given a duration falls back to
//! the default level once the duration has passed (lazily, before victims are chosen).
//!
//! Order is a single ordered map on (level, access sequence): ascending iteration is the
//! eviction order. An expired block keeps its access sequence when it moves to the default level,
//! so it lands among the default-level blocks by how recently it was used.

use std::collections::{BTreeMap, HashMap};

use super::{first_n_evictable, EvictionPolicy, InsertHint, PolicyKey, PolicyKind};

pub const DEFAULT_PRIORITY: u8 = 35;
pub const MAX_PRIORITY: u8 = 100;

struct Meta {
    level: u8,
    seq: u64,
    expires_at: Option<u64>,
}

pub struct Priority<K: PolicyKey> {
    seq: u64,
    meta: HashMap<K, Meta, foldhash::fast::RandomState>,
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
        Priority { seq: 0, meta: HashMap::default(), order: BTreeMap::new(), expiry: BTreeMap::new() }
    }

    /// Current level of a resident key (for tests and stats).
    pub fn level_of(&self, key: &K) -> Option<u8> {
        self.meta.get(key).map(|m| m.level)
    }

    fn expire(&mut self, now_ns: u64) {
        while let Some((&(at, seq), _)) = self.expiry.first_key_value() {
            if at > now_ns {
                break;
            }
            let key = self.expiry.remove(&(at, seq)).expect("present");
            let m = self.meta.get_mut(&key).expect("expiry entries are resident");
            self.order.remove(&(m.level, m.seq));
            m.level = DEFAULT_PRIORITY;
            m.expires_at = None;
            self.order.insert((m.level, m.seq), key);
        }
    }

    fn detach(&mut self, key: &K) -> Option<Meta> {
        let m = self.meta.remove(key)?;
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
        if self.meta.contains_key(key) {
            return;
        }
        self.seq += 1;
        let level = hint.priority.min(MAX_PRIORITY);
        let expires_at = match hint.duration_ns {
            Some(d) if level != DEFAULT_PRIORITY => Some(now_ns.saturating_add(d)),
            _ => None,
        };
        if let Some(at) = expires_at {
            self.expiry.insert((at, self.seq), key.clone());
        }
        self.order.insert((level, self.seq), key.clone());
        self.meta.insert(key.clone(), Meta { level, seq: self.seq, expires_at });
    }

    fn touch(&mut self, key: &K, _now_ns: u64) {
        let Some(m) = self.meta.get_mut(key) else { return };
        self.seq += 1;
        let k = self.order.remove(&(m.level, m.seq)).expect("resident");
        if let Some(at) = m.expires_at {
            self.expiry.remove(&(at, m.seq));
            self.expiry.insert((at, self.seq), k.clone());
        }
        m.seq = self.seq;
        self.order.insert((m.level, m.seq), k);
    }

    fn remove(&mut self, key: &K) {
        self.detach(key);
    }

    fn select_victims(&mut self, n: usize, now_ns: u64, evictable: &mut dyn FnMut(&K) -> bool) -> Option<Vec<K>> {
        self.expire(now_ns);
        let victims = first_n_evictable(self.order.values(), n, evictable)?;
        for v in &victims {
            self.detach(v);
        }
        Some(victims)
    }

    fn len(&self) -> usize {
        self.meta.len()
    }
    fn contains(&self, key: &K) -> bool {
        self.meta.contains_key(key)
    }
    fn clear(&mut self) {
        self.meta.clear();
        self.order.clear();
        self.expiry.clear();
    }
}
