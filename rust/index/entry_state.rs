//! The lock-free part of a block entry: state, pin count and the slot's generation in one
//! atomic word, so that "is it readable", "pin it" and "claim it for eviction" are single atomic
//! decisions.
//!
//! Layout: bits 0..24 = pin count, bits 24..32 = state, bits 32..64 = generation.
//! Transitions (the generation never changes in any of them):
//!   Writing --mark_ready--> Ready --try_claim (pins == 0)--> Evicting
//!   Ready --try_pin--> Ready(pins + 1) --unpin--> Ready(pins - 1)
//!   Writing --abandon_write--> Evicting
//! A block can only be pinned while Ready, and only claimed for eviction while Ready with no
//! pins; both are compare-and-swap on the same word, so a pin and an eviction can never both
//! win. This is model-checked with loom (tests/rust/loom_entry_state.rs).
//!
//! Entries live in an arena indexed by slot, and a slot is reused by other blocks over time.
//! `occupy` (only for a vacant slot, under the index's writer lock) starts the next generation.
//! The map stores (slot, generation); every lock-free operation checks the generation, so a
//! reader holding a stale map value can never read, pin or complete the slot's next block.
//! A stale reader would need the same slot reused 2^32 times between its map read and its
//! state read for the check to be fooled.

use crate::sync::{AtomicU64, Ordering};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// Slot handed out for a store that has not completed: never readable, never evicted.
    Writing = 0,
    Ready = 1,
    /// Claimed by an eviction or removal, or a vacant slot: never readable.
    Evicting = 2,
}

impl BlockState {
    fn from_bits(b: u64) -> Self {
        match b {
            0 => BlockState::Writing,
            1 => BlockState::Ready,
            _ => BlockState::Evicting,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            BlockState::Writing => "writing",
            BlockState::Ready => "ready",
            BlockState::Evicting => "evicting",
        }
    }
}

const PIN_MASK: u64 = (1 << 24) - 1;
const STATE_SHIFT: u32 = 24;
const STATE_MASK: u64 = 0xff << STATE_SHIFT;
const GEN_SHIFT: u32 = 32;

fn pack(state: BlockState, pins: u32, generation: u32) -> u64 {
    (u64::from(generation) << GEN_SHIFT) | ((state as u64) << STATE_SHIFT) | (u64::from(pins) & PIN_MASK)
}

fn unpack(v: u64) -> (BlockState, u32, u32) {
    (BlockState::from_bits((v & STATE_MASK) >> STATE_SHIFT), (v & PIN_MASK) as u32, (v >> GEN_SHIFT) as u32)
}

#[derive(Debug)]
pub struct EntryState(AtomicU64);

impl EntryState {
    /// A slot holding no block (generation 0).
    pub fn vacant() -> Self {
        EntryState(AtomicU64::new(pack(BlockState::Evicting, 0, 0)))
    }
    /// A block being written, generation 0 (for tests and models).
    pub fn writing() -> Self {
        EntryState(AtomicU64::new(pack(BlockState::Writing, 0, 0)))
    }
    /// A ready block, generation 0 (for tests and models).
    pub fn ready() -> Self {
        EntryState(AtomicU64::new(pack(BlockState::Ready, 0, 0)))
    }

    /// State and pin count.
    pub fn load(&self) -> (BlockState, u32) {
        let (s, p, _) = self.load_with_generation();
        (s, p)
    }

    pub fn load_with_generation(&self) -> (BlockState, u32, u32) {
        unpack(self.0.load(Ordering::Acquire))
    }

    /// Ready and still the block of `generation`.
    pub fn is_ready_at(&self, generation: u32) -> bool {
        let (s, _, g) = self.load_with_generation();
        s == BlockState::Ready && g == generation
    }

    pub fn is_evictable(&self) -> bool {
        self.load() == (BlockState::Ready, 0)
    }

    /// Start the slot's next generation in `state` (Writing for a store, Ready for a block
    /// recovered from disk). Only for a vacant slot, by the one writer that holds it. A plain
    /// store is enough: while the slot is vacant (Evicting, no pins) no lock-free transition can
    /// succeed (`mark_ready` needs Writing, `unpin` needs a pin, `try_pin` needs Ready), and
    /// every stale compare-and-swap fails on the whole word.
    pub fn occupy(&self, state: BlockState) -> u32 {
        let (s, pins, g) = self.load_with_generation();
        debug_assert!(s == BlockState::Evicting && pins == 0, "occupying a slot that holds a block");
        let generation = g.wrapping_add(1);
        self.0.store(pack(state, 0, generation), Ordering::Release);
        generation
    }

    /// Apply `next` to the word while it belongs to `generation`; None if it does not or if
    /// `next` refuses the current value.
    fn update(&self, generation: u32, next: impl Fn(BlockState, u32) -> Option<(BlockState, u32)>) -> Option<u64> {
        let mut cur = self.0.load(Ordering::Acquire);
        loop {
            let (s, p, g) = unpack(cur);
            if g != generation {
                return None;
            }
            let (ns, np) = next(s, p)?;
            match self.0.compare_exchange_weak(cur, pack(ns, np, g), Ordering::AcqRel, Ordering::Acquire) {
                Ok(prev) => return Some(prev),
                Err(actual) => cur = actual,
            }
        }
    }

    /// Writing -> Ready. False if the entry was not being written (or is another generation).
    pub fn mark_ready(&self, generation: u32) -> bool {
        self.update(generation, |s, p| (s == BlockState::Writing).then_some((BlockState::Ready, p))).is_some()
    }

    /// Add a pin if Ready. Returns the previous pin count on success.
    pub fn try_pin(&self, generation: u32) -> Option<u32> {
        let prev = self.update(generation, |s, p| {
            (s == BlockState::Ready && u64::from(p) < PIN_MASK).then_some((BlockState::Ready, p + 1))
        })?;
        Some(unpack(prev).1)
    }

    /// Drop a pin. Returns the remaining pin count, or None if there was no pin to drop.
    pub fn unpin(&self, generation: u32) -> Option<u32> {
        let prev = self.update(generation, |s, p| (p > 0).then_some((s, p - 1)))?;
        Some(unpack(prev).1 - 1)
    }

    /// Ready with no pins -> Evicting. Only one claimant can ever win.
    pub fn try_claim(&self, generation: u32) -> bool {
        self.update(generation, |s, p| (s == BlockState::Ready && p == 0).then_some((BlockState::Evicting, 0)))
            .is_some()
    }

    /// Writing -> Evicting, for a failed store.
    pub fn abandon_write(&self, generation: u32) -> bool {
        self.update(generation, |s, p| (s == BlockState::Writing && p == 0).then_some((BlockState::Evicting, 0)))
            .is_some()
    }
}
