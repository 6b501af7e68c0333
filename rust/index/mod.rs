//! The block index of one tier: a concurrent map from key to slot, an arena of entries indexed
//! by slot, the tier's eviction policy and its admission rule.
//!
//! Concurrency design:
//! - The map is scc's `HashIndex`, whose reads (`peek`) are lock-free. It maps a key to its
//!   slot and the slot's generation; the entry itself (state word, priority, size, uses,
//!   checksum) lives in a fixed arena indexed by slot. `lookup_prefix` and `state_of` only read
//!   the map and the entries' atomic state words: readers never wait on writers. (papaya, tried
//!   first, cost 2-3x more per insert+remove under the constant churn of a full tier;
//!   benches/rust/index.rs measures the store path.)
//! - Every operation that changes residency or policy order (prepare store, failed store, pin,
//!   touch, renew, remove, clear) takes one short mutex around the policy. Pins are taken under
//!   it, so a block's evictability can only *grow* while the mutex is held (a lock-free `unpin`
//!   may free a block, nothing can pin one). That is what makes "an eviction of n blocks frees n
//!   or changes nothing" checkable up front.
//! - An evicted entry is first claimed (Ready -> Evicting, one CAS that races safely with pins,
//!   see `entry_state`), then removed from the map, and only then is its slot freed. A reused
//!   slot starts a new generation, and every lock-free access checks the generation it read
//!   from the map, so a reader can never see a key pointing at a slot that now holds another
//!   block.
//! - Each slot also keeps its key in a record of atomic words, a seqlock whose version is the
//!   slot's generation (`slot_key`). A chain stored in one call takes ascending slots, so a
//!   lookup walking a chain compares the slot after the previous block's first and probes the
//!   map only when that slot holds another key; writers read a victim's key there.
//! - Policies order slot numbers, not keys: choosing a victim reads the arena directly instead
//!   of probing the map, and the policy's own maps hash a u32. Ghost entries (ARC, S3-FIFO)
//!   follow the key's hash, so they survive the slot being reused.
//!
//! Prefix awareness: batch calls receive a request's chain head-first and apply inserts and
//! touches tail-first, so every policy ranks the head as more recent and evicts the tail first.
//! A policy that ranks by learned value instead (`EvictionPolicy::leaves_only`) is offered only
//! blocks that no resident block extends (`chain_links`), the planner's prefix-tree rule.

mod chain_links;
mod entry_state;
mod failure;
mod key_map;
mod slot_key;
mod stats;

use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use scc::Guard;

use chain_links::ChainLinks;
use failure::{panic_message, Failure, WriteLock};
use key_map::{KeyHasher, KeyMap, SlotRef};

pub use entry_state::{BlockState, EntryState};
pub use slot_key::{occupy_slot, probe_slot, SlotKeys};
pub use stats::{IndexStats, StatsSnapshot};

pub use crate::admission::Admit;
use crate::admission::{Admission, AdmissionRule};
use crate::clock::Clock;
use crate::error::{KvError, KvResult};
use crate::fault::FaultPoint;
use crate::keys::{BlockKey, ChainKey, KeyProbe, KeyRef};
use crate::policy::{DenseId, EvictionPolicy, InsertHint, PolicyKey, PolicyKind, DEFAULT_PRIORITY, MAX_PRIORITY};
use crate::slots::SlotAllocator;

/// A key's block as one consistent read: its slot and entry, and the state and pins read with
/// the generation check.
struct Resolved<'a> {
    slot: u32,
    entry: &'a BlockEntry,
    state: BlockState,
    pins: u32,
}

/// The distinct absent keys of a batch, in input order with their positions. A request's chain
/// rarely repeats a key, and a scan of a few dozen keys (equality compares the precomputed
/// hashes first) costs less than building a hash set (measured: set growth was ~4% of a
/// store), so small batches scan and only long ones hash.
struct AbsentKeys {
    keys: Vec<(BlockKey, usize)>,
    many: HashSet<BlockKey, KeyHasher>,
    batch_len: usize,
}

impl AbsentKeys {
    const SCAN_UP_TO: usize = 32;

    /// For a batch of `batch_len` keys. Allocates nothing until the first absent key (a store
    /// of a chain already present, the common repeat, then allocates nothing here at all).
    fn for_batch(batch_len: usize) -> Self {
        AbsentKeys { keys: Vec::new(), many: HashSet::default(), batch_len }
    }

    /// Record `key`, met at `pos`; false if the batch had it before.
    fn insert(&mut self, key: BlockKey, pos: usize) -> bool {
        if self.keys.capacity() == 0 {
            // At most the rest of the batch is absent.
            self.keys.reserve_exact(self.batch_len - pos);
        }
        if self.keys.len() < Self::SCAN_UP_TO {
            if self.keys.iter().any(|(k, _)| *k == key) {
                return false;
            }
        } else {
            if self.many.is_empty() {
                // Sized for the rest of the batch at once (growing it rehashed every key).
                self.many.reserve(self.batch_len - pos + self.keys.len());
                self.many.extend(self.keys.iter().map(|(k, _)| *k));
            }
            if !self.many.insert(key) {
                return false;
            }
        }
        self.keys.push((key, pos));
        true
    }
}

/// What the index records about the block in one slot besides its state word (the slot is the
/// arena index; the tier is the index's own). The fields describe the current generation's
/// block and are only meaningful while the caller holds a pin or an in-flight store on it.
///
/// State words live in an array of their own (`TierIndex::states`): lock-free readers touch
/// only them, and 8 to a cache line instead of 2 keeps more of a large tier's in cache.
#[derive(Debug)]
pub struct BlockEntry {
    pub priority: AtomicU8,
    /// Payload bytes (the slot may be larger).
    pub size: AtomicU64,
    pub uses: AtomicU32,
    /// CRC-32C of the payload, filled by tiers that verify (disk); 0 = not recorded.
    pub checksum: AtomicU32,
}

impl BlockEntry {
    fn vacant() -> Self {
        BlockEntry {
            priority: AtomicU8::new(DEFAULT_PRIORITY),
            size: AtomicU64::new(0),
            uses: AtomicU32::new(0),
            checksum: AtomicU32::new(0),
        }
    }

    fn reset(&self, priority: u8, size: u64, checksum: u32) {
        self.priority.store(priority, Ordering::Relaxed);
        self.size.store(size, Ordering::Relaxed);
        self.uses.store(0, Ordering::Relaxed);
        self.checksum.store(checksum, Ordering::Relaxed);
    }
}

/// The policy's name for a resident block: its slot (its dense id: the policy's lists sit in
/// an array by slot), plus its key's hash for ghost entries. Equality and hashing use the slot
/// only (one block per slot at a time).
#[derive(Clone, Copy, Debug, Default)]
struct Resident {
    slot: u32,
    key_hash: u64,
}

impl Resident {
    fn of(slot: u32, key: &BlockKey) -> Self {
        Resident { slot, key_hash: key.hash64() }
    }
}

