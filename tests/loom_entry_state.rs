//! Exhaustive model check (loom) of the lock-free entry state word: pins, eviction claims,
//! write completion and unpins racing on one block; and of the slot key records that chained
//! lookups compare instead of probing the map (`index::slot_key`). Run with
//! `RUSTFLAGS="--cfg loom" cargo test --release --test loom_entry_state` (`make loom`).
#![cfg(loom)]

use kvtier::index::{occupy_slot, probe_slot, BlockState, EntryState, SlotKeys};
use kvtier::keys::KeyRef;
use kvtier::BlockKey;
use loom::sync::Arc;
use loom::thread;

#[test]
fn a_pin_and_an_eviction_claim_never_both_win() {
    loom::model(|| {
        let s = Arc::new(EntryState::ready());
        let s2 = s.clone();
        let pinner = thread::spawn(move || s2.try_pin(0).is_some());
        let claimed = s.try_claim(0);
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
        let other = thread::spawn(move || s2.try_claim(0));
        let mine = s.try_claim(0);
        let theirs = other.join().unwrap();
        assert!(mine ^ theirs);
    });
}

#[test]
fn claim_racing_unpin_only_succeeds_after_the_last_pin_is_gone() {
    loom::model(|| {
        let s = Arc::new(EntryState::ready());
        assert_eq!(s.try_pin(0), Some(0));
        assert_eq!(s.try_pin(0), Some(1));
        let s2 = s.clone();
        let unpinner = thread::spawn(move || {
            s2.unpin(0).unwrap();
            s2.unpin(0).unwrap();
        });
        let claimed = s.try_claim(0);
        unpinner.join().unwrap();
        // Claim can only win once both pins are gone; the pins never underflow.
        let (state, pins) = s.load();
        assert_eq!(pins, 0);
        assert_eq!(state, if claimed { BlockState::Evicting } else { BlockState::Ready });
        assert!(s.unpin(0).is_none());
    });
}

#[test]
fn a_block_being_written_cannot_be_pinned_before_it_is_ready() {
    loom::model(|| {
        let s = Arc::new(EntryState::writing());
        let s2 = s.clone();
        let writer = thread::spawn(move || assert!(s2.mark_ready(0)));
        let pinned = s.try_pin(0);
        writer.join().unwrap();
        let (state, pins) = s.load();
        assert_eq!(state, BlockState::Ready);
        assert_eq!(pins, u32::from(pinned.is_some()));
        assert!(!s.try_claim(0) || pinned.is_none());
    });
}

#[test]
fn concurrent_pins_are_all_counted() {
    loom::model(|| {
        let s = Arc::new(EntryState::ready());
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let s = s.clone();
                thread::spawn(move || s.try_pin(0).is_some())
            })
            .collect();
        let wins = handles.into_iter().map(|h| h.join().unwrap()).filter(|&w| w).count();
        assert_eq!(wins, 2);
        assert_eq!(s.load(), (BlockState::Ready, 2));
        assert!(!s.try_claim(0));
    });
}

#[test]
fn a_stale_reader_never_pins_the_slots_next_block() {
    loom::model(|| {
        // The reader read (slot, generation 0) from the map; meanwhile the writer evicts the
        // block and reuses the slot for a new one (generation 1).
        let s = Arc::new(EntryState::ready());
        let s2 = s.clone();
        let stale = thread::spawn(move || s2.try_pin(0).is_some());
        let reused = if s.try_claim(0) {
            let generation = s.occupy(BlockState::Writing);
            assert!(s.mark_ready(generation));
            Some(generation)
        } else {
            None
        };
        let pinned = stale.join().unwrap();
        let (state, pins, generation) = s.load_with_generation();
        assert_eq!(state, BlockState::Ready);
        match reused {
            Some(g) => {
                assert!(!pinned, "a stale pin landed on the slot's next block");
                assert_eq!((pins, generation), (0, g));
            }
            None => {
                assert!(pinned, "the eviction lost only to the pin");
                assert_eq!((pins, generation), (1, 0));
            }
        }
        assert!(!s.is_ready_at(generation.wrapping_add(1)));
    });
}

