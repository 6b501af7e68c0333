//! Counters of one tier index. Relaxed atomics: each counter is exact, the snapshot is not a
//! single instant across counters (good enough for metrics, and documented as such).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use crossbeam_utils::CachePadded;

/// Stripes of the lookup counters. A thread owns one of the first `SHARED` for as long as it
/// lives; threads beyond that many, alive at once, share the last.
const STRIPES: usize = 16;
const SHARED: usize = STRIPES - 1;

/// The lookup counters of one stripe.
#[derive(Debug, Default)]
struct LookupCounts {
    lookups: AtomicU64,
    /// One-key lookups that hit and that missed, counted apart so that the engines' per-key hot
    /// path bumps one counter instead of three; folded into `lookups`, `lookup_keys` and
    /// `hit_blocks` by `snapshot`.
    single_hits: AtomicU64,
    single_misses: AtomicU64,
    lookup_keys: AtomicU64,
    hit_blocks: AtomicU64,
}

/// Owned stripes no live thread holds; the ones never handed out are `next_fresh..SHARED`.
struct FreeStripes {
    returned: Vec<usize>,
    next_fresh: usize,
}

static FREE_STRIPES: Mutex<FreeStripes> = Mutex::new(FreeStripes { returned: Vec::new(), next_fresh: 0 });

/// A thread's stripe; an owned one goes back to `FREE_STRIPES` when the thread exits.
struct StripeLease(usize);

impl FreeStripes {
    /// An owned stripe nobody holds, else the shared one.
    fn take(&mut self) -> usize {
        self.returned.pop().unwrap_or_else(|| {
            let fresh = self.next_fresh;
            self.next_fresh = (fresh + 1).min(SHARED);
            fresh
        })
    }

    fn give_back(&mut self, stripe: usize) {
        if stripe != SHARED {
            self.returned.push(stripe);
        }
    }
}

fn free_stripes() -> std::sync::MutexGuard<'static, FreeStripes> {
    // Poisoning cannot leave the list inconsistent (each step is one push or pop).
    FREE_STRIPES.lock().unwrap_or_else(|e| e.into_inner())
}

impl StripeLease {
    fn take() -> Self {
        StripeLease(free_stripes().take())
    }
}

impl Drop for StripeLease {
    fn drop(&mut self) {
        // The thread's last adds happen before this push, and the next owner's pop takes the
        // same mutex: it continues from the counts this thread left.
        free_stripes().give_back(self.0);
    }
}

thread_local! {
    static STRIPE: StripeLease = StripeLease::take();
}

/// This thread's stripe, taken at its first lookup (the shared one if its thread-local is
/// already gone, during the thread's exit).
#[inline]
fn stripe() -> usize {
    STRIPE.try_with(|s| s.0).unwrap_or(SHARED)
}

/// Add `n` to a counter. A counter with one writer at a time (`exclusive`: a stripe's owner, or
/// the serial stripe's callers, who serialize themselves) takes a plain load and store, exact
/// without a locked add (a full barrier on x86, the largest single cost of a one-key lookup
/// after the lookup itself); a shared one takes an atomic add.
#[inline(always)]
fn add(counter: &AtomicU64, n: u64, exclusive: bool) {
    if exclusive {
        counter.store(counter.load(Relaxed).wrapping_add(n), Relaxed);
    } else {
        counter.fetch_add(n, Relaxed);
    }
}

impl LookupCounts {
    #[inline(always)]
    fn single(&self, hit: bool, exclusive: bool) {
        add(if hit { &self.single_hits } else { &self.single_misses }, 1, exclusive);
    }

    #[inline(always)]
    fn prefix(&self, keys: usize, hits: usize, exclusive: bool) {
        add(&self.lookups, 1, exclusive);
        add(&self.lookup_keys, keys as u64, exclusive);
        add(&self.hit_blocks, hits as u64, exclusive);
    }
}