impl PartialEq for Resident {
    fn eq(&self, other: &Self) -> bool {
        self.slot == other.slot
    }
}
impl Eq for Resident {}
impl Hash for Resident {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u32(self.slot)
    }
}
impl DenseId for Resident {
    fn dense_id(&self) -> u32 {
        self.slot
    }
}
impl PolicyKey for Resident {
    fn ghost_id(&self) -> u64 {
        self.key_hash
    }
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
    /// Keys the admission rule turned away.
    pub refused: Vec<BlockKey>,
    /// Blocks evicted to make room, with the slot they occupied (already reusable).
    pub evicted: Vec<(BlockKey, u32)>,
    /// Positions in the input of `to_write`, of the keys already present (ready or being
    /// written, left alone; also repeats within the batch) and of `refused`. Present keys are
    /// given by position only: the binding hands back the caller's own objects, and building
    /// keys for them would mean hashing keys that a chained compare recognised without.
    pub to_write_pos: Vec<usize>,
    pub already_present_pos: Vec<usize>,
    pub refused_pos: Vec<usize>,
}

impl StoreOutcome {
    /// The keys that were already present, taken from the batch `keys` given to the store.
    pub fn already_present<K: Clone>(&self, keys: &[K]) -> Vec<K> {
        self.already_present_pos.iter().map(|&p| keys[p].clone()).collect()
    }
}

/// State only writers touch, under the index's mutex.
struct Inner {
    policy: Box<dyn EvictionPolicy<Resident>>,
    admission: Admission,
    /// Parent links, for a policy that may evict only leaves (`chain_links`).
    links: Option<ChainLinks>,
}

pub struct TierIndex {
    map: KeyMap,
    states: Box<[EntryState]>,
    /// Each slot's key (see `slot_key`): writers read a victim's key here to remove it from the
    /// map; readers walking a chain compare the next slot's key instead of probing the map.
    slot_keys: SlotKeys,
    entries: Box<[BlockEntry]>,
    inner: Mutex<Inner>,
    slots: Arc<SlotAllocator>,
    config: IndexConfig,
    /// Set when a writer panicked: reads answer absent, writes are refused (`failure`).
    failure: Failure,
    /// Fault injection for tests: the next store that evicts panics right after its evictions,
    /// as a bug there would (`inject_store_panic`).
    panic_in_next_store: FaultPoint<()>,
    clock: Clock,
    stats: IndexStats,
    /// The slot of the last `lookup_state_serial`'s block (NO_SLOT after a miss): its hint.
    serial_hint: AtomicU32,
    /// Free slots taken out of the allocator for a while (`withhold_free_slots`), and how many.
    withheld: Mutex<Vec<u32>>,
    withheld_count: AtomicUsize,
}

/// The most blocks an index holds: slots are numbered in a u32, and `NO_SLOT` (u32::MAX) marks
/// "no slot". Half of that, the limit the disk tier's geometry has too.
pub const MAX_CAPACITY: usize = (u32::MAX / 2) as usize;

/// A lower bound on the memory an index takes per block, allocated at construction (state word,
/// entry, key record, policy links, map buckets; `benches/bench_memory.py` measures ~200 bytes
/// a resident block). Only used to refuse a capacity this machine cannot hold, with an error,
/// before an allocation fails and aborts the process.
const MIN_INDEX_BYTES_PER_BLOCK: u64 = 128;

/// Refuse a capacity the index cannot hold: zero, beyond `MAX_CAPACITY`, or needing more
/// memory than the machine has.
pub fn check_capacity(capacity: usize) -> KvResult<()> {
    if capacity == 0 {
        return Err(KvError::invalid("capacity", "must be at least one block"));
    }
    if capacity > MAX_CAPACITY {
        return Err(KvError::invalid(
            "capacity",
            format!("{capacity} blocks is more than the {MAX_CAPACITY} an index holds"),
        ));
    }
    let needed = capacity as u64 * MIN_INDEX_BYTES_PER_BLOCK;
    if let Some(ram) = physical_memory().filter(|&ram| needed > ram) {
        return Err(KvError::invalid(
            "capacity",
            format!(
                "{capacity} blocks need at least {:.1} GiB of index memory, more than this machine's {:.1} GiB",
                needed as f64 / (1u64 << 30) as f64,
                ram as f64 / (1u64 << 30) as f64
            ),
        ));
    }
    Ok(())
}

/// Installed physical memory, when the OS says.
fn physical_memory() -> Option<u64> {
    // SAFETY: sysconf has no preconditions.
    let (pages, page) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    (pages > 0 && page > 0).then(|| pages as u64 * page as u64)
}

impl TierIndex {
    pub fn new(config: IndexConfig) -> KvResult<Self> {
        check_capacity(config.capacity)?;
        let slots = Arc::new(SlotAllocator::new(config.capacity));
        Self::with_slots(config, slots)
    }

    /// An index whose free slots come from `slots` (e.g. a host pool's), which must have
    /// exactly `config.capacity` slots.
    pub fn with_slots(config: IndexConfig, slots: Arc<SlotAllocator>) -> KvResult<Self> {
        check_capacity(config.capacity)?;
        if slots.capacity() != config.capacity {
            return Err(KvError::invalid(
                "capacity",
                format!("{} does not match the slot allocator's {} slots", config.capacity, slots.capacity()),
            ));
        }
        let clock = if config.manual_clock { Clock::manual() } else { Clock::monotonic() };
        Ok(TierIndex {
            map: KeyMap::with_capacity(config.capacity),
            states: (0..config.capacity).map(|_| EntryState::vacant()).collect(),
            slot_keys: SlotKeys::new(config.capacity),
            entries: (0..config.capacity).map(|_| BlockEntry::vacant()).collect(),
            inner: Mutex::new({
                let policy = config.policy.build(config.capacity);
                let links = policy.leaves_only().then(|| ChainLinks::new(config.capacity));
                Inner { policy, admission: Admission::new(config.admission, config.capacity * 4), links }
            }),
            slots,
            config,
            failure: Failure::default(),
            panic_in_next_store: FaultPoint::default(),
            clock,
            stats: IndexStats::default(),
            serial_hint: AtomicU32::new(NO_SLOT),
            withheld: Mutex::new(Vec::new()),
            withheld_count: AtomicUsize::new(0),
        })
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
        // Saturating: the two counts are read one after the other while slots move.
        self.config.capacity.saturating_sub(self.slots.free_count() + self.withheld_count.load(Ordering::Acquire))
    }

    /// Take the free slots that `usable` refuses out of the free list until `return_withheld`:
    /// stores meanwhile evict to make room instead of being given them. The disk tier withholds
    /// the slots a full filesystem cannot back (never written, in a sparse file), so its index
    /// is, for a while, the size of what the filesystem holds. Under the index's lock, so that
    /// no store finds the free list emptier than it counted.
    pub fn withhold_free_slots(&self, usable: impl Fn(u32) -> bool) -> usize {
        let Ok(_inner) = self.write() else { return 0 };
        let mut withheld = self.withheld.lock();
        let (mut keep, before) = (Vec::new(), withheld.len());
        while let Some(s) = self.slots.alloc() {
            if usable(s) {
                keep.push(s);
            } else {
                withheld.push(s);
            }
        }
        self.withheld_count.store(withheld.len(), Ordering::Release);
        for s in keep {
            self.slots.release(s);
        }
        withheld.len() - before
    }

