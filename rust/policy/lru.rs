//! LRU and FIFO: one insertion-ordered map; LRU moves a key to the back on use, FIFO does not.

use hashlink::LinkedHashMap;

use super::{first_n_evictable, EvictionPolicy, InsertHint, PolicyKey, PolicyKind};

type Map<K> = LinkedHashMap<K, (), foldhash::fast::RandomState>;

pub struct Lru<K: PolicyKey> {
    order: Map<K>, // front = next victim
    refresh_on_touch: bool,
}

impl<K: PolicyKey> Lru<K> {
    pub fn recency() -> Self {
        Lru { order: Map::default(), refresh_on_touch: true }
    }
    pub fn fifo() -> Self {
        Lru { order: Map::default(), refresh_on_touch: false }
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
        // `replace` leaves a resident key where it is: one probe instead of contains + insert.
        self.order.replace(key.clone(), ());
    }

    fn touch(&mut self, key: &K, _now_ns: u64) {
        if self.refresh_on_touch {
            self.order.to_back(key);
        }
    }

    fn remove(&mut self, key: &K) {
        self.order.remove(key);
    }

    fn select_victims(&mut self, n: usize, _now_ns: u64, evictable: &mut dyn FnMut(&K) -> bool) -> Option<Vec<K>> {
        let victims = first_n_evictable(self.order.keys(), n, evictable)?;
        for v in &victims {
            self.order.remove(v);
        }
        Some(victims)
    }

    fn len(&self) -> usize {
        self.order.len()
    }
    fn contains(&self, key: &K) -> bool {
        self.order.contains_key(key)
    }
    fn clear(&mut self) {
        self.order.clear();
    }
}
