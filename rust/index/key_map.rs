//! The index's map from a key to its block's (slot, generation), keyed by the key's 64-bit hash
//! alone.
//!
//! Why not by the key itself: a key takes 80 bytes, and the map held a copy of every resident
//! key besides the one in its slot's record (`slot_key`). An entry keyed by hash takes 16
//! bytes: measured through Python at 2M blocks, a resident block went from ~385 to ~234 bytes,
//! and stores touch fewer cache lines.
//!
//! Exactness (no two keys ever confused) comes from the slot records, not from this map:
//! - An entry found by hash is only a candidate. `TierIndex::find` compares the full key with
//!   the candidate slot's key record, checked against the entry's generation (`probe_slot`).
//! - Two resident keys may share a hash. The first one stored takes the `by_hash` entry; later
//!   ones go to `collided`, keyed by the full key. A lookup whose candidate holds another key
//!   looks there, but only while it is not empty: 64-bit hashes of resident keys collide about
//!   once in 2^65 / n^2 tries, so in practice it always is.
//!
//! Writers change both maps only under the index's mutex.

use std::sync::atomic::{AtomicUsize, Ordering};

use scc::{Guard, HashIndex};

use crate::keys::{BlockKey, KeyProbe};

/// Where a key's block lives: its slot and the slot's generation when the block took it.
#[derive(Clone, Copy, Debug)]
pub struct SlotRef {
    pub slot: u32,
    pub generation: u32,
}

/// Keys carry a well-mixed 64-bit hash computed once (`BlockKey::hash64`); maps and sets of keys
/// use it as it is instead of hashing it again.
type HashHasher = nohash_hasher::BuildNoHashHasher<u64>;
pub(super) type KeyHasher = nohash_hasher::BuildNoHashHasher<BlockKey>;

pub struct KeyMap {
    by_hash: HashIndex<u64, SlotRef, HashHasher>,
    collided: HashIndex<BlockKey, SlotRef, KeyHasher>,
    collided_len: AtomicUsize,
}

impl KeyMap {
    pub fn with_capacity(capacity: usize) -> Self {
        KeyMap {
            by_hash: HashIndex::with_capacity_and_hasher(capacity, HashHasher::default()),
            collided: HashIndex::with_hasher(KeyHasher::default()),
            collided_len: AtomicUsize::new(0),
        }
    }

    /// The block mapped under `hash`: `key`'s only if its slot's record says so.
    #[inline(always)]
    pub fn candidate(&self, hash: u64, guard: &Guard) -> Option<SlotRef> {
        self.by_hash.peek(&hash, guard).copied()
    }

    /// `key`'s block among the keys stored while another resident key held their hash.
    #[inline(always)]
    pub fn collided(&self, key: &KeyProbe<'_>, guard: &Guard) -> Option<SlotRef> {
        if self.collided_len.load(Ordering::Acquire) == 0 {
            return None;
        }
        self.collided.peek(key, guard).copied()
    }

    /// Map `key` (not mapped yet) to `r`. Writers only, under the index's mutex.
    pub fn insert(&self, key: &BlockKey, r: SlotRef) {
        if self.by_hash.insert_sync(key.hash64(), r).is_ok() {
            return;
        }
        // Counted first: a reader that finds the entry has seen the count.
        self.collided_len.fetch_add(1, Ordering::Release);
        let inserted = self.collided.insert_sync(*key, r).is_ok();
        assert!(inserted, "a key was inserted twice");
    }

    /// Forget `key`'s block in `slot`; false if it was not mapped there. Writers only.
    pub fn remove(&self, key: &BlockKey, slot: u32) -> bool {
        // The block in `slot` is `key`'s, so an entry naming that slot is `key`'s entry.
        if self.by_hash.remove_if_sync(&key.hash64(), |r| r.slot == slot) {
            return true;
        }
        let removed = self.collided.remove_if_sync(key, |r| r.slot == slot);
        if removed {
            self.collided_len.fetch_sub(1, Ordering::Release);
        }
        removed
    }

    /// Keys stored while another resident key held their hash.
    #[cfg(test)]
    pub fn collided_len(&self) -> usize {
        self.collided_len.load(Ordering::Acquire)
    }
}