    /// Put every withheld slot back at the end of the free list (after the ones freed
    /// meanwhile, which are handed out first). Returns how many.
    pub fn return_withheld(&self) -> usize {
        if self.withheld_count.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let mut withheld = self.withheld.lock();
        // The count first: `len` may read too high a moment, never wrap below zero.
        self.withheld_count.store(0, Ordering::Release);
        for &s in withheld.iter() {
            self.slots.release(s);
        }
        std::mem::take(&mut *withheld).len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn entry(&self, slot: u32) -> &BlockEntry {
        &self.entries[slot as usize]
    }

    fn state(&self, slot: u32) -> &EntryState {
        &self.states[slot as usize]
    }

    /// Take a vacant slot for `key`'s new block (writers, `inner` locked); returns the block's
    /// generation. A reader that sees the map entry published after this sees all of it.
    fn occupy(&self, inner: &mut Inner, slot: u32, key: &BlockKey, state: BlockState, meta: (u8, u64, u32)) -> u32 {
        if let Some(links) = inner.links.as_mut() {
            links.occupied(slot);
        }
        let (priority, size, checksum) = meta;
        self.entry(slot).reset(priority, size, checksum);
        occupy_slot(self.state(slot), &self.slot_keys, slot, key, state)
    }

    /// Forget the block in `slot` (already claimed, and already out of the policy): its map
    /// entry. Returns its key. The slot's key record stays until the slot is occupied again;
    /// readers never trust it for a vacant slot.
    fn detach(&self, inner: &mut Inner, slot: u32) -> BlockKey {
        if let Some(links) = inner.links.as_mut() {
            links.left(slot, &self.states);
        }
        let key = self.slot_keys.read(slot);
        // Only this slot's entry: a map entry for the key pointing elsewhere would be a bug, and
        // removing it would orphan that slot.
        let removed = self.map.remove(&key, slot);
        assert!(removed, "slot {slot}'s key was not mapped to it");
        key
    }

    /// The key's slot, entry, state and pins, if its block is still the one the map points at.
    /// State and pins come from the same load that checked the generation: a second load could
    /// already describe the slot's next block.
    fn resolve<'g>(&'g self, key: &KeyProbe<'_>, guard: &'g Guard) -> Option<Resolved<'g>> {
        let r = self.find(key, guard)?;
        let (state, pins, generation) = self.state(r.slot).load_with_generation();
        (generation == r.generation).then_some(Resolved { slot: r.slot, entry: self.entry(r.slot), state, pins })
    }

    /// Where `key`'s block is, if it is resident: the map's candidate for its hash if that
    /// slot's record holds `key` in the candidate's generation, else the keys whose hash
    /// collided (`key_map`). Lock-free. A candidate whose slot is vacant or reused counts as
    /// absent; under the index's mutex every candidate is current.
    #[inline(always)]
    fn find(&self, key: &KeyProbe<'_>, guard: &Guard) -> Option<SlotRef> {
        if self.failure.is_set() {
            return None;
        }
        if let Some(r) = self.map.candidate(key.hash64(), guard) {
            let holds = probe_slot(self.state(r.slot), &self.slot_keys, r.slot, &key.key_ref());
            if holds.is_some_and(|(_, generation)| generation == r.generation) {
                return Some(r);
            }
        }
        self.map.collided(key, guard)
    }

    // ---- lock-free reads -------------------------------------------------------------------

    /// A reader for keys produced one at a time (the Python binding walks a list and probes
    /// with keys borrowed from it). Counting is the caller's: `record_lookup`.
    pub fn reader(&self) -> IndexReader<'_> {
        IndexReader { index: self, guard: Guard::new() }
    }

    /// Count one prefix lookup that examined `examined` keys and found `hits` ready.
    pub fn record_lookup(&self, examined: usize, hits: usize) {
        self.stats.record_lookup(examined, hits);
    }

    /// `record_lookup` for a caller that serializes its calls to the `*_serial` methods itself
    /// (the Python binding under the GIL): no thread-local to find. Overlapping calls could lose
    /// counts, never corrupt anything.
    pub fn record_lookup_serial(&self, examined: usize, hits: usize) {
        self.stats.record_lookup_serial(examined, hits);
    }

    /// Length of the longest prefix of `keys` whose blocks are all ready.
    pub fn lookup_prefix(&self, keys: &[BlockKey]) -> usize {
        let Ok(n) = self.reader().ready_prefix(keys.iter().map(Ok::<_, std::convert::Infallible>));
        self.record_lookup((n + 1).min(keys.len()), n);
        n
    }

    /// The state of one key, counted as a one-key lookup (hit when ready). The engine adapters'
    /// per-key lookup (vLLM's `lookup` -> HIT / HIT_PENDING / MISS) goes through here.
    ///
    /// Engines ask about a request's blocks one call at a time, head first, so the slot after
    /// this thread's last answer from this index is compared first (`ready_slot` explains why
    /// that is usually the one); the map is probed when it is not.
    pub fn lookup_state(&self, key: &impl ChainKey) -> Option<BlockState> {
        let me = self as *const Self as usize;
        let (owner, last) = LAST_LOOKUP.get();
        let (state, slot) = self.lookup_state_after(key, if owner == me { last } else { NO_SLOT });
        LAST_LOOKUP.set((me, slot));
        self.stats.record_single_lookup(state == Some(BlockState::Ready));
        state
    }

    /// `lookup_state` for a caller that serializes its calls to the `*_serial` methods itself
    /// (the Python binding, which holds the GIL in them): the hint is the last serial lookup's,
    /// kept in the index, and the count goes to the serial counters, so no thread-local is read
    /// (from the extension module each is a call into the dynamic loader). Overlapping calls are
    /// still correct (the hint is only a hint) but could lose counts.
    pub fn lookup_state_serial(&self, key: &impl ChainKey) -> Option<BlockState> {
        let (state, slot) = self.lookup_state_after(key, self.serial_hint.load(Ordering::Relaxed));
        self.serial_hint.store(slot, Ordering::Relaxed);
        self.stats.record_single_lookup_serial(state == Some(BlockState::Ready));
        state
    }

    /// The state of `key`'s block and its slot (NO_SLOT if absent), comparing the slot after
    /// `hint` first (the previous lookup's block). Not counted.
    #[inline(always)]
    fn lookup_state_after(&self, key: &impl ChainKey, hint: u32) -> (Option<BlockState>, u32) {
        let chained = self.probe_after(hint, &key.key_ref()).map(|(slot, state, _)| (slot, state));
        let found = chained.or_else(|| {
            let guard = Guard::new();
            self.resolve(&key.probe(), &guard).map(|r| (r.slot, r.state))
        });
        (found.map(|(_, state)| state), found.map_or(NO_SLOT, |(slot, _)| slot))
    }

    /// `key`'s slot, state and generation if its block is in the slot after `prev` (lock-free,
    /// see `slot_key::probe_slot`).
    #[inline(always)]
    fn probe_after(&self, prev: u32, key: &KeyRef<'_>) -> Option<(u32, BlockState, u32)> {
        let next = prev.checked_add(1).filter(|&s| (s as usize) < self.config.capacity && !self.failure.is_set())?;
        probe_slot(self.state(next), &self.slot_keys, next, key).map(|(state, generation)| (next, state, generation))
    }

    /// Where `key`'s block is, for a walk along a chain: `after` is the slot of the chain's
    /// previous block, and the slot after it is compared first, since blocks of a chain stored
    /// in one call take ascending, usually adjacent slots (`prepare_store`). Only when that slot
    /// holds another key is `key` hashed and the map probed (`find`); on a miss the probe is
    /// handed back, so a writer can keep the key without hashing it again. Lock-free; under the
    /// index's mutex the answer is current.
    #[inline(always)]
    fn locate<'k>(&self, key: &'k impl ChainKey, after: Option<u32>, guard: &Guard) -> Result<SlotRef, KeyProbe<'k>> {
        if let Some((slot, _, generation)) = after.and_then(|prev| self.probe_after(prev, &key.key_ref())) {
            return Ok(SlotRef { slot, generation });
        }
        let probe = key.probe();
        self.find(&probe, guard).ok_or(probe)
    }

    /// The slot of `key`'s block if it is ready (`after`: see `locate`).
    #[inline]
    fn ready_slot(&self, key: &impl ChainKey, after: Option<u32>, guard: &Guard) -> Option<u32> {
        // Not `locate`: the chained compare's own state read answers here, where going through
        // `locate` loads the state word again (measured: criterion batch_64/lookup_prefix ~3%
        // slower).
        if let Some((slot, state, _)) = after.and_then(|prev| self.probe_after(prev, &key.key_ref())) {
            return (state == BlockState::Ready).then_some(slot);
        }
        let r = self.find(&key.probe(), guard)?;
        self.state(r.slot).is_ready_at(r.generation).then_some(r.slot)
    }

    /// Whether each key is ready (no prefix semantics).
    pub fn contains_ready(&self, keys: &[BlockKey]) -> Vec<bool> {
        let guard = Guard::new();
        keys.iter().map(|k| self.ready_slot(k, None, &guard).is_some()).collect()
    }

    /// State, pins and slot of one key.
    pub fn state_of(&self, key: &BlockKey) -> Option<(BlockState, u32, u32)> {
        let guard = Guard::new();
        self.resolve(&key.as_probe(), &guard).map(|r| (r.state, r.pins, r.slot))
    }

    /// Run `f` on the entry of `key`. The entry's fields describe `key`'s block only while the
    /// caller holds a pin or an in-flight store on it (otherwise the slot may be reused).
    pub fn with_entry<R>(&self, key: &BlockKey, f: impl FnOnce(&BlockEntry) -> R) -> Option<R> {
        let guard = Guard::new();
        self.resolve(&key.as_probe(), &guard).map(|r| f(r.entry))
    }

    /// The writers' lock (see `failure`): refused once the index has failed.
    fn write(&self) -> KvResult<WriteLock<'_, Inner>> {
        self.failure.lock(&self.inner)
    }

    /// Fail the index for `reason` (e.g. a panic the Python binding caught; see `failure`).
    /// Takes the writers' mutex first, so that a writer in the middle of a change never sees
    /// the index turn failed under it (its lookups would suddenly miss keys it holds). Never
    /// call it holding that mutex.
    pub fn fail(&self, reason: impl Into<String>) {
        let _writers = self.inner.lock();
        self.failure.set(reason)
    }

    /// Run `f`, an update of this index made where no caller can take a panic (a disk I/O
    /// thread's completion): a panic in it (a bug) fails the index instead of killing the
    /// thread with its job unfinished. None if it panicked.
    pub fn contain<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            Ok(r) => Some(r),
            Err(payload) => {
                self.fail(format!("panic: {}", panic_message(payload.as_ref())));
                None
            }
        }
    }

    /// Why the index failed, if it has: from then on it answers misses and refuses stores.
    pub fn failure(&self) -> Option<&str> {
        self.failure.reason()
    }

    /// Test hook: the next store that has to evict panics midway, after its victims are gone
    /// and before its own blocks are placed (the containment tests' realistic bug).
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn inject_store_panic(&self) {
        self.panic_in_next_store.arm(Some(()), 1);
    }

    /// All keys with their state, pins and slot, in slot order (a snapshot, for status and
    /// tests). Takes the index's mutex, under which the slot records are stable.
    pub fn snapshot(&self) -> Vec<(BlockKey, BlockState, u32, u32)> {
        let Ok(_inner) = self.write() else { return Vec::new() };
        (0..self.capacity() as u32)
            .filter_map(|slot| {
                let (s, p) = self.state(slot).load();
                (s != BlockState::Evicting).then(|| (self.slot_keys.read(slot), s, p, slot))
            })
            .collect()
    }

    // ---- writes (short policy lock) ----------------------------------------------------------

    /// Reserve slots for the new blocks among `keys`, evicting if needed. All-or-nothing: on
    /// `NoSpace` nothing was evicted or reserved. Duplicates inside the batch count once, and
    /// no key of the batch is ever evicted to make room for the others.
    pub fn prepare_store<K: ChainKey>(&self, keys: &[K], hint: InsertHint) -> KvResult<StoreOutcome> {
        self.prepare_store_as(keys, hint, Admit::ByRule)
    }

    /// `prepare_store`, saying whether the new keys go through the admission rule.
    pub fn prepare_store_as<K: ChainKey>(&self, keys: &[K], hint: InsertHint, admit: Admit) -> KvResult<StoreOutcome> {
        Self::check_hint(hint)?;
        self.prepare_store_locked(&mut *self.write()?, keys, hint, admit)
    }

    /// `prepare_store` if the index's mutex is free right now, None if another writer holds it
    /// (a caller holding the GIL then releases it before waiting: see the Python binding).
    pub fn try_prepare_store<K: ChainKey>(&self, keys: &[K], hint: InsertHint) -> Option<KvResult<StoreOutcome>> {
        self.try_prepare_store_as(keys, hint, Admit::ByRule)
    }

    /// `try_prepare_store`, saying whether the new keys go through the admission rule.
    pub fn try_prepare_store_as<K: ChainKey>(
        &self,
        keys: &[K],
        hint: InsertHint,
        admit: Admit,
    ) -> Option<KvResult<StoreOutcome>> {
        if let Err(e) = Self::check_hint(hint) {
            return Some(Err(e));
        }
        Some(
            self.failure
                .try_lock(&self.inner)?
                .and_then(|mut inner| self.prepare_store_locked(&mut inner, keys, hint, admit)),
        )
    }

    fn check_hint(hint: InsertHint) -> KvResult<()> {
        if hint.priority > MAX_PRIORITY {
            return Err(KvError::invalid("priority", format!("{} is outside 0..=100", hint.priority)));
        }
        Ok(())
    }

    fn prepare_store_locked<K: ChainKey>(
        &self,
        inner: &mut Inner,
        keys: &[K],
        hint: InsertHint,
        admit: Admit,
    ) -> KvResult<StoreOutcome> {
        // Read under the lock: a store that waited for it must not start its retention
        // duration (the priority policy's expiry) in the past.
        let now = self.clock.now_ns();
        let guard = Guard::new();
        let mut out = StoreOutcome::default();
        // This batch's resident keys, (position, slot): never evicted to make room for the
        // others (vLLM's contract, and the only sane one: the caller was just told they are
        // present), and touched if a new key follows them (`apply_chain_tail_first`).
        let mut present: Vec<(usize, u32)> = Vec::with_capacity(keys.len());
        let mut absent = AbsentKeys::for_batch(keys.len());
        out.already_present_pos.reserve(keys.len());
        // The slot of the previous key when it was present: a chain stored before in one call
        // sits in ascending slots (below), so `locate` recognises a present chain without
        // hashing its keys. Under the lock a slot that is not vacant always holds a mapped
        // block (claims, removals and reuse all happen under it), so its answer is the map's.
        let mut prev: Option<u32> = None;
        // Later occurrences of a key absent at its first: they share that one's fate (below).
        let mut repeats: Vec<(BlockKey, usize)> = Vec::new();
        for (pos, k) in keys.iter().enumerate() {
            let found = self.locate(k, prev, &guard).map(|r| r.slot);
            prev = found.ok();
            match found {
                Ok(slot) => {
                    present.push((pos, slot));
                    out.already_present_pos.push(pos);
                }
                Err(probe) => {
                    let key = probe.to_key();
                    if !absent.insert(key, pos) {
                        repeats.push((key, pos));
                    }
                }
            }
        }
        // Where each batch position's block sits, for the parent links (below).
        let linked = inner.links.is_some().then(|| (present.clone(), repeats.clone()));
        // Admission, in input order, for each distinct absent key.
        let mut new_keys: Vec<BlockKey> = Vec::with_capacity(absent.keys.len());
        out.to_write_pos.reserve(absent.keys.len());
        for (key, pos) in absent.keys {
            if admit == Admit::Already || inner.admission.offer(&key, hint.priority) {
                new_keys.push(key);
                out.to_write_pos.push(pos);
            } else {
                out.refused.push(key);
                out.refused_pos.push(pos);
            }
        }
        if !repeats.is_empty() {
            // A repeat of an admitted key is present by the time its first occurrence is
            // written (skipped); a repeat of a refused key is refused too, never "present".
            let refused: HashSet<BlockKey> = out.refused.iter().copied().collect();
            for (key, pos) in repeats {
                if refused.contains(&key) {
                    out.refused_pos.push(pos);
                } else {
                    out.already_present_pos.push(pos);
                }
            }
            out.refused_pos.sort_unstable();
            out.already_present_pos.sort_unstable();
        }
        // Admission saw the offers above whether or not the store fits (an offer is the
        // engine's demand for the block either way); the store's counts wait until it does.
        let free = self.slots.free_count();
        if new_keys.len() > free {
            let need = new_keys.len() - free;
            // By slot, for the search (`apply_chain_tail_first` takes them in any order).
            present.sort_unstable_by_key(|&(_, slot)| slot);
            let protected = |slot: u32| present.binary_search_by_key(&slot, |&(_, s)| s).is_ok();
            let evictable = |slot: u32| !protected(slot) && self.state(slot).is_evictable();
            out.evicted = if inner.links.is_some() {
                self.evict_leaves(inner, need, now, &evictable)
            } else {
                self.evict(inner, need, now, &evictable)
            }
            .map_err(|available| {
                self.stats.store_no_space.fetch_add(1, Ordering::Relaxed);
                KvError::NoSpace { needed: new_keys.len(), available: free + available }
            })?;
            self.stats.evictions.fetch_add(out.evicted.len() as u64, Ordering::Relaxed);
            if self.panic_in_next_store.take_as(Some).is_some() {
                panic!("injected fault: a store panicked after evicting {} block(s)", out.evicted.len());
            }
        }

        self.stats.store_refused.fetch_add(out.refused.len() as u64, Ordering::Relaxed);
        self.stats.store_skipped.fetch_add(out.already_present_pos.len() as u64, Ordering::Relaxed);

        // Slots in ascending order along the chain: a chain stored in one call then sits in
        // ascending (usually adjacent: evicting a chain frees a run) slots, which is what lets a
        // lookup walking it find each next block at the next slot (`IndexReader::ready_slot`),
        // and what lets copies of adjacent blocks coalesce.
        let mut slots: Vec<u32> =
            new_keys.iter().map(|_| self.slots.alloc().expect("capacity was reserved above")).collect();
        slots.sort_unstable();
        let placed: Vec<(BlockKey, u32)> = new_keys.iter().copied().zip(slots).collect();
        if !placed.is_empty() {
            self.apply_chain_tail_first(inner, &placed, &out.to_write_pos, present, hint, now);
        }
        self.stats.stores_prepared.fetch_add(placed.len() as u64, Ordering::Relaxed);
        out.to_write = placed;
        if let Some((present, repeats)) = linked {
            self.link_chain(inner, keys.len(), &out, &present, &repeats);
        }
        Ok(out)
    }

    /// Choose `need` victims by the policy and evict them, or change nothing and return how
    /// many blocks could have been.
    fn evict(
        &self,
        inner: &mut Inner,
        need: usize,
        now: u64,
        evictable: &dyn Fn(u32) -> bool,
    ) -> Result<Vec<(BlockKey, u32)>, usize> {
        let Some(victims) = inner.policy.select_victims(need, now, &mut |r| evictable(r.slot)) else {
            return Err((0..self.capacity() as u32).filter(|&s| evictable(s)).count());
        };
        Ok(victims.into_iter().map(|v| self.evict_slot(inner, v.slot)).collect())
    }

    /// `evict` for a policy that may evict only leaves (`chain_links`). When the leaves alone
    /// are too few, a block whose extensions all go first may go too: the victims are then
    /// taken one at a time, each leaving its parent a leaf, once it is known that enough can go.
    fn evict_leaves(
        &self,
        inner: &mut Inner,
        need: usize,
        now: u64,
        evictable: &dyn Fn(u32) -> bool,
    ) -> Result<Vec<(BlockKey, u32)>, usize> {
        let links = inner.links.as_ref().expect("links kept for this policy");
        if let Some(victims) =
            inner.policy.select_victims(need, now, &mut |r| evictable(r.slot) && links.is_leaf(r.slot))
        {
            return Ok(victims.into_iter().map(|v| self.evict_slot(inner, v.slot)).collect());
        }
        let resident = |s: u32| self.state(s).load().0 != BlockState::Evicting;
        let peelable = links.peelable(resident, evictable, &self.states);
        if peelable < need {
            return Err(peelable);
        }
        let mut evicted = Vec::with_capacity(need);
        for _ in 0..need {
            let links = inner.links.as_ref().expect("links kept for this policy");
            let victim = inner
                .policy
                .select_victims(1, now, &mut |r| evictable(r.slot) && links.is_leaf(r.slot))
                .expect("a peelable block leaves a leaf to evict");
            evicted.push(self.evict_slot(inner, victim[0].slot));
        }
        Ok(evicted)
    }

    /// Evict the block in `slot`, which the policy gave up as a victim.
    fn evict_slot(&self, inner: &mut Inner, slot: u32) -> (BlockKey, u32) {
        // Cannot fail: evictable was checked under the lock and pins are only taken under it;
        // a concurrent unpin only lowers the count.
        let (_, _, generation) = self.state(slot).load_with_generation();
        let claimed = self.state(slot).try_claim(generation);
        assert!(claimed, "victim slot {slot} could not be claimed");
        let key = self.detach(inner, slot);
        self.slots.release(slot);
        (key, slot)
    }

    /// Record, for a policy that may evict only leaves, which block each new block of a store
    /// extends: the block before it in the batch, when that one is resident (present, placed,
    /// or a repeat of a placed key; not a refused one).
    fn link_chain(
        &self,
        inner: &mut Inner,
        batch_len: usize,
        out: &StoreOutcome,
        present: &[(usize, u32)],
        repeats: &[(BlockKey, usize)],
    ) {
        const NONE: u32 = u32::MAX;
        let (placed, placed_pos, refused) = (&out.to_write, &out.to_write_pos, &out.refused);
        let mut slot_at = vec![NONE; batch_len];
        for &(pos, slot) in present {
            slot_at[pos] = slot;
        }
        for (&(_, slot), &pos) in placed.iter().zip(placed_pos) {
            slot_at[pos] = slot;
        }
        for (key, pos) in repeats {
            if !refused.contains(key) {
                if let Some(&(_, slot)) = placed.iter().find(|(k, _)| k == key) {
                    slot_at[*pos] = slot;
                }
            }
        }
        let Some(links) = inner.links.as_mut() else { return };
        for (&(_, slot), &pos) in placed.iter().zip(placed_pos) {
            let parent = if pos > 0 { slot_at[pos - 1] } else { NONE };
            if parent != NONE && parent != slot {
                let (_, _, generation) = self.state(parent).load_with_generation();
                links.link(slot, parent, generation);
            }
        }
    }

    /// Give a stored chain its policy order, tail first, so that every policy ranks its head
    /// as the most recent and evicts its tail first: each new block is inserted (`placed`, at
    /// batch positions `placed_pos`), and each block already present that comes before a new
    /// one in the batch is touched. Without the touches, a chain extended by a later store
    /// (H, T stored, then H, T, U) ranked its new tail U above its older middle T, which was
    /// then evicted first and left U unreachable. Present blocks after the last new one, and a
    /// store of a chain that is all present (a repeat), are left as they are: nothing of the
    /// chain's order changes, and a repeated offer is not a use. A block present twice in the
    /// batch is touched once, at its first (head-most) position.
    ///
    /// Each new block is inserted as an extension of the nearest block before it in the batch
    /// that was present (`EvictionPolicy::insert_extending`), if any: where FIFO places it,
    /// since a FIFO has no touches to rank the prefix by.
    #[inline]
    fn apply_chain_tail_first(
        &self,
        inner: &mut Inner,
        placed: &[(BlockKey, u32)],
        placed_pos: &[usize],
        mut present: Vec<(usize, u32)>,
        hint: InsertHint,
        now: u64,
    ) {
        let meta = (hint.priority, self.config.block_bytes, 0);
        let last_new = placed_pos.last().copied().unwrap_or(0);
        present.retain(|&(pos, _)| pos < last_new);
        present.sort_unstable();
        // Per new block, tail first: the slot of the nearest present block before it.
        let mut prefixes: Vec<Option<u32>> = Vec::with_capacity(placed.len());
        let mut before = present.iter().rev().peekable();
        for &pos in placed_pos.iter().rev() {
            while before.next_if(|&&(p, _)| p > pos).is_some() {}
            prefixes.push(before.peek().map(|&&(_, slot)| slot));
        }
        // By position, one entry per block (its first, head-most position). A chain stored
        // anew has none, and its loop below is inserts only.
        if present.len() > 1 {
            present.sort_unstable_by_key(|&(pos, slot)| (slot, pos));
            present.dedup_by_key(|&mut (_, slot)| slot);
            present.sort_unstable();
        }
        let mut touches = present.iter().rev().peekable();
        for ((i, (k, slot)), prefix) in placed.iter().enumerate().rev().zip(prefixes) {
            // The present blocks after this new one in the batch, tail first.
            while let Some(&(_, touched)) = touches.next_if(|&&(pos, _)| pos > placed_pos[i]) {
                self.touch_slot(inner, touched, now);
            }
            let generation = self.occupy(inner, *slot, k, BlockState::Writing, meta);
            self.publish(inner, *k, SlotRef { slot: *slot, generation }, prefix, hint, now);
        }
        for &(_, touched) in touches {
            self.touch_slot(inner, touched, now);
        }
    }

    /// A use of the block in `slot` (resident; `inner` locked): its use count and its rank.
    fn touch_slot(&self, inner: &mut Inner, slot: u32, now: u64) {
        self.entry(slot).uses.fetch_add(1, Ordering::Relaxed);
        inner.policy.touch(&Resident { slot, key_hash: self.slot_keys.key_hash(slot) }, now);
    }

    /// Make an occupied slot's block findable: map entry, policy entry (as an extension of the
    /// present block in slot `prefix`, if given).
    fn publish(&self, inner: &mut Inner, key: BlockKey, at: SlotRef, prefix: Option<u32>, hint: InsertHint, now: u64) {
        debug_assert!(self.find(&key.as_probe(), &Guard::new()).is_none(), "a key was inserted twice");
        self.map.insert(&key, at);
        let resident = Resident::of(at.slot, &key);
        match prefix {
            Some(p) => {
                let prefix = Resident { slot: p, key_hash: self.slot_keys.key_hash(p) };
                inner.policy.insert_extending(&resident, &prefix, hint, now);
            }
            None => inner.policy.insert(&resident, hint, now),
        }
    }

    /// Put back a block found on disk at open (the disk tier's recovery): a Ready entry in
    /// `slot`, which the caller took out of the allocator's free list (it never was in it),
    /// with the retention `hint` its header recorded. Bypasses admission (the block was
    /// admitted before the restart). Call in the order the blocks should rank, oldest first.
    /// Errors if the key is already present.
    pub fn insert_recovered(
        &self,
        key: BlockKey,
        slot: u32,
        size: u64,
        checksum: u32,
        hint: InsertHint,
    ) -> KvResult<()> {
        Self::check_hint(hint)?;
        if slot as usize >= self.config.capacity {
            return Err(KvError::invalid("slot", format!("slot {slot} out of range 0..{}", self.config.capacity)));
        }
        let mut inner = self.write()?;
        let now = self.clock.now_ns();
        let guard = Guard::new();
        if self.find(&key.as_probe(), &guard).is_some() {
            return Err(KvError::invalid("key", format!("{key:?} recovered twice")));
        }
        // Under the lock a slot holds a block exactly when its state is not Evicting (claims and
        // detaches happen together under it).
        if self.state(slot).load().0 != BlockState::Evicting {
            return Err(KvError::invalid("slot", format!("slot {slot} recovered twice")));
        }
        let generation = self.occupy(&mut inner, slot, &key, BlockState::Ready, (hint.priority, size, checksum));
        self.publish(&mut inner, key, SlotRef { slot, generation }, None, hint, now);
        Ok(())
    }

    /// Finish stores: success makes blocks readable; failure drops them and frees their slots.
    /// Keys not being written are ignored. Returns how many keys were completed or dropped.
    /// Success is lock-free (one CAS per key); only a failure takes the policy lock. Keys may be
    /// `BlockKey`s or probes borrowed from the caller (`KeyProbe`).
    pub fn complete_store<K: ChainKey>(&self, keys: &[K], success: bool) -> usize {
        let guard = Guard::new();
        let mut done = 0;
        if success {
            // A chain prepared in one call sits in ascending slots, which `locate` compares first.
            // The CAS is on the (slot, generation) that held the key, so a slot reused meanwhile
            // is left alone.
            let mut prev: Option<u32> = None;
            for k in keys {
                let found = self.locate(k, prev, &guard).ok();
                if let Some(r) = found {
                    done += usize::from(self.state(r.slot).mark_ready(r.generation));
                }
                prev = found.map(|r| r.slot);
            }
            self.stats.stores_completed.fetch_add(done as u64, Ordering::Relaxed);
            return done;
        }
        let Ok(mut inner) = self.write() else { return 0 };
        for k in keys {
            let Some(r) = self.find(&k.probe(), &guard) else { continue };
            if self.state(r.slot).abandon_write(r.generation) {
                let key = self.detach(&mut inner, r.slot);
                inner.policy.remove(&Resident::of(r.slot, &key));
                self.slots.release(r.slot);
                done += 1;
            }
        }
        self.stats.stores_failed.fetch_add(done as u64, Ordering::Relaxed);
        done
    }

    /// Pin every key for a load and return their slots. All-or-nothing: if any key is not
    /// ready, nothing is pinned and `NotReady` names it.
    pub fn pin_for_load(&self, keys: &[BlockKey]) -> KvResult<Vec<u32>> {
        let _inner = self.write()?;
        let guard = Guard::new();
        let mut pinned: Vec<SlotRef> = Vec::with_capacity(keys.len());
        for k in keys {
            match self.find(&k.as_probe(), &guard).filter(|r| self.state(r.slot).try_pin(r.generation).is_some()) {
                Some(r) => pinned.push(r),
                None => {
                    for r in &pinned {
                        self.state(r.slot).unpin(r.generation).expect("pinned above");
                    }
                    self.stats.pin_failures.fetch_add(1, Ordering::Relaxed);
                    return Err(KvError::NotReady(format!("{k:?}")));
                }
            }
        }
        self.stats.pins.fetch_add(keys.len() as u64, Ordering::Relaxed);
        Ok(pinned.into_iter().map(|r| r.slot).collect())
    }

    /// Drop one pin from each key. Lock-free. Errors (and drops no pin at all) if any key holds
    /// no pin, since that would mean a caller unpinned twice.
    pub fn unpin(&self, keys: &[BlockKey]) -> KvResult<()> {
        if self.failure.is_set() {
            // No slot is handed out after a failure, so a pinned slot's bytes stay as they
            // were: the pin has nothing left to protect.
            return Ok(());
        }
        let guard = Guard::new();
        // A key may appear several times (one pin each), so check pins against occurrences.
        let mut wanted: std::collections::HashMap<&BlockKey, u32, foldhash::fast::RandomState> =
            std::collections::HashMap::with_capacity_and_hasher(keys.len(), Default::default());
        for k in keys {
            *wanted.entry(k).or_insert(0) += 1;
        }
        for (k, n) in &wanted {
            let ok = self.resolve(&k.as_probe(), &guard).is_some_and(|r| r.pins >= *n);
            if !ok {
                return Err(KvError::NotPinned(format!("{k:?}")));
            }
        }
        for k in keys {
            // Cannot fail after the check above unless a caller unpins the same keys
            // concurrently (a double unpin): say so rather than hide it.
            let dropped = self.find(&k.as_probe(), &guard).and_then(|r| self.state(r.slot).unpin(r.generation));
            if dropped.is_none() && !self.failure.is_set() {
                return Err(KvError::NotPinned(format!("{k:?} (unpinned concurrently)")));
            }
        }
        self.stats.unpins.fetch_add(keys.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Record a use of each resident key (policy recency/frequency), tail-first.
    pub fn touch(&self, keys: &[BlockKey]) {
        self.each_resident_tail_first(keys, |me, inner, slot, now| me.touch_slot(inner, slot, now));
        self.stats.touches.fetch_add(keys.len() as u64, Ordering::Relaxed);
    }

    /// Rank each resident key as the most recent of the place its policy already gives it,
    /// tail-first like a touch, without counting a use (`EvictionPolicy::refresh`): how an
    /// engine restores prefix order for blocks a request only stored.
    pub fn refresh(&self, keys: &[BlockKey]) {
        self.each_resident_tail_first(keys, |me, inner, slot, now| {
            inner.policy.refresh(&Resident { slot, key_hash: me.slot_keys.key_hash(slot) }, now)
        });
    }

    /// `apply` to the slot of each of `keys` that is resident, last key first, under the
    /// writers' lock (nothing on a failed index).
    fn each_resident_tail_first(&self, keys: &[BlockKey], mut apply: impl FnMut(&Self, &mut Inner, u32, u64)) {
        let Ok(mut inner) = self.write() else { return };
        let now = self.clock.now_ns();
        let guard = Guard::new();
        for k in keys.iter().rev() {
            if let Some(r) = self.find(&k.as_probe(), &guard) {
                apply(self, &mut inner, r.slot, now);
            }
        }
    }

    /// Renew the retention hint of every present key (ready or being written, pinned or not;
    /// absent keys are ignored): TensorRT-LLM's "a later claim with a new priority always
    /// overrides the old one", which `prepare_store` cannot do since it leaves present keys
    /// alone. Each key's entry records the new priority, and the policy ranks the block as if it
    /// had just been stored with `hint` (`EvictionPolicy::renew`: the priority policy moves it to
    /// the new level, most recent there, and restarts or clears its expiry from now; the other
    /// policies' order ignores the hint and stays as it was). Not a use (no recency, frequency
    /// or admission count), never an eviction, and admission is not asked again. Applied
    /// tail-first like stores and touches, so a renewed chain's head ranks as the more recent.
    /// Returns how many distinct keys were renewed. An invalid hint is an error; on a failed
    /// index it does nothing and returns 0, like the other writes that are not stores.
    pub fn renew(&self, keys: &[BlockKey], hint: InsertHint) -> KvResult<usize> {
        Self::check_hint(hint)?;
        let Ok(mut inner) = self.write() else { return Ok(0) };
        let now = self.clock.now_ns();
        let guard = Guard::new();
        let mut renewed: Vec<u32> = Vec::with_capacity(keys.len());
        for k in keys.iter().rev() {
            if let Some(r) = self.find(&k.as_probe(), &guard) {
                self.entry(r.slot).priority.store(hint.priority, Ordering::Relaxed);
                inner.policy.renew(&Resident::of(r.slot, k), hint, now);
                renewed.push(r.slot);
            }
        }
        // A key repeated in the batch is renewed once per occurrence (the head-most one ranks
        // it last) but counted once.
        renewed.sort_unstable();
        renewed.dedup();
        self.stats.renewals.fetch_add(renewed.len() as u64, Ordering::Relaxed);
        Ok(renewed.len())
    }

    /// Count a use toward admission without storing (e.g. a hit served by another tier).
    pub fn record_use(&self, keys: &[BlockKey]) {
        let Ok(mut inner) = self.write() else { return };
        for k in keys {
            inner.admission.record_use(k);
        }
    }

    /// Remove ready, unpinned blocks. Pinned or in-flight blocks are left alone. Returns the
    /// removed keys with their freed slots.
    pub fn remove(&self, keys: &[BlockKey]) -> Vec<(BlockKey, u32)> {
        let Ok(mut inner) = self.write() else { return Vec::new() };
        self.remove_locked(&mut inner, keys)
    }

    fn remove_locked(&self, inner: &mut Inner, keys: &[BlockKey]) -> Vec<(BlockKey, u32)> {
        let guard = Guard::new();
        let mut removed = Vec::new();
        for k in keys {
            let Some(r) = self.find(&k.as_probe(), &guard) else { continue };
            if self.state(r.slot).try_claim(r.generation) {
                inner.policy.remove(&Resident::of(r.slot, k));
                self.detach(inner, r.slot);
                self.slots.release(r.slot);
                removed.push((*k, r.slot));
            }
        }
        self.stats.removals.fetch_add(removed.len() as u64, Ordering::Relaxed);
        removed
    }

    /// Remove every block that is not pinned or being written. Returns how many were removed.
    ///
    /// Works through the slots `CLEAR_CHUNK` at a time, taking the writers' lock for each part
    /// only: a whole large tier at once held every store, pin and completion-on-failure waiting
    /// for its entire run (1-3 s at 2M blocks). A block stored meanwhile in a part already
    /// cleared stays, like one stored just after the clear.
    pub fn clear(&self) -> usize {
        self.clear_in_parts(|| {})
    }

    /// `clear`, calling `between_parts` after each part with the writers' lock released (a
    /// test's window to prove that it is).
    fn clear_in_parts(&self, mut between_parts: impl FnMut()) -> usize {
        let capacity = self.capacity() as u32;
        let mut removed = 0;
        for start in (0..capacity).step_by(CLEAR_CHUNK as usize) {
            let Ok(mut inner) = self.write() else { return removed };
            // Under the lock a slot holds a block exactly when its state is not Evicting.
            let keys: Vec<BlockKey> = (start..capacity.min(start + CLEAR_CHUNK))
                .filter(|&slot| self.state(slot).load().0 != BlockState::Evicting)
                .map(|slot| self.slot_keys.read(slot))
                .collect();
            removed += self.remove_locked(&mut inner, &keys).len();
            drop(inner);
            between_parts();
        }
        let Ok(mut inner) = self.write() else { return removed };
        if self.is_empty() {
            inner.policy.clear();
        }
        inner.admission.clear();
        removed
    }

    pub fn stats(&self) -> StatsSnapshot {
        let mut pinned = 0u64;
        let mut writing = 0u64;
        for e in self.states.iter() {
            let (s, p) = e.load();
            pinned += u64::from(p > 0);
            writing += u64::from(s == BlockState::Writing);
        }
        self.stats.snapshot(self.capacity(), self.len(), pinned, writing, self.failure.is_set())
    }

    /// Number of blocks the policy tracks as resident (must always equal `len`).
    pub fn policy_len(&self) -> usize {
        self.inner.lock().policy.len()
    }
}

/// Lock-free reads under one epoch guard (see `TierIndex::reader`).
pub struct IndexReader<'a> {
    index: &'a TierIndex,
    guard: Guard,
}