/// A reader compares a slot's key record while a writer evicts the slot's block and puts another
/// key's block in its place. `torn` is the first 8 bytes of the new key followed by the last 8
/// of the old one: a reader mixing words of the two records would match it.
#[test]
fn a_chained_read_never_sees_a_key_the_slot_does_not_hold() {
    let old = BlockKey::from_bytes(&[0x11; 16]).unwrap();
    let new = BlockKey::from_bytes(&[0x22; 16]).unwrap();
    let mut mixed = [0x22u8; 16];
    mixed[8..].fill(0x11);
    loom::model(move || {
        let state = Arc::new(EntryState::vacant());
        let keys = Arc::new(SlotKeys::new(1));
        let first = occupy_slot(&state, &keys, 0, &old, BlockState::Writing);
        assert!(state.mark_ready(first));
        let (s2, k2) = (state.clone(), keys.clone());
        let writer = thread::spawn(move || {
            assert!(s2.try_claim(first));
            let second = occupy_slot(&s2, &k2, 0, &new, BlockState::Writing);
            assert!(s2.mark_ready(second));
        });
        let torn = probe_slot(&state, &keys, 0, &KeyRef::bytes(&mixed).unwrap());
        let saw_old = probe_slot(&state, &keys, 0, &old.as_probe().key_ref());
        let saw_new = probe_slot(&state, &keys, 0, &new.as_probe().key_ref());
        writer.join().unwrap();
        assert_eq!(torn, None, "a torn record was taken for a key");
        assert!(matches!(saw_old, None | Some(BlockState::Ready)), "{saw_old:?}");
        assert!(matches!(saw_new, None | Some(BlockState::Writing | BlockState::Ready)), "{saw_new:?}");
        // Program order: once the reader saw the new key, the old one is gone for good.
        assert_eq!(probe_slot(&state, &keys, 0, &old.as_probe().key_ref()), None);
        assert_eq!(probe_slot(&state, &keys, 0, &new.as_probe().key_ref()), Some(BlockState::Ready));
        assert_eq!(keys.read(0), new);
    });
}

/// A failed store vacates its slot (Writing -> Evicting) and the slot is reused: a reader must
/// never report the new key with the failed block's state, nor the failed key at all afterwards.
#[test]
fn a_chained_read_across_a_failed_store_and_reuse() {
    let failed = BlockKey::from_int(1);
    let next = BlockKey::from_int(2);
    loom::model(move || {
        let state = Arc::new(EntryState::vacant());
        let keys = Arc::new(SlotKeys::new(1));
        let first = occupy_slot(&state, &keys, 0, &failed, BlockState::Writing);
        let (s2, k2) = (state.clone(), keys.clone());
        let writer = thread::spawn(move || {
            assert!(s2.abandon_write(first));
            occupy_slot(&s2, &k2, 0, &next, BlockState::Ready)
        });
        let saw_failed = probe_slot(&state, &keys, 0, &failed.as_probe().key_ref());
        let saw_next = probe_slot(&state, &keys, 0, &next.as_probe().key_ref());
        let second = writer.join().unwrap();
        assert!(matches!(saw_failed, None | Some(BlockState::Writing)), "{saw_failed:?}");
        assert!(matches!(saw_next, None | Some(BlockState::Ready)), "{saw_next:?}");
        assert_eq!(state.load_with_generation(), (BlockState::Ready, 0, second));
        assert_eq!(probe_slot(&state, &keys, 0, &failed.as_probe().key_ref()), None);
    });
}

/// As above, but the eviction and the reuse are made by two writers, handing the slot over
/// through the index's mutex (as two threads' stores do): the reader's fence then pairs with a
/// fence in a thread other than the one that vacated the slot.
#[test]
fn a_chained_read_across_two_writers() {
    use loom::sync::Mutex;
    let old = BlockKey::from_bytes(&[0x11; 16]).unwrap();
    let new = BlockKey::from_bytes(&[0x22; 16]).unwrap();
    let mut mixed = [0x22u8; 16];
    mixed[8..].fill(0x11);
    loom::model(move || {
        let state = Arc::new(EntryState::vacant());
        let keys = Arc::new(SlotKeys::new(1));
        let first = occupy_slot(&state, &keys, 0, &old, BlockState::Writing);
        assert!(state.mark_ready(first));
        // The index's mutex; true while the slot is vacant.
        let lock = Arc::new(Mutex::new(false));
        let evictor = {
            let (state, lock) = (state.clone(), lock.clone());
            thread::spawn(move || {
                let mut vacant = lock.lock().unwrap();
                assert!(state.try_claim(first));
                *vacant = true;
            })
        };
        let reuser = {
            let (state, keys, lock) = (state.clone(), keys.clone(), lock.clone());
            thread::spawn(move || {
                let mut vacant = lock.lock().unwrap();
                if *vacant {
                    occupy_slot(&state, &keys, 0, &new, BlockState::Ready);
                    *vacant = false;
                }
            })
        };
        let torn = probe_slot(&state, &keys, 0, &KeyRef::bytes(&mixed).unwrap());
        let saw_old = probe_slot(&state, &keys, 0, &old.as_probe().key_ref());
        let saw_new = probe_slot(&state, &keys, 0, &new.as_probe().key_ref());
        evictor.join().unwrap();
        reuser.join().unwrap();
        assert_eq!(torn, None, "a torn record was taken for a key");
        assert!(matches!(saw_old, None | Some(BlockState::Ready)), "{saw_old:?}");
        assert!(matches!(saw_new, None | Some(BlockState::Ready)), "{saw_new:?}");
        assert_eq!(probe_slot(&state, &keys, 0, &old.as_probe().key_ref()), None);
    });
}
