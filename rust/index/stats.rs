//! Counters of one tier index. Relaxed atomics: each counter is exact, the snapshot is not a
//! single instant across counters (good enough for metrics, and documented as such).

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

use crossbeam_utils::CachePadded;

/// Stripes of the lookup counters; threads take them round-robin.
const STRIPES: usize = 16;

/// The lookup counters of one stripe.
#[derive(Debug, Default)]
struct LookupCounts {
    lookups: AtomicU64,
    /// One-key lookups that hit and that missed, counted apart so that the engines' per-key hot
    /// path pays one atomic add instead of three (each is a full barrier on x86, measurable at
    /// ~100 ns a lookup); folded into `lookups`, `lookup_keys` and `hit_blocks` by `snapshot`.
    single_hits: AtomicU64,
    single_misses: AtomicU64,
    lookup_keys: AtomicU64,
    hit_blocks: AtomicU64,
}

static NEXT_STRIPE: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static STRIPE: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// This thread's stripe, assigned at its first lookup.
#[inline]
fn stripe() -> usize {
    STRIPE.with(|s| match s.get() {
        usize::MAX => {
            let v = NEXT_STRIPE.fetch_add(1, Relaxed) % STRIPES;
            s.set(v);
            v
        }
        v => v,
    })
}

#[derive(Debug, Default)]
pub struct IndexStats {
    /// Lookups are counted in the stripe of the thread that made them, each on a cache line of
    /// its own: readers never wait on writers, and with one shared set of counters two reader
    /// threads still pulled the same line back and forth on every call (criterion
    /// `lookup_threads`: 2 threads 1.1-1.4x one thread's throughput, 1.6-1.7x without the
    /// counters). Stripes go to threads round-robin in the order they first look up, and are
    /// never handed back: the first STRIPES such threads each have one to themselves, later
    /// ones may share (a cost in speed only: the adds stay atomic).
    lookup_stripes: [CachePadded<LookupCounts>; STRIPES],
    pub stores_prepared: AtomicU64,
    pub store_skipped: AtomicU64,
    pub store_refused: AtomicU64,
    pub store_no_space: AtomicU64,
    pub stores_completed: AtomicU64,
    pub stores_failed: AtomicU64,
    pub evictions: AtomicU64,
    pub pins: AtomicU64,
    pub pin_failures: AtomicU64,
    pub unpins: AtomicU64,
    pub touches: AtomicU64,
    pub removals: AtomicU64,
}

impl IndexStats {
    fn mine(&self) -> &LookupCounts {
        &self.lookup_stripes[stripe()]
    }

    pub fn record_single_lookup(&self, hit: bool) {
        let c = self.mine();
        if hit {
            c.single_hits.fetch_add(1, Relaxed);
        } else {
            c.single_misses.fetch_add(1, Relaxed);
        }
    }

    pub fn record_lookup(&self, keys: usize, hits: usize) {
        let c = self.mine();
        c.lookups.fetch_add(1, Relaxed);
        c.lookup_keys.fetch_add(keys as u64, Relaxed);
        c.hit_blocks.fetch_add(hits as u64, Relaxed);
    }

    /// One lookup counter summed over the stripes.
    fn lookup_sum(&self, counter: impl Fn(&LookupCounts) -> &AtomicU64) -> u64 {
        self.lookup_stripes.iter().map(|c| counter(c).load(Relaxed)).sum()
    }

    /// The counters, with the gauges the index reads itself (occupancy, whether it failed).
    pub fn snapshot(&self, capacity: usize, resident: usize, pinned: u64, writing: u64, failed: bool) -> StatsSnapshot {
        let (single_hits, single_misses) = (self.lookup_sum(|c| &c.single_hits), self.lookup_sum(|c| &c.single_misses));
        let singles = single_hits + single_misses;
        StatsSnapshot {
            capacity_blocks: capacity as u64,
            resident_blocks: resident as u64,
            pinned_blocks: pinned,
            writing_blocks: writing,
            lookups: self.lookup_sum(|c| &c.lookups) + singles,
            lookup_keys: self.lookup_sum(|c| &c.lookup_keys) + singles,
            hit_blocks: self.lookup_sum(|c| &c.hit_blocks) + single_hits,
            stores_prepared: self.stores_prepared.load(Relaxed),
            store_skipped: self.store_skipped.load(Relaxed),
            store_refused: self.store_refused.load(Relaxed),
            store_no_space: self.store_no_space.load(Relaxed),
            stores_completed: self.stores_completed.load(Relaxed),
            stores_failed: self.stores_failed.load(Relaxed),
            evictions: self.evictions.load(Relaxed),
            pins: self.pins.load(Relaxed),
            pin_failures: self.pin_failures.load(Relaxed),
            unpins: self.unpins.load(Relaxed),
            touches: self.touches.load(Relaxed),
            removals: self.removals.load(Relaxed),
            failed: u64::from(failed),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub capacity_blocks: u64,
    pub resident_blocks: u64,
    pub pinned_blocks: u64,
    pub writing_blocks: u64,
    pub lookups: u64,
    pub lookup_keys: u64,
    pub hit_blocks: u64,
    pub stores_prepared: u64,
    pub store_skipped: u64,
    pub store_refused: u64,
    pub store_no_space: u64,
    pub stores_completed: u64,
    pub stores_failed: u64,
    pub evictions: u64,
    pub pins: u64,
    pub pin_failures: u64,
    pub unpins: u64,
    pub touches: u64,
    pub removals: u64,
    /// 1 once the index has failed (see `index::failure`), else 0.
    pub failed: u64,
}

impl StatsSnapshot {
    /// (name, value) pairs in a fixed order: the one list the Python layer and metrics read.
    pub fn fields(&self) -> [(&'static str, u64); 20] {
        [
            ("capacity_blocks", self.capacity_blocks),
            ("resident_blocks", self.resident_blocks),
            ("pinned_blocks", self.pinned_blocks),
            ("writing_blocks", self.writing_blocks),
            ("lookups", self.lookups),
            ("lookup_keys", self.lookup_keys),
            ("hit_blocks", self.hit_blocks),
            ("stores_prepared", self.stores_prepared),
            ("store_skipped", self.store_skipped),
            ("store_refused", self.store_refused),
            ("store_no_space", self.store_no_space),
            ("stores_completed", self.stores_completed),
            ("stores_failed", self.stores_failed),
            ("evictions", self.evictions),
            ("pins", self.pins),
            ("pin_failures", self.pin_failures),
            ("unpins", self.unpins),
            ("touches", self.touches),
            ("removals", self.removals),
            ("failed", self.failed),
        ]
    }
}
