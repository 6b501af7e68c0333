//! Each slot's key, readable without the map: what lets a lookup that walks a chain find the next
//! block at the slot after the previous one (the index places a chain stored in one call in
//! ascending slots) with one compare instead of a hash and a map probe.
//!
//! A slot's key record is a seqlock whose version is the slot's generation, kept in its state
//! word (`EntryState`):
//! - Writers (under the index's mutex) write a record only into a vacant slot (state Evicting),
//!   then start the slot's next generation (`occupy_slot`). A fence(Release) before the word
//!   stores orders them after the vacancy (the eviction claim or failed write, possibly by
//!   another writer before it, ordered by the mutex).
//! - Readers (`probe_slot`) load the state word; if it holds a block, compare the record with
//!   their key word by word, then, after a fence(Acquire), load the state word again. The answer
//!   counts only if the generation is unchanged and the slot still holds a block: if any word
//!   they read came from a later record, the second load sees the slot vacated or reoccupied.
//!   A record is written before the generation that it names is published, so a reader that
//!   sees a new generation also sees its record.
//!
//! All words are atomics, so a torn read is a wrong comparison that the generation check
//! discards, never undefined behaviour. Model-checked with loom (tests/rust/loom_entry_state.rs),
//! including a torn read that would match a third key.

use super::entry_state::{BlockState, EntryState};
use crate::keys::{BlockKey, KeyRef, KEY_WORDS};
use crate::sync::{fence, AtomicU64, Ordering};

/// The key records of an index's slots, `KEY_WORDS` atomics each.
pub struct SlotKeys {
    words: Box<[AtomicU64]>,
}

impl SlotKeys {
    pub fn new(capacity: usize) -> Self {
        SlotKeys { words: (0..capacity * KEY_WORDS).map(|_| AtomicU64::new(0)).collect() }
    }

    fn record(&self, slot: u32) -> &[AtomicU64] {
        let at = slot as usize * KEY_WORDS;
        &self.words[at..at + KEY_WORDS]
    }

    /// The key recorded for `slot`. For writers (the index's mutex held), who know the slot holds
    /// a block; records are only written under that mutex, so this read is never torn.
    pub fn read(&self, slot: u32) -> BlockKey {
        let mut w = [0u64; KEY_WORDS];
        for (dst, src) in w.iter_mut().zip(self.record(slot)) {
            *dst = src.load(Ordering::Relaxed);
        }
        BlockKey::from_words(&w)
    }

    /// The hash of the key recorded for `slot` (its record's first word). For writers, as `read`.
    pub fn key_hash(&self, slot: u32) -> u64 {
        self.record(slot)[0].load(Ordering::Relaxed)
    }

    /// Whether `slot`'s record holds `probe`'s key, read racily: only meaningful inside
    /// `probe_slot`'s generation check.
    #[inline(always)]
    fn matches(&self, slot: u32, probe: &KeyRef<'_>) -> bool {
        let record = self.record(slot);
        probe.matches_words(|i| record[i].load(Ordering::Relaxed))
    }
}

/// Put `key`'s block into vacant `slot` in `state` (Writing for a store, Ready for a recovered
/// block): its key record first, then the slot's next generation, which is returned. Writers
/// only, with the index's mutex held.
pub fn occupy_slot(state: &EntryState, keys: &SlotKeys, slot: u32, key: &BlockKey, new_state: BlockState) -> u32 {
    // Orders the record's stores after the slot became vacant, for readers still validating the
    // slot's previous generation (see the module comment).
    fence(Ordering::Release);
    for (dst, w) in keys.record(slot).iter().zip(key.to_words()) {
        dst.store(w, Ordering::Relaxed);
    }
    // Release: a reader that sees the new generation sees the record.
    state.occupy(new_state)
}

/// The state and generation of `slot`'s block if it is `probe`'s, or None (not this key, a
/// vacant slot, or the slot changed while it was read). Lock-free; never reports a key the slot
/// does not hold in the generation it returns.
#[inline(always)]
pub fn probe_slot(state: &EntryState, keys: &SlotKeys, slot: u32, probe: &KeyRef<'_>) -> Option<(BlockState, u32)> {
    let (before, _, generation) = state.load_with_generation();
    if before == BlockState::Evicting || !keys.matches(slot, probe) {
        return None;
    }
    fence(Ordering::Acquire);
    let (after, _, again) = state.load_with_generation();
    (again == generation && after != BlockState::Evicting).then_some((after, generation))
}
