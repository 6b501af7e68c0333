//! Hit density (after Beckmann et al., "LHD: Improving Cache Hit Rate by Maximizing Hit
//! Density", NSDI'18): evict the block expected to yield the fewest hits per unit of cache space
//! and time it would still hold, learned online from the blocks' own history.
//!
//! Why: on multi-turn traces most new blocks are never used again, and the ones that are come
//! back after gaps far longer than an LRU keeps them. A block's use count and its age since its
//! last use say how likely another hit is and how long it would wait for it; ranking by that
//! keeps the reused working set instead of the newest one-time blocks.
//!
//! Exact semantics (mirrored by tests/support/models.py):
//! - Time is a logical clock that advances by one on every insert, touch and refresh (no wall
//!   clock: the same stream of calls gives the same decisions everywhere, up to the sketch: the
//!   live index names keys to it by their per-process seeded hash, so where two keys share a
//!   counter differs between processes; the planner's keys are plain node ids).
//! - A key's use count lives in a count-min sketch of 8-bit counters, at least 2^20 and at
//!   least the tier's capacity wide, halved every width's worth of recorded uses
//!   (`FrequencySketch`): it outlives the key's stay, which is the point (a block back after a
//!   long gap is recognised), and each counter holds about one key however many pass through.
//!   Insert and touch each record one use; refresh and renew record none. The key's class is
//!   min(floor(log2(count)), CLASSES - 1).
//! - Each class keeps its keys in one list, least recently placed first; insert, touch and
//!   refresh put the key at the back of its (new) class's list, stamped with the clock.
//! - Age is clock - stamp, grouped in AGE_BUCKETS buckets (`age_bucket`: exact to 7, then two
//!   buckets per doubling; every age from 3 * 2^29 on falls in the last one). A stamp is kept in 32
//!   bits relative to an epoch (the lists' spare word, no memory of its own); when the clock
//!   runs 2^32 past the epoch, the epoch moves up 2^31 and older stamps are raised to it, which
//!   changes no bucket.
//! - A touch counts a hit at (old class, bucket of its age); an eviction counts an eviction at
//!   (class, bucket of its age). Every `recompute_every` evictions (max(64, capacity / 8)) each
//!   class's density is rebuilt from those counts, from the oldest bucket down:
//!   hits += H[b]; events += H[b] + E[b]; life += events; density[b] = hits / life (0 when
//!   life is 0), and then every count is multiplied by DECAY. Densities start at 1.0.
//! - Victims, one at a time: the first evictable key of each class's list is a candidate
//!   (the oldest of its class); the candidate with the lowest density[class][bucket(age)] is
//!   evicted (ties: the lower class). `select_victims` is all-or-nothing.
//! - remove drops a key without counting an eviction; clear forgets everything, learned
//!   densities and counts included.
//! - It asks for leaves only (`leaves_only`): a chain's head is often used no more than its
//!   tail yet older, so a learned density may rank it lower; the index then offers only blocks
//!   that no resident block extends. Without that rule the live index stranded tails and lost
//!   most of the gain (and fell below LRU on the Mooncake synthetic trace at 16000 blocks).

use super::dense_lists::DenseLists;
use super::{EvictionPolicy, InsertHint, PolicyKey, PolicyKind};
use crate::admission::FrequencySketch;

/// Use classes: 1, 2-3 and 4+ uses.
pub const CLASSES: usize = 3;
pub const AGE_BUCKETS: usize = 64;
/// How much of the learned counts each density rebuild keeps (the rest is forgotten, so the
/// densities follow a changing workload).
pub const DECAY: f64 = 0.9;
/// The sketch is at least this wide: use counts must survive a block's absence for as long as
/// a conversation pauses, and a narrow, often halved sketch forgets them (measured: a sketch a
/// few times the tier's capacity ranks no better than LRU on the Mooncake conversation trace).
pub const MIN_SKETCH_WIDTH: usize = 1 << 20;
/// How far the clock may run past the stamps' epoch before the epoch moves up by half of it.
const STAMP_SPAN: u64 = 1 << 32;

/// Bucket of an age in clock ticks: exact below 8, then two buckets per doubling.
pub fn age_bucket(age: u64) -> usize {
    if age < 8 {
        return age as usize;
    }
    let bits = 64 - age.leading_zeros() as usize; // >= 4
    let half = ((age >> (bits - 2)) & 1) as usize;
    (8 + 2 * (bits - 4) + half).min(AGE_BUCKETS - 1)
}

type Table = [[f64; AGE_BUCKETS]; CLASSES];

pub struct HitDensity<K: PolicyKey> {
    /// Per class, keys in placement order; each key's spare word is its stamp (clock at its last
    /// placement, minus `epoch`).
    lists: DenseLists<K, CLASSES, u32>,
    clock: u64,
    epoch: u64,
    stamp_span: u64,
    uses: FrequencySketch,
    hits: Box<Table>,
    evictions: Box<Table>,
    density: Box<Table>,
    evicted_since_rebuild: usize,
    recompute_every: usize,
    capacity: usize,
    ids: usize,
}

impl<K: PolicyKey> HitDensity<K> {
    /// Hit density for a tier of `capacity` blocks, over keys whose dense ids are mostly below
    /// `ids`. The sketch is sized for the smaller of the two (a planner sweep point may far
    /// exceed a trace's distinct blocks).
    pub fn new(capacity: usize, ids: usize) -> Self {
        HitDensity {
            lists: DenseLists::with_ids(ids),
            clock: 0,
            epoch: 0,
            stamp_span: STAMP_SPAN,
            uses: FrequencySketch::with_window(MIN_SKETCH_WIDTH.max(capacity.min(ids)), 1),
            hits: Box::new([[0.0; AGE_BUCKETS]; CLASSES]),
            evictions: Box::new([[0.0; AGE_BUCKETS]; CLASSES]),
            density: Box::new([[1.0; AGE_BUCKETS]; CLASSES]),
            evicted_since_rebuild: 0,
            recompute_every: (capacity / 8).max(64),
            capacity,
            ids,
        }
    }

