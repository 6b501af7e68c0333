//! The block index of one tier: a concurrent map from key to entry plus the tier's eviction
//! policy and admission rule.
//!
//! Concurrency design:
//! - The map is scc's `HashIndex`, whose reads (`peek`) are lock-free. `lookup_prefix` and
//!   `state_of` only read it and the entries' atomic state words: readers never wait on writers.
//!   (papaya, tried first, cost 2-3x more per insert+remove under the constant churn of a full
//!   tier; benches/rust/index.rs measures the store path.)
//! - Every operation that changes residency or policy order (prepare/complete store, pin, touch,
//!   remove, clear) takes one short mutex around the policy. Pins are taken under it, so a
//!   block's evictability can only *grow* while the mutex is held (a lock-free `unpin` may free
//!   a block, nothing can pin one). That is what makes "an eviction of n blocks frees n or
//!   changes nothing" checkable up front.
//! - An evicted entry is first claimed (Ready -> Evicting, one CAS that races safely with pins,
//!   see `entry_state`), then removed from the map, and only then is its slot freed, so a reader
//!   can never see a key pointing at a slot that now holds another block.
//!
//! Prefix awareness: batch calls receive a request's chain head-first and apply inserts and
//! touches tail-first, so every policy ranks the head as more recent and evicts the tail first.

mod entry_state;
mod stats;

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use scc::Guard;

pub use entry_state::{BlockState, EntryState};
pub use stats::{IndexStats, StatsSnapshot};

use crate::admission::{Admission, AdmissionRule};
use crate::clock::Clock;
use crate::error::{KvError, KvResult};
use crate::keys::BlockKey;
use crate::policy::{EvictionPolicy, InsertHint, PolicyKind, MAX_PRIORITY};
use crate::slots::SlotAllocator;

type Map = scc::HashIndex<BlockKey, BlockEntry, foldhash::fast::RandomState>;

/// Everything the index knows about one block.
#[derive(Debug)]
pub struct BlockEntry {
    pub state: EntryState,
    pub slot: u32,
    pub tier: u8,
    pub priority: AtomicU8,
    /// Payload bytes (the slot may be larger).
    pub size: AtomicU64,
    pub uses: AtomicU32,
    /// CRC-32C of the payload, filled by tiers that verify (disk); 0 = not recorded.
    pub checksum: AtomicU32,
}

#[derive(Clone, Debug)]
pub struct IndexConfig {
    pub capacity: usize,
    pub policy: PolicyKind,
    pub admission: AdmissionRule,
    pub tier: u8,
    pub manual_clock: bool,
    /// Bytes recorded as each block's size by default.
    pub block_bytes: u64,
}

impl IndexConfig {
    pub fn new(capacity: usize) -> Self {
        IndexConfig {
            capacity,
            policy: PolicyKind::Lru,
            admission: AdmissionRule::Always,
            tier: 1,
            manual_clock: false,
            block_bytes: 0,
        }
    }
}

/// Result of an all-or-nothing `prepare_store`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct StoreOutcome {
    /// New blocks to write, in the order given, with the slot each must be written to.
    pub to_write: Vec<(BlockKey, u32)>,
    /// Keys already present (ready or being written), left alone.
    pub already_present: Vec<BlockKey>,
    /// Keys the admission rule turned away.
    pub refused: Vec<BlockKey>,
    /// Blocks evicted to make room, with the slot they occupied (already reusable).
    pub evicted: Vec<(BlockKey, u32)>,
    /// Positions in the input of `to_write`, `already_present` and `refused` (so bindings can
    /// hand back the caller's own key objects instead of building new ones).
    pub to_write_pos: Vec<usize>,
    pub already_present_pos: Vec<usize>,
    pub refused_pos: Vec<usize>,
}

struct Inner {
    policy: Box<dyn EvictionPolicy<BlockKey>>,
    admission: Admission,
}

