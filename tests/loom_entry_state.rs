//! Exhaustive model check (loom) of the lock-free entry state word: pins, eviction claims,
//! write completion and unpins racing on one block. Run with
//! `RUSTFLAGS="--cfg loom" cargo test --release --test loom_entry_state` (`make loom`).
#![cfg(loom)]

use kvtier::index::{BlockState, EntryState};
use loom::sync::Arc;
use loom::thread;

#[test]
fn a_pin_and_an_eviction_claim_never_both_win() {
    loom::model(|| {
        let s = Arc::new(EntryState::ready());
        let s2 = s.clone();
        let pinner = thread::spawn(move || s2.try_pin().is_some());
        let claimed = s.try_claim();
        let pinned = pinner.join().unwrap();
        assert!(claimed ^ pinned, "exactly one of pin and claim must win");
        let expected = if claimed { (BlockState::Evicting, 0) } else { (BlockState::Ready, 1) };
        assert_eq!(s.load(), expected);
    });
}

#[test]
fn two_claimants_one_winner() {
    loom::model(|| {
        let s = Arc::new(EntryState::ready());
        let s2 = s.clone();
        let other = thread::spawn(move || s2.try_claim());
        let mine = s.try_claim();
        let theirs = other.join().unwrap();
        assert!(mine ^ theirs);
    });
}

#[test]
fn claim_racing_unpin_only_succeeds_after_the_last_pin_is_gone() {
    loom::model(|| {
        let s = Arc::new(EntryState::ready());
        assert_eq!(s.try_pin(), Some(0));
        assert_eq!(s.try_pin(), Some(1));
        let s2 = s.clone();
        let unpinner = thread::spawn(move || {
            s2.unpin().unwrap();
            s2.unpin().unwrap();
        });
        let claimed = s.try_claim();
        unpinner.join().unwrap();
        // Claim can only win once both pins are gone; the pins never underflow.
        let (state, pins) = s.load();
        assert_eq!(pins, 0);
        assert_eq!(state, if claimed { BlockState::Evicting } else { BlockState::Ready });
        assert!(s.unpin().is_none());
    });
}

#[test]
fn a_block_being_written_cannot_be_pinned_before_it_is_ready() {
    loom::model(|| {
        let s = Arc::new(EntryState::writing());
        let s2 = s.clone();
        let writer = thread::spawn(move || assert!(s2.mark_ready()));
        let pinned = s.try_pin();
        writer.join().unwrap();
        let (state, pins) = s.load();
        assert_eq!(state, BlockState::Ready);
        assert_eq!(pins, u32::from(pinned.is_some()));
        assert!(!s.try_claim() || pinned.is_none());
    });
}

#[test]
fn concurrent_pins_are_all_counted() {
    loom::model(|| {
        let s = Arc::new(EntryState::ready());
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let s = s.clone();
                thread::spawn(move || s.try_pin().is_some())
            })
            .collect();
        let wins = handles.into_iter().map(|h| h.join().unwrap()).filter(|&w| w).count();
        assert_eq!(wins, 2);
        assert_eq!(s.load(), (BlockState::Ready, 2));
        assert!(!s.try_claim());
    });
}