impl IndexReader<'_> {
    /// Whether the key's block is ready. Not counted in stats.
    pub fn is_ready(&self, key: &impl ChainKey) -> bool {
        self.ready_slot(key, None).is_some()
    }

    /// The slot of `key`'s block if it is ready; `after` is the previous block's slot when
    /// walking a chain (see `TierIndex::ready_slot`). Not counted in stats.
    #[inline]
    pub fn ready_slot(&self, key: &impl ChainKey, after: Option<u32>) -> Option<u32> {
        self.index.ready_slot(key, after, &self.guard)
    }

    /// How many of `keys`, from the first, have ready blocks: the walk of every prefix lookup,
    /// chained through each block's slot. It stops at the first miss without taking further
    /// keys from the iterator, and at the first key the caller could not make (its error).
    /// Not counted in stats.
    #[inline]
    pub fn ready_prefix<K: ChainKey, E>(&self, keys: impl IntoIterator<Item = Result<K, E>>) -> Result<usize, E> {
        let (mut hits, mut prev) = (0, None);
        for key in keys {
            prev = self.ready_slot(&key?, prev);
            if prev.is_none() {
                break;
            }
            hits += 1;
        }
        Ok(hits)
    }
}

/// Slots `clear` empties under one hold of the writers' lock (~1 ms of work).
const CLEAR_CHUNK: u32 = 4096;

/// No slot: `LAST_LOOKUP` after a miss.
const NO_SLOT: u32 = u32::MAX;

thread_local! {
    /// This thread's last one-key lookup: (address of the index, slot of the block it found or
    /// NO_SLOT). Only a hint for the next lookup: `probe_slot` checks the slot's key and
    /// generation, so a stale or foreign hint costs a compare, never a wrong answer.
    static LAST_LOOKUP: std::cell::Cell<(usize, u32)> = const { std::cell::Cell::new((0, NO_SLOT)) };
}

#[cfg(test)]
mod tests;