pub struct TierIndex {
    map: Map,
    inner: Mutex<Inner>,
    slots: Arc<SlotAllocator>,
    config: IndexConfig,
    clock: Clock,
    stats: IndexStats,
}

impl TierIndex {
    pub fn new(config: IndexConfig) -> KvResult<Self> {
        if config.capacity == 0 {
            return Err(KvError::invalid("capacity", "must be at least one block"));
        }
        let slots = Arc::new(SlotAllocator::new(config.capacity));
        Self::with_slots(config, slots)
    }

    /// An index whose free slots come from `slots` (e.g. a host pool's), which must have
    /// exactly `config.capacity` slots.
    pub fn with_slots(config: IndexConfig, slots: Arc<SlotAllocator>) -> KvResult<Self> {
        if config.capacity == 0 {
            return Err(KvError::invalid("capacity", "must be at least one block"));
        }
        if slots.capacity() != config.capacity {
            return Err(KvError::invalid(
                "capacity",
                format!("{} does not match the slot allocator's {} slots", config.capacity, slots.capacity()),
            ));
        }
        let clock = if config.manual_clock { Clock::manual() } else { Clock::monotonic() };
        Ok(TierIndex {
            map: Map::with_capacity_and_hasher(config.capacity, foldhash::fast::RandomState::default()),
            inner: Mutex::new(Inner {
                policy: config.policy.build(config.capacity),
                admission: Admission::new(config.admission, config.capacity * 4),
            }),
            slots,
            config,
            clock,
            stats: IndexStats::default(),
        })
    }

    /// Insert a key known to be absent: every writer holds the policy lock and checked first.
    fn insert_entry(&self, key: BlockKey, entry: BlockEntry) {
        let inserted = self.map.insert_sync(key, entry).is_ok();
        debug_assert!(inserted, "a key was inserted twice");
    }

