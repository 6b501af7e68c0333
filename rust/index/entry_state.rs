//! The lock-free part of a block entry: state and pin count in one atomic word, so that
//! "is it readable", "pin it" and "claim it for eviction" are single atomic decisions.
//!
//! Layout: bits 0..32 = pin count, bits 32..40 = state.
//! Transitions:
//!   Writing --mark_ready--> Ready --try_claim (pins == 0)--> Evicting
//!   Ready --try_pin--> Ready(pins + 1) --unpin--> Ready(pins - 1)
//! A block can only be pinned while Ready, and only claimed for eviction while Ready with no
//! pins; both are compare-and-swap on the same word, so a pin and an eviction can never both
//! win. This is model-checked with loom (tests/loom_entry_state.rs).

use crate::sync::{AtomicU64, Ordering};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// Slot handed out for a store that has not completed: never readable, never evicted.
    Writing = 0,
    Ready = 1,
    /// Claimed by an eviction or removal: no longer readable, about to leave the index.
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

const PIN_MASK: u64 = 0xffff_ffff;
const STATE_SHIFT: u32 = 32;

fn pack(state: BlockState, pins: u32) -> u64 {
    ((state as u64) << STATE_SHIFT) | u64::from(pins)
}

#[derive(Debug)]
pub struct EntryState(AtomicU64);

impl EntryState {
    pub fn writing() -> Self {
        EntryState(AtomicU64::new(pack(BlockState::Writing, 0)))
    }
    pub fn ready() -> Self {
        EntryState(AtomicU64::new(pack(BlockState::Ready, 0)))
    }

    pub fn load(&self) -> (BlockState, u32) {
        let v = self.0.load(Ordering::Acquire);
        (BlockState::from_bits(v >> STATE_SHIFT), (v & PIN_MASK) as u32)
    }

    pub fn is_ready(&self) -> bool {
        self.load().0 == BlockState::Ready
    }

    pub fn is_evictable(&self) -> bool {
        self.load() == (BlockState::Ready, 0)
    }

    /// Writing -> Ready. False if the entry was not being written.
    pub fn mark_ready(&self) -> bool {
        self.0
            .compare_exchange(
                pack(BlockState::Writing, 0),
                pack(BlockState::Ready, 0),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }

    /// Add a pin if Ready. Returns the previous pin count on success.
    pub fn try_pin(&self) -> Option<u32> {
        let mut cur = self.0.load(Ordering::Acquire);
        loop {
            let state = BlockState::from_bits(cur >> STATE_SHIFT);
            let pins = (cur & PIN_MASK) as u32;
            if state != BlockState::Ready || pins == u32::MAX {
                return None;
            }
            match self.0.compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(pins),
                Err(actual) => cur = actual,
            }
        }
    }

    /// Drop a pin. Returns the remaining pin count, or None if there was no pin to drop.
    pub fn unpin(&self) -> Option<u32> {
        let mut cur = self.0.load(Ordering::Acquire);
        loop {
            let pins = (cur & PIN_MASK) as u32;
            if pins == 0 {
                return None;
            }
            match self.0.compare_exchange_weak(cur, cur - 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(pins - 1),
                Err(actual) => cur = actual,
            }
        }
    }

    /// Ready with no pins -> Evicting. Only one claimant can ever win.
    pub fn try_claim(&self) -> bool {
        self.0
            .compare_exchange(
                pack(BlockState::Ready, 0),
                pack(BlockState::Evicting, 0),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }

    /// Writing -> Evicting, for a failed store.
    pub fn abandon_write(&self) -> bool {
        self.0
            .compare_exchange(
                pack(BlockState::Writing, 0),
                pack(BlockState::Evicting, 0),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }
}
