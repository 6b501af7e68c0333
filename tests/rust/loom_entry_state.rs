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

/// The keys of the chained-read models: the block evicted, the block that takes its slot, and
/// `torn`, the first 8 bytes of the new key followed by the last 8 of the old one, which a reader
/// mixing words of the two records would match.
fn old_new_torn() -> (BlockKey, BlockKey, [u8; 16]) {
    let mut torn = [0x22u8; 16];
    torn[8..].fill(0x11);
    (BlockKey::from_bytes(&[0x11; 16]).unwrap(), BlockKey::from_bytes(&[0x22; 16]).unwrap(), torn)
}

/// Slot 0 of a one-slot arena holding `key`'s block in `state`; returns its generation too.
fn slot_holding(key: &BlockKey, state: BlockState) -> (Arc<EntryState>, Arc<SlotKeys>, u32) {
    let (entry, keys) = (Arc::new(EntryState::vacant()), Arc::new(SlotKeys::new(1)));
    let generation = occupy_slot(&entry, &keys, 0, key, BlockState::Writing);
    if state == BlockState::Ready {
        assert!(entry.mark_ready(generation));
    }
    (entry, keys, generation)
}

/// A slot holding the old key of `ks` in `state`, and a thread running `write` on it (with the
/// block's generation and the new key), started.
fn writer_on_a_slot_holding<R: Send + 'static>(
    ks: &(BlockKey, BlockKey, [u8; 16]),
    state: BlockState,
    write: impl FnOnce(&EntryState, &SlotKeys, u32, &BlockKey) -> R + Send + 'static,
) -> (Arc<EntryState>, Arc<SlotKeys>, u32, thread::JoinHandle<R>) {
    let (entry, keys, first) = slot_holding(&ks.0, state);
    let (e2, k2, new) = (entry.clone(), keys.clone(), ks.1);
    let writer = thread::spawn(move || write(&e2, &k2, first, &new));
    (entry, keys, first, writer)
}

fn probe(state: &EntryState, keys: &SlotKeys, key: &BlockKey) -> Option<BlockState> {
    probe_slot(state, keys, 0, &key.as_probe().key_ref()).map(|(s, _)| s)
}

/// A reader walking the slot (the torn key, the old, the new) while it changes hands: it must
/// never match the torn key, and may see the old key only ready and the new one only as `new_as`.
fn read_while_the_slot_changes_hands(
    state: &EntryState,
    keys: &SlotKeys,
    (old, new, torn): &(BlockKey, BlockKey, [u8; 16]),
    new_as: &[BlockState],
) {
    assert_eq!(probe_slot(state, keys, 0, &KeyRef::bytes(torn).unwrap()), None, "a torn record was taken for a key");
    let saw_old = probe(state, keys, old);
    assert!(matches!(saw_old, None | Some(BlockState::Ready)), "{saw_old:?}");
    let saw_new = probe(state, keys, new);
    assert!(saw_new.is_none_or(|s| new_as.contains(&s)), "{saw_new:?}");
}

/// A reader compares a slot's key record while a writer evicts the slot's block and puts another
/// key's block in its place.
#[test]
fn a_chained_read_never_sees_a_key_the_slot_does_not_hold() {
    let ks = old_new_torn();
    loom::model(move || {
        let (state, keys, _, writer) = writer_on_a_slot_holding(&ks, BlockState::Ready, |state, keys, first, new| {
            assert!(state.try_claim(first));
            let second = occupy_slot(state, keys, 0, new, BlockState::Writing);
            assert!(state.mark_ready(second));
        });
        read_while_the_slot_changes_hands(&state, &keys, &ks, &[BlockState::Writing, BlockState::Ready]);
        writer.join().unwrap();
        // Once the writer is done, the old key is gone for good.
        assert_eq!(probe(&state, &keys, &ks.0), None);
        assert_eq!(probe(&state, &keys, &ks.1), Some(BlockState::Ready));
        assert_eq!(keys.read(0), ks.1);
    });
}

/// A failed store vacates its slot (Writing -> Evicting) and the slot is reused: a reader must
/// never report the new key with the failed block's state, nor the failed key at all afterwards.
#[test]
fn a_chained_read_across_a_failed_store_and_reuse() {
    let failed = BlockKey::from_int(1);
    let next = BlockKey::from_int(2);
    loom::model(move || {
        let (state, keys, first) = slot_holding(&failed, BlockState::Writing);
        let (s2, k2) = (state.clone(), keys.clone());
        let writer = thread::spawn(move || {
            assert!(s2.abandon_write(first));
            occupy_slot(&s2, &k2, 0, &next, BlockState::Ready)
        });
        let saw_failed = probe(&state, &keys, &failed);
        let saw_next = probe(&state, &keys, &next);
        let second = writer.join().unwrap();
        assert!(matches!(saw_failed, None | Some(BlockState::Writing)), "{saw_failed:?}");
        assert!(matches!(saw_next, None | Some(BlockState::Ready)), "{saw_next:?}");
        assert_eq!(state.load_with_generation(), (BlockState::Ready, 0, second));
        assert_eq!(probe(&state, &keys, &failed), None);
    });
}

/// As the first, but the eviction and the reuse are made by two writers, handing the slot over
/// through the index's mutex (as two threads' stores do): the reader's fence then pairs with a
/// fence in a thread other than the one that vacated the slot.
#[test]
fn a_chained_read_across_two_writers() {
    use loom::sync::Mutex;
    let ks = old_new_torn();
    loom::model(move || {
        let (state, keys, first) = slot_holding(&ks.0, BlockState::Ready);
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
            let (state, keys, lock, new) = (state.clone(), keys.clone(), lock.clone(), ks.1);
            thread::spawn(move || {
                let mut vacant = lock.lock().unwrap();
                if *vacant {
                    occupy_slot(&state, &keys, 0, &new, BlockState::Ready);
                    *vacant = false;
                }
            })
        };
        read_while_the_slot_changes_hands(&state, &keys, &ks, &[BlockState::Ready]);
        evictor.join().unwrap();
        reuser.join().unwrap();
        assert_eq!(probe(&state, &keys, &ks.0), None);
    });
}

/// A completion walking a chain (`TierIndex::complete_store`) compares the slot's key record and
/// marks the block ready at the generation that compare returned, while a writer fails that
/// store and puts another key's block, being written, in the slot. The completion may make the
/// old block ready before the failure (then the failure does not happen) but must never make
/// the new key's block ready.
#[test]
fn a_chained_completion_never_completes_the_next_block_in_the_slot() {
    let ks = old_new_torn();
    loom::model(move || {
        let (state, keys, first, writer) =
            writer_on_a_slot_holding(&ks, BlockState::Writing, |state, keys, first, new| {
                state.abandon_write(first).then(|| occupy_slot(state, keys, 0, new, BlockState::Writing))
            });
        let completed = probe_slot(&state, &keys, 0, &ks.0.as_probe().key_ref())
            .is_some_and(|(_, generation)| state.mark_ready(generation));
        let reused = writer.join().unwrap();
        match reused {
            // The failure won: whatever the completion saw, the new block is still being written.
            Some(second) => {
                assert!(!completed, "the failed store was reported completed");
                assert_eq!(state.load_with_generation(), (BlockState::Writing, 0, second));
            }
            // The completion won: the old block is ready and the writer found nothing to fail.
            None => {
                assert!(completed);
                assert_eq!(state.load_with_generation(), (BlockState::Ready, 0, first));
            }
        }
    });
}