    pub fn config(&self) -> &IndexConfig {
        &self.config
    }
    pub fn capacity(&self) -> usize {
        self.config.capacity
    }
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// Number of blocks present (ready or being written).
    pub fn len(&self) -> usize {
        self.config.capacity - self.slots.free_count()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    // ---- lock-free reads -------------------------------------------------------------------

    /// Length of the longest prefix of `keys` whose blocks are all ready.
    pub fn lookup_prefix(&self, keys: &[BlockKey]) -> usize {
        let n: Result<usize, std::convert::Infallible> = self.lookup_prefix_lazy(keys.iter().map(|k| Ok(*k)));
        n.unwrap_or_else(|never| match never {})
    }

    /// `lookup_prefix` over keys produced one at a time, stopping at the first miss, so a
    /// caller that must convert keys (the Python binding) converts only those it examines.
    /// A conversion error is returned as is.
    pub fn lookup_prefix_lazy<E>(&self, keys: impl Iterator<Item = Result<BlockKey, E>>) -> Result<usize, E> {
        let guard = Guard::new();
        let mut n = 0usize;
        let mut examined = 0usize;
        for k in keys {
            let k = k?;
            examined += 1;
            if !self.map.peek(&k, &guard).is_some_and(|e| e.state.is_ready()) {
                break;
            }
            n += 1;
        }
        self.stats.record_lookup(examined, n);
        Ok(n)
    }

    /// The state of one key, counted as a one-key lookup (hit when ready). The engine adapters'
    /// per-key lookup (vLLM's `lookup` -> HIT / HIT_PENDING / MISS) goes through here.
    pub fn lookup_state(&self, key: &BlockKey) -> Option<BlockState> {
        let guard = Guard::new();
        let state = self.map.peek(key, &guard).map(|e| e.state.load().0);
        self.stats.record_single_lookup(state == Some(BlockState::Ready));
        state
    }

    /// Whether each key is ready (no prefix semantics).
    pub fn contains_ready(&self, keys: &[BlockKey]) -> Vec<bool> {
        let guard = Guard::new();
        keys.iter().map(|k| self.map.peek(k, &guard).is_some_and(|e| e.state.is_ready())).collect()
    }

    /// State, pins and slot of one key.
    pub fn state_of(&self, key: &BlockKey) -> Option<(BlockState, u32, u32)> {
        let guard = Guard::new();
        self.map.peek(key, &guard).map(|e| {
            let (s, p) = e.state.load();
            (s, p, e.slot)
        })
    }

    /// Run `f` on the entry of `key` while it is protected from reclamation.
    pub fn with_entry<R>(&self, key: &BlockKey, f: impl FnOnce(&BlockEntry) -> R) -> Option<R> {
        let guard = Guard::new();
        self.map.peek(key, &guard).map(f)
    }

    /// All keys with their state and slot (a snapshot, for status and tests).
    pub fn snapshot(&self) -> Vec<(BlockKey, BlockState, u32, u32)> {
        let guard = Guard::new();
        self.map
            .iter(&guard)
            .map(|(k, e)| {
                let (s, p) = e.state.load();
                (*k, s, p, e.slot)
            })
            .collect()
    }

    // ---- writes (short policy lock) ----------------------------------------------------------

    /// Reserve slots for the new blocks among `keys`, evicting if needed. All-or-nothing: on
    /// `NoSpace` nothing was evicted or reserved. Duplicates inside the batch count once, and
    /// no key of the batch is ever evicted to make room for the others.
    pub fn prepare_store(&self, keys: &[BlockKey], hint: InsertHint) -> KvResult<StoreOutcome> {
        if hint.priority > MAX_PRIORITY {
            return Err(KvError::invalid("priority", format!("{} is outside 0..=100", hint.priority)));
        }
        let now = self.clock.now_ns();
        let mut inner = self.inner.lock();
        let guard = Guard::new();
        let mut out = StoreOutcome::default();
        let mut new_keys: Vec<BlockKey> = Vec::with_capacity(keys.len());
        let mut seen =
            std::collections::HashSet::with_capacity_and_hasher(keys.len(), foldhash::fast::RandomState::default());
        for (pos, k) in keys.iter().enumerate() {
            if !seen.insert(*k) || self.map.peek(k, &guard).is_some() {
                out.already_present.push(*k);
                out.already_present_pos.push(pos);
            } else if inner.admission.offer(k, hint.priority) {
                new_keys.push(*k);
                out.to_write_pos.push(pos);
            } else {
                out.refused.push(*k);
                out.refused_pos.push(pos);
            }
        }
        self.stats.store_refused.fetch_add(out.refused.len() as u64, Ordering::Relaxed);
        self.stats.store_skipped.fetch_add(out.already_present.len() as u64, Ordering::Relaxed);

        let free = self.slots.free_count();
        if new_keys.len() > free {
            let need = new_keys.len() - free;
            let victims = inner
                .policy
                // Never evict a key of this very batch (vLLM's contract, and the only sane one:
                // the caller was just told it is present).
                .select_victims(need, now, &mut |k| {
                    !seen.contains(k) && self.map.peek(k, &guard).is_some_and(|e| e.state.is_evictable())
                });
            let Some(victims) = victims else {
                self.stats.store_no_space.fetch_add(1, Ordering::Relaxed);
                let evictable =
                    self.map.iter(&guard).filter(|(k, e)| !seen.contains(*k) && e.state.is_evictable()).count();
                return Err(KvError::NoSpace { needed: new_keys.len(), available: free + evictable });
            };
            for v in victims {
                let entry = self.map.peek(&v, &guard).expect("victims are resident");
                // Cannot fail: evictable was checked under the lock and pins are only taken
                // under it; a concurrent unpin only lowers the count.
                let claimed = entry.state.try_claim();
                debug_assert!(claimed, "victim {v:?} could not be claimed");
                let slot = entry.slot;
                self.map.remove_sync(&v);
                self.slots.release(slot);
                out.evicted.push((v, slot));
            }
            self.stats.evictions.fetch_add(out.evicted.len() as u64, Ordering::Relaxed);
        }

        // Slots first in chain order (so the head gets the lower slot), inserts tail-first.
        let mut placed = Vec::with_capacity(new_keys.len());
        for k in &new_keys {
            let slot = self.slots.alloc().expect("capacity was reserved above");
            placed.push((*k, slot));
        }
        for (k, slot) in placed.iter().rev() {
            self.insert_entry(
                *k,
                BlockEntry {
                    state: EntryState::writing(),
                    slot: *slot,
                    tier: self.config.tier,
                    priority: AtomicU8::new(hint.priority),
                    size: AtomicU64::new(self.config.block_bytes),
                    uses: AtomicU32::new(0),
                    checksum: AtomicU32::new(0),
                },
            );
            inner.policy.insert(k, hint, now);
        }
        self.stats.stores_prepared.fetch_add(placed.len() as u64, Ordering::Relaxed);
        out.to_write = placed;
        Ok(out)
    }

    /// Put back a block found on disk at open (the disk tier's recovery): a Ready entry in
    /// `slot`, which the caller took out of the allocator's free list (it never was in it).
    /// Bypasses admission (the block was admitted before the restart). Call in the order the
    /// blocks should rank, oldest first. Errors if the key is already present.
    pub fn insert_recovered(&self, key: BlockKey, slot: u32, size: u64, checksum: u32) -> KvResult<()> {
        if slot as usize >= self.config.capacity {
            return Err(KvError::invalid("slot", format!("slot {slot} out of range 0..{}", self.config.capacity)));
        }
        let now = self.clock.now_ns();
        let mut inner = self.inner.lock();
        let guard = Guard::new();
        if self.map.peek(&key, &guard).is_some() {
            return Err(KvError::invalid("key", format!("{key:?} recovered twice")));
        }
        self.insert_entry(
            key,
            BlockEntry {
                state: EntryState::ready(),
                slot,
                tier: self.config.tier,
                priority: AtomicU8::new(crate::policy::DEFAULT_PRIORITY),
                size: AtomicU64::new(size),
                uses: AtomicU32::new(0),
                checksum: AtomicU32::new(checksum),
            },
        );
        inner.policy.insert(&key, InsertHint::default(), now);
        Ok(())
    }

    /// Finish stores: success makes blocks readable; failure drops them and frees their slots.
    /// Keys not being written are ignored. Returns how many keys were completed or dropped.
    pub fn complete_store(&self, keys: &[BlockKey], success: bool) -> usize {
        let mut inner = self.inner.lock();
        let guard = Guard::new();
        let mut done = 0;
        for k in keys {
            let Some(entry) = self.map.peek(k, &guard) else { continue };
            if success {
                if entry.state.mark_ready() {
                    done += 1;
                }
            } else if entry.state.abandon_write() {
                let slot = entry.slot;
                self.map.remove_sync(k);
                inner.policy.remove(k);
                self.slots.release(slot);
                done += 1;
            }
        }
        let counter = if success { &self.stats.stores_completed } else { &self.stats.stores_failed };
        counter.fetch_add(done as u64, Ordering::Relaxed);
        done
    }

    /// Pin every key for a load and return their slots. All-or-nothing: if any key is not
    /// ready, nothing is pinned and `NotReady` names it.
    pub fn pin_for_load(&self, keys: &[BlockKey]) -> KvResult<Vec<u32>> {
        let _inner = self.inner.lock();
        let guard = Guard::new();
        let mut slots = Vec::with_capacity(keys.len());
        for (i, k) in keys.iter().enumerate() {
            let pinned = self.map.peek(k, &guard).and_then(|e| e.state.try_pin().map(|_| e.slot));
            match pinned {
                Some(slot) => slots.push(slot),
                None => {
                    for undo in &keys[..i] {
                        self.map.peek(undo, &guard).expect("pinned above").state.unpin();
                    }
                    self.stats.pin_failures.fetch_add(1, Ordering::Relaxed);
                    return Err(KvError::NotReady(format!("{k:?}")));
                }
            }
        }
        self.stats.pins.fetch_add(keys.len() as u64, Ordering::Relaxed);
        Ok(slots)
    }

    /// Drop one pin from each key. Lock-free. Errors (and drops no pin at all) if any key holds
    /// no pin, since that would mean a caller unpinned twice.
    pub fn unpin(&self, keys: &[BlockKey]) -> KvResult<()> {
        let guard = Guard::new();
        // A key may appear several times (one pin each), so check pins against occurrences.
        let mut wanted: std::collections::HashMap<&BlockKey, u32, foldhash::fast::RandomState> =
            std::collections::HashMap::with_capacity_and_hasher(keys.len(), Default::default());
        for k in keys {
            *wanted.entry(k).or_insert(0) += 1;
        }
        for (k, n) in &wanted {
            let ok = self.map.peek(*k, &guard).is_some_and(|e| e.state.load().1 >= *n);
            if !ok {
                return Err(KvError::NotPinned(format!("{k:?}")));
            }
        }
        for k in keys {
            if let Some(e) = self.map.peek(k, &guard) {
                e.state.unpin();
            }
        }
        self.stats.unpins.fetch_add(keys.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Record a use of each resident key (policy recency/frequency), tail-first.
    pub fn touch(&self, keys: &[BlockKey]) {
        let now = self.clock.now_ns();
        let mut inner = self.inner.lock();
        let guard = Guard::new();
        for k in keys.iter().rev() {
            if let Some(e) = self.map.peek(k, &guard) {
                e.uses.fetch_add(1, Ordering::Relaxed);
                inner.policy.touch(k, now);
            }
        }
        self.stats.touches.fetch_add(keys.len() as u64, Ordering::Relaxed);
    }

    /// Count a use toward admission without storing (e.g. a hit served by another tier).
    pub fn record_use(&self, keys: &[BlockKey]) {
        let mut inner = self.inner.lock();
        for k in keys {
            inner.admission.record_use(k);
        }
    }

    /// Remove ready, unpinned blocks. Pinned or in-flight blocks are left alone. Returns the
    /// removed keys with their freed slots.
    pub fn remove(&self, keys: &[BlockKey]) -> Vec<(BlockKey, u32)> {
        let mut inner = self.inner.lock();
        let guard = Guard::new();
        let mut removed = Vec::new();
        for k in keys {
            let Some(entry) = self.map.peek(k, &guard) else { continue };
            if entry.state.try_claim() {
                let slot = entry.slot;
                self.map.remove_sync(k);
                inner.policy.remove(k);
                self.slots.release(slot);
                removed.push((*k, slot));
            }
        }
        self.stats.removals.fetch_add(removed.len() as u64, Ordering::Relaxed);
        removed
    }

    /// Remove every block that is not pinned or being written. Returns how many were removed.
    pub fn clear(&self) -> usize {
        let keys: Vec<BlockKey> = {
            let guard = Guard::new();
            self.map.iter(&guard).map(|(k, _)| *k).collect()
        };
        let n = self.remove(&keys).len();
        let mut inner = self.inner.lock();
        if self.is_empty() {
            inner.policy.clear();
        }
        inner.admission.clear();
        n
    }

    pub fn stats(&self) -> StatsSnapshot {
        let guard = Guard::new();
        let mut pinned = 0u64;
        let mut writing = 0u64;
        for (_, e) in self.map.iter(&guard) {
            let (s, p) = e.state.load();
            pinned += u64::from(p > 0);
            writing += u64::from(s == BlockState::Writing);
        }
        self.stats.snapshot(self.capacity(), self.len(), pinned, writing)
    }

    /// Number of blocks the policy tracks as resident (must always equal `len`).
    pub fn policy_len(&self) -> usize {
        self.inner.lock().policy.len()
    }
}

#[cfg(test)]
mod tests;