    /// `new`, with the stamps' epoch moved every `span` ticks (tests of the move).
    #[cfg(test)]
    pub(crate) fn with_stamp_span(capacity: usize, ids: usize, span: u64) -> Self {
        HitDensity { stamp_span: span, ..Self::new(capacity, ids) }
    }

    /// Record a use of `key` and return its class.
    fn record_use(&mut self, key: &K) -> usize {
        let uses = self.uses.record(&key.ghost_id());
        ((31 - uses.leading_zeros()) as usize).min(CLASSES - 1)
    }

    fn place(&mut self, key: &K, class: usize) {
        self.clock += 1;
        if self.clock - self.epoch >= self.stamp_span {
            self.move_epoch();
        }
        self.lists.push_back(class, *key, (self.clock - self.epoch) as u32);
    }

    /// Move the epoch up half a span; stamps older than the new epoch become the epoch (their
    /// ages were past the last bucket's start already and stay there).
    fn move_epoch(&mut self) {
        let step = self.stamp_span / 2;
        self.epoch += step;
        let listed: Vec<K> = (0..CLASSES).flat_map(|c| self.lists.keys(c)).collect();
        for k in listed {
            if let Some(stamp) = self.lists.aux_mut(&k) {
                *stamp = u64::from(*stamp).saturating_sub(step) as u32;
            }
        }
    }

    fn age(&self, stamp: u32) -> u64 {
        self.clock - self.epoch - u64::from(stamp)
    }

    #[cfg(test)]
    pub(crate) fn age_of(&self, key: &K) -> Option<u64> {
        let class = self.lists.list_of(key)?;
        self.lists.iter(class).find(|(k, _)| k == key).map(|(_, stamp)| self.age(stamp))
    }

    fn rebuild_densities(&mut self) {
        for c in 0..CLASSES {
            let (mut hits, mut events, mut life) = (0.0, 0.0, 0.0);
            for b in (0..AGE_BUCKETS).rev() {
                hits += self.hits[c][b];
                events += self.hits[c][b] + self.evictions[c][b];
                life += events;
                self.density[c][b] = if life > 0.0 { hits / life } else { 0.0 };
            }
            for b in 0..AGE_BUCKETS {
                self.hits[c][b] *= DECAY;
                self.evictions[c][b] *= DECAY;
            }
        }
    }

    /// The oldest evictable key of each class, the least dense of them.
    fn least_dense(&self, evictable: &mut dyn FnMut(&K) -> bool) -> Option<(K, usize, usize)> {
        let mut best: Option<(f64, K, usize, usize)> = None;
        for c in 0..CLASSES {
            if let Some((k, stamp)) = self.lists.iter(c).find(|(k, _)| evictable(k)) {
                let b = age_bucket(self.age(stamp));
                let d = self.density[c][b];
                if best.is_none_or(|(bd, ..)| d < bd) {
                    best = Some((d, k, c, b));
                }
            }
        }
        best.map(|(_, k, c, b)| (k, c, b))
    }
}

impl<K: PolicyKey> EvictionPolicy<K> for HitDensity<K> {
    fn kind(&self) -> PolicyKind {
        PolicyKind::HitDensity
    }

    fn leaves_only(&self) -> bool {
        true
    }

    fn insert(&mut self, key: &K, _hint: InsertHint, _now_ns: u64) {
        if self.lists.list_of(key).is_some() {
            return;
        }
        let class = self.record_use(key);
        self.place(key, class);
    }

    fn touch(&mut self, key: &K, _now_ns: u64) {
        let Some((old, stamp)) = self.lists.unlink(key) else { return };
        self.hits[old][age_bucket(self.age(stamp))] += 1.0;
        let class = self.record_use(key);
        self.place(key, class);
    }

    fn refresh(&mut self, key: &K, _now_ns: u64) {
        if let Some(class) = self.lists.unlink(key).map(|(c, _)| c) {
            self.place(key, class);
        }
    }

    fn remove(&mut self, key: &K) {
        self.lists.unlink(key);
    }

    fn select_victims(&mut self, n: usize, _now_ns: u64, evictable: &mut dyn FnMut(&K) -> bool) -> Option<Vec<K>> {
        let available = (0..CLASSES).flat_map(|c| self.lists.keys(c)).filter(|k| evictable(k)).take(n).count();
        if available < n {
            return None;
        }
        let mut victims = Vec::with_capacity(n);
        while victims.len() < n {
            let (k, c, b) = self.least_dense(evictable).expect("feasible");
            self.lists.unlink(&k);
            self.evictions[c][b] += 1.0;
            self.evicted_since_rebuild += 1;
            if self.evicted_since_rebuild == self.recompute_every {
                self.evicted_since_rebuild = 0;
                self.rebuild_densities();
            }
            victims.push(k);
        }
        Some(victims)
    }

    fn len(&self) -> usize {
        (0..CLASSES).map(|c| self.lists.len(c)).sum()
    }
    fn contains(&self, key: &K) -> bool {
        self.lists.list_of(key).is_some()
    }
    fn clear(&mut self) {
        *self = HitDensity { stamp_span: self.stamp_span, ..HitDensity::new(self.capacity, self.ids) };
    }
}