#[derive(Debug, Default)]
pub struct IndexStats {
    /// Lookups are counted in the stripe of the thread that made them, each on a cache line of
    /// its own: readers never wait on writers, and with one shared set of counters two reader
    /// threads still pulled the same line back and forth on every call (criterion
    /// `lookup_threads`: 2 threads 1.1-1.4x one thread's throughput, 1.6-1.7x without the
    /// counters). A thread owns a stripe from its first lookup until it exits (`StripeLease`);
    /// while more than SHARED threads that look up are alive, the extra ones share the last
    /// stripe (a cost in speed only: its adds are atomic).
    lookup_stripes: [CachePadded<LookupCounts>; STRIPES],
    /// The lookups of callers that serialize their calls themselves (`*_serial`: the Python
    /// binding's one-key and short lookups, which hold the GIL), counted without finding this
    /// thread's stripe: a thread-local read from the extension module is a call into the dynamic
    /// loader (`__tls_get_addr`), a few ns of a one-key lookup's ~20.
    serial: CachePadded<LookupCounts>,
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
    /// Distinct present keys whose retention hint a `renew` call set.
    pub renewals: AtomicU64,
    pub removals: AtomicU64,
}

impl IndexStats {
    pub fn record_single_lookup(&self, hit: bool) {
        let stripe = stripe();
        self.lookup_stripes[stripe].single(hit, stripe != SHARED);
    }

    pub fn record_lookup(&self, keys: usize, hits: usize) {
        let stripe = stripe();
        self.lookup_stripes[stripe].prefix(keys, hits, stripe != SHARED);
    }

    /// `record_single_lookup` for a caller whose calls to the `*_serial` counters never overlap
    /// (see `serial`); overlapping calls could lose counts, never corrupt memory.
    pub fn record_single_lookup_serial(&self, hit: bool) {
        self.serial.single(hit, true);
    }

    /// `record_lookup` for a serialized caller (see `record_single_lookup_serial`).
    pub fn record_lookup_serial(&self, keys: usize, hits: usize) {
        self.serial.prefix(keys, hits, true);
    }

    /// One lookup counter summed over the stripes.
    fn lookup_sum(&self, counter: impl Fn(&LookupCounts) -> &AtomicU64) -> u64 {
        self.lookup_stripes.iter().chain(std::iter::once(&self.serial)).map(|c| counter(c).load(Relaxed)).sum()
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
            renewals: self.renewals.load(Relaxed),
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
    pub renewals: u64,
    pub removals: u64,
    /// 1 once the index has failed (see `index::failure`), else 0.
    pub failed: u64,
}

impl StatsSnapshot {
    /// (name, value) pairs in a fixed order: the one list the Python layer and metrics read.
    pub fn fields(&self) -> [(&'static str, u64); 21] {
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
            ("renewals", self.renewals),
            ("removals", self.removals),
            ("failed", self.failed),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Barrier};

    /// The stripes of `n` threads alive at once.
    fn stripes_of_live_threads(n: usize) -> Vec<usize> {
        let all_started = Arc::new(Barrier::new(n));
        let threads: Vec<_> = (0..n)
            .map(|_| {
                let all_started = all_started.clone();
                std::thread::spawn(move || {
                    let mine = stripe();
                    all_started.wait(); // nobody exits (and hands a stripe back) before all have one
                    mine
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    #[test]
    fn live_threads_never_own_the_same_stripe() {
        // Other tests' threads hold stripes too, so only uniqueness is certain here.
        for _wave in 0..3 {
            let stripes = stripes_of_live_threads(2 * STRIPES);
            let mut owned: Vec<_> = stripes.iter().copied().filter(|&s| s != SHARED).collect();
            let n_owned = owned.len();
            owned.sort_unstable();
            owned.dedup();
            assert_eq!(owned.len(), n_owned, "two live threads owned one stripe: {stripes:?}");
            assert!(stripes.iter().all(|&s| s < STRIPES));
            assert!(stripes.contains(&SHARED), "more threads than owned stripes: some share");
        }
    }

    #[test]
    fn owned_stripes_are_handed_out_once_and_reused_after_release() {
        let mut free = FreeStripes { returned: Vec::new(), next_fresh: 0 };
        let taken: Vec<_> = (0..SHARED).map(|_| free.take()).collect();
        assert_eq!(taken, (0..SHARED).collect::<Vec<_>>());
        assert_eq!(free.take(), SHARED, "all owned: the next thread shares");
        free.give_back(SHARED); // the shared stripe is never anyone's to return
        assert_eq!(free.take(), SHARED);
        free.give_back(3);
        assert_eq!(free.take(), 3, "a released stripe is owned again");
        assert_eq!(free.take(), SHARED);
    }
}
