use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use super::*;

fn k(i: i128) -> BlockKey {
    BlockKey::from_int(i)
}
fn keys(r: std::ops::Range<i128>) -> Vec<BlockKey> {
    r.map(k).collect()
}

fn index(cap: usize, policy: PolicyKind) -> TierIndex {
    TierIndex::new(IndexConfig { policy, ..IndexConfig::new(cap) }).unwrap()
}

fn store(ix: &TierIndex, ks: &[BlockKey]) -> StoreOutcome {
    let out = ix.prepare_store(ks, InsertHint::default()).unwrap();
    let written: Vec<_> = out.to_write.iter().map(|(k, _)| *k).collect();
    ix.complete_store(&written, true);
    out
}

#[test]
fn store_lookup_and_prefix_semantics() {
    let ix = index(8, PolicyKind::Lru);
    let out = ix.prepare_store(&keys(0..4), InsertHint::default()).unwrap();
    assert_eq!(out.to_write.len(), 4);
    assert_eq!(ix.lookup_prefix(&keys(0..4)), 0, "blocks being written are not readable");
    ix.complete_store(&keys(0..4), true);
    assert_eq!(ix.lookup_prefix(&keys(0..6)), 4);
    assert_eq!(ix.lookup_prefix(&[k(0), k(9), k(1)]), 1);
    let again = ix.prepare_store(&keys(2..6), InsertHint::default()).unwrap();
    assert_eq!(again.already_present(&keys(2..6)), vec![k(2), k(3)]);
    assert_eq!(again.to_write.len(), 2);
}

#[test]
fn tail_of_a_chain_is_evicted_before_its_head() {
    for policy in PolicyKind::ALL {
        let ix = index(4, policy);
        store(&ix, &keys(0..4));
        let out = store(&ix, &keys(10..12));
        let evicted: Vec<_> = out.evicted.iter().map(|(k, _)| *k).collect();
        assert_eq!(evicted, vec![k(3), k(2)], "{policy:?}");
        assert_eq!(ix.lookup_prefix(&keys(0..4)), 2);
    }
}

#[test]
fn pinned_and_writing_blocks_are_never_evicted_and_failure_changes_nothing() {
    let ix = index(4, PolicyKind::Lru);
    store(&ix, &keys(0..2));
    ix.prepare_store(&keys(2..4), InsertHint::default()).unwrap(); // writing
    ix.pin_for_load(&keys(0..2)).unwrap();
    let before = ix.snapshot().len();
    let err = ix.prepare_store(&[k(9)], InsertHint::default()).unwrap_err();
    assert!(matches!(err, KvError::NoSpace { needed: 1, available: 0 }));
    assert_eq!(ix.snapshot().len(), before);
    ix.unpin(&[k(1)]).unwrap();
    let out = ix.prepare_store(&[k(9)], InsertHint::default()).unwrap();
    assert_eq!(out.evicted.iter().map(|(k, _)| *k).collect::<Vec<_>>(), vec![k(1)]);
    assert!(ix.unpin(&[k(1)]).is_err());
}

#[test]
fn all_or_nothing_store_when_batch_exceeds_evictable() {
    let ix = index(4, PolicyKind::Lru);
    store(&ix, &keys(0..4));
    ix.pin_for_load(&[k(0), k(1)]).unwrap();
    assert!(ix.prepare_store(&keys(10..13), InsertHint::default()).is_err());
    assert_eq!(ix.lookup_prefix(&keys(0..4)), 4, "nothing was evicted");
    assert_eq!(ix.policy_len(), 4);
}

#[test]
fn failed_store_frees_the_slot() {
    let ix = index(2, PolicyKind::Lru);
    ix.prepare_store(&keys(0..2), InsertHint::default()).unwrap();
    assert_eq!(ix.complete_store(&keys(0..2), false), 2);
    assert_eq!(ix.len(), 0);
    assert_eq!(ix.policy_len(), 0);
    assert_eq!(ix.stats().stores_failed, 2);
}

#[test]
fn admission_after_uses_refuses_first_offer() {
    let ix = TierIndex::new(IndexConfig { admission: AdmissionRule::AfterUses(2), ..IndexConfig::new(8) }).unwrap();
    let out = ix.prepare_store(&keys(0..3), InsertHint::default()).unwrap();
    assert_eq!(out.refused.len(), 3);
    let out = ix.prepare_store(&keys(0..3), InsertHint::default()).unwrap();
    assert_eq!(out.to_write.len(), 3);
    assert_eq!(ix.stats().store_refused, 3);
}

#[test]
fn a_promotion_is_not_asked_the_admission_rule_again() {
    for rule in [AdmissionRule::AfterUses(2), AdmissionRule::MinPriority(50)] {
        let ix = TierIndex::new(IndexConfig { admission: rule, ..IndexConfig::new(8) }).unwrap();
        assert_eq!(ix.prepare_store(&keys(0..2), InsertHint::default()).unwrap().refused.len(), 2, "{rule:?}");
        let out = ix.prepare_store_as(&keys(2..4), InsertHint::default(), Admit::Already).unwrap();
        assert_eq!((out.to_write.len(), out.refused.len()), (2, 0), "{rule:?}");
        let out = ix.try_prepare_store_as(&keys(4..5), InsertHint::default(), Admit::Already).unwrap().unwrap();
        assert_eq!(out.to_write.len(), 1, "{rule:?}");
        assert_eq!(ix.stats().store_refused, 2, "{rule:?}");
    }
}

#[test]
fn pin_is_all_or_nothing() {
    let ix = index(4, PolicyKind::Lru);
    store(&ix, &keys(0..2));
    assert!(ix.pin_for_load(&[k(0), k(1), k(2)]).is_err());
    assert_eq!(ix.state_of(&k(0)).unwrap().1, 0, "partial pin was undone");
    let slots = ix.pin_for_load(&keys(0..2)).unwrap();
    assert_eq!(slots.len(), 2);
    assert_eq!(ix.remove(&keys(0..2)).len(), 0, "pinned blocks are not removed");
    ix.unpin(&keys(0..2)).unwrap();
    assert_eq!(ix.remove(&keys(0..2)).len(), 2);
}

#[test]
fn zero_capacity_is_a_clear_error() {
    let e = TierIndex::new(IndexConfig::new(0)).err().unwrap().to_string();
    assert!(e.contains("capacity"), "{e}");
}

/// Writers store and evict while readers look up and pin; invariants are checked all along:
/// a pinned block's slot is never handed to another key, capacity is never exceeded, and the
/// policy and the map agree at the end.
#[test]
fn stress_concurrent_readers_and_writers_keep_invariants() {
    let ix = Arc::new(index(64, PolicyKind::Arc));
    let stop = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::new();
    for t in 0..2 {
        let ix = ix.clone();
        handles.push(std::thread::spawn(move || {
            let mut seed = 12345u64 + t;
            for _ in 0..3000 {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                let start = (seed >> 33) as i128 % 200;
                let ks = keys(start..start + 4);
                if let Ok(out) = ix.prepare_store(&ks, InsertHint::default()) {
                    let w: Vec<_> = out.to_write.iter().map(|(k, _)| *k).collect();
                    ix.complete_store(&w, seed % 7 != 0);
                }
                assert!(ix.len() <= 64);
            }
        }));
    }
    for t in 0..2 {
        let ix = ix.clone();
        let stop = stop.clone();
        handles.push(std::thread::spawn(move || {
            let mut seed = 999u64 + t;
            while !stop.load(Ordering::Relaxed) {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                let start = (seed >> 33) as i128 % 200;
                let ks = keys(start..start + 4);
                let n = ix.lookup_prefix(&ks);
                if n > 0 {
                    if let Ok(slots) = ix.pin_for_load(&ks[..n]) {
                        for (key, slot) in ks[..n].iter().zip(&slots) {
                            let (state, pins, s) = ix.state_of(key).expect("pinned key vanished");
                            assert_eq!(state, BlockState::Ready);
                            assert!(pins >= 1);
                            assert_eq!(s, *slot, "pinned key moved slot");
                        }
                        ix.unpin(&ks[..n]).unwrap();
                    }
                }
            }
        }));
    }
    for h in handles.drain(..2) {
        h.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().unwrap();
    }
    let snap = ix.snapshot();
    assert_eq!(snap.len(), ix.len());
    assert_eq!(ix.policy_len(), ix.len());
    let mut slots: Vec<u32> = snap.iter().map(|s| s.3).collect();
    slots.sort();
    slots.dedup();
    assert_eq!(slots.len(), snap.len(), "two keys share a slot");
    assert!(snap.iter().all(|s| s.2 == 0), "pins leaked");
}

#[test]
fn a_batch_never_evicts_its_own_keys() {
    let ix = index(3, PolicyKind::Lru);
    store(&ix, &keys(0..3)); // LRU order: 2, 1, 0 (tail first)
                             // 2 is the least recent, but it is part of this batch: the victim must be 1.
    let out = ix.prepare_store(&[k(2), k(7)], InsertHint::default()).unwrap();
    assert_eq!(out.already_present(&[k(2), k(7)]), vec![k(2)]);
    assert_eq!(out.evicted.iter().map(|(k, _)| *k).collect::<Vec<_>>(), vec![k(1)]);
    // With only batch keys evictable, the store is refused.
    let ix = index(1, PolicyKind::Lru);
    store(&ix, &[k(0)]);
    assert!(matches!(ix.prepare_store(&[k(0), k(5)], InsertHint::default()), Err(KvError::NoSpace { .. })));
}

#[test]
fn a_stale_map_value_never_reaches_the_slots_next_block() {
    // One slot: key 1 takes it, is evicted by key 2, which reuses the slot (next generation).
    let ix = index(1, PolicyKind::Lru);
    store(&ix, &[k(1)]);
    let (_, _, slot1) = ix.state_of(&k(1)).unwrap();
    let stale = ix.find(&k(1).as_probe(), &Guard::new()).unwrap();
    let out = ix.prepare_store(&[k(2)], InsertHint::default()).unwrap();
    assert_eq!(out.evicted, vec![(k(1), slot1)]);
    assert_eq!(out.to_write, vec![(k(2), slot1)]);
    // A reader still holding key 1's (slot, generation) sees neither a block nor a pin target.
    let e = ix.state(stale.slot);
    assert!(!e.is_ready_at(stale.generation));
    assert_eq!(e.try_pin(stale.generation), None);
    assert!(!e.mark_ready(stale.generation), "a stale completion must not publish key 2");
    assert_eq!(ix.lookup_prefix(&[k(2)]), 0, "key 2 is still being written");
    ix.complete_store(&[k(2)], true);
    assert_eq!(ix.lookup_prefix(&[k(2)]), 1);
    assert_eq!(ix.lookup_prefix(&[k(1)]), 0);
    assert_eq!(ix.state_of(&k(1)), None);
}

#[test]
fn probes_borrowed_from_the_caller_find_the_same_blocks() {
    use crate::keys::KeyProbe;
    let ix = index(4, PolicyKind::Lru);
    let a = BlockKey::from_bytes(b"block-a").unwrap();
    ix.prepare_store(&[a, k(5)], InsertHint::default()).unwrap();
    assert_eq!(ix.complete_store(&[KeyProbe::bytes(b"block-a").unwrap(), KeyProbe::int(5)], true), 2);
    let reader = ix.reader();
    assert!(reader.is_ready(&KeyProbe::bytes(b"block-a").unwrap()));
    assert!(reader.is_ready(&KeyProbe::int(5)));
    assert!(!reader.is_ready(&KeyProbe::bytes(b"block-b").unwrap()));
    assert!(!reader.is_ready(&KeyProbe::bytes(&5i128.to_le_bytes()).unwrap()), "an int is not its bytes");
    assert_eq!(ix.lookup_state(&KeyProbe::int(5)), Some(BlockState::Ready));
}

#[test]
fn a_reader_never_sees_the_next_blocks_state_under_a_stale_key() {
    // One slot. The writer stores K2 and fails it (K2 is never readable), then stores K, which
    // takes the same slot, and removes it again. A reader asking for K2 must never get Ready:
    // that would be K's state read through K2's stale map entry (the slot's next generation).
    // A stress test: the race window is a few instructions wide, so it is not caught every run.
    let ix = Arc::new(index(1, PolicyKind::Lru));
    let stop = Arc::new(AtomicBool::new(false));
    let (k_other, k_failed) = (k(1), k(2));
    let reader = {
        let (ix, stop) = (ix.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                assert_ne!(
                    ix.lookup_state(&k_failed.as_probe()),
                    Some(BlockState::Ready),
                    "a failed store read as ready"
                );
                // Being written, or being dropped after the failure: never ready.
                let state = ix.state_of(&k_failed).map(|(s, _, _)| s);
                assert_ne!(state, Some(BlockState::Ready), "a failed store's slot read as ready");
            }
        })
    };
    for _ in 0..200_000 {
        ix.prepare_store(&[k_failed], InsertHint::default()).unwrap();
        ix.complete_store(&[k_failed], false);
        ix.prepare_store(&[k_other], InsertHint::default()).unwrap();
        ix.complete_store(&[k_other], true);
        ix.remove(&[k_other]);
    }
    stop.store(true, Ordering::Relaxed);
    reader.join().unwrap();
}

#[test]
fn chained_reads_never_report_a_failed_store_as_ready() {
    // The writer keeps storing chain X (kept) and chain F (every store fails) into the same few
    // slots, so F's blocks sit, while being written, in exactly the slots after X's blocks that
    // chained lookups compare first. A reader walking a chain that switches from X to F must
    // never get past the switch, by either chained path (batch prefix, per-key hint).
    // A stress test: the race windows are a few instructions wide.
    let ix = Arc::new(index(8, PolicyKind::Lru));
    let stop = Arc::new(AtomicBool::new(false));
    let walking = Arc::new(AtomicUsize::new(0)); // readers that have seen a block
    let xs = keys(0..4);
    let fs = keys(100..104);
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (ix, stop, walking, xs, fs) = (ix.clone(), stop.clone(), walking.clone(), xs.clone(), fs.clone());
            std::thread::spawn(move || {
                let mut walked = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for cut in 1..4 {
                        let chain: Vec<BlockKey> = xs[..cut].iter().chain(&fs[cut..]).copied().collect();
                        assert!(ix.lookup_prefix(&chain) <= cut, "a failed store read as ready (batch)");
                        for (i, key) in chain.iter().enumerate() {
                            let state = ix.lookup_state(&key.as_probe());
                            if i >= cut {
                                assert_ne!(state, Some(BlockState::Ready), "a failed store read as ready (hint)");
                            }
                            if state.is_none() {
                                break;
                            }
                            walked += 1;
                            if walked == 1 {
                                walking.fetch_add(1, Ordering::SeqCst);
                            }
                        }
                    }
                }
                walked
            })
        })
        .collect();
    let rounds = if cfg!(debug_assertions) { 20_000 } else { 100_000 };
    // At least `rounds` rounds, and on until both readers have seen a block while the writer
    // runs (the OS may start them late), or one of them stopped (its panic is reported below).
    // It stops after an odd round, which leaves xs stored.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    for round in 0.. {
        ix.prepare_store(&xs, InsertHint::default()).unwrap();
        ix.complete_store(&xs, true);
        ix.prepare_store(&fs, InsertHint::default()).unwrap();
        ix.complete_store(&fs, false);
        if round % 2 == 0 {
            ix.remove(&xs);
        } else if round >= rounds
            && (walking.load(Ordering::SeqCst) == 2
                || readers.iter().any(|r| r.is_finished())
                || std::time::Instant::now() > deadline)
        {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let walked: u64 = readers.into_iter().map(|r| r.join().unwrap()).sum();
    assert!(walked > 0, "the readers never saw a block: the test did not exercise chained reads");
    // Chains stored in one call take ascending slots (what chained reads rely on).
    let slots: Vec<u32> = xs.iter().map(|k| ix.state_of(k).unwrap().2).collect();
    assert!(slots.windows(2).all(|w| w[0] < w[1]), "{slots:?}");
}

#[test]
fn repeated_keys_count_once_in_short_and_long_batches() {
    // Batches below and above the length where duplicate detection switches from a scan to a set.
    for n in [3i128, 32, 33, 100] {
        let ix = index(256, PolicyKind::Lru);
        let mut batch = keys(0..n);
        batch.extend(keys(0..n).into_iter().rev());
        batch.push(k(n / 2));
        let out = ix.prepare_store(&batch, InsertHint::default()).unwrap();
        assert_eq!(out.to_write.len(), n as usize, "n={n}");
        assert_eq!(out.already_present_pos.len(), n as usize + 1, "n={n}");
        assert_eq!(out.to_write_pos, (0..n as usize).collect::<Vec<_>>());
        assert_eq!(ix.len(), n as usize);
    }
}

#[test]
fn chained_compares_in_stores_and_completions_agree_with_the_map() {
    // Stores recognise present keys, and completions find keys, by comparing the slot after the
    // previous key's first; this mixes chains so that slot often holds another key.
    let ix = index(16, PolicyKind::Lru);
    store(&ix, &keys(0..4));
    store(&ix, &keys(10..14));
    let batch = [k(0), k(10), k(1), k(2), k(11), k(50), k(3), k(51), k(50)];
    let out = ix.prepare_store(&batch, InsertHint::default()).unwrap();
    assert_eq!(out.already_present_pos, vec![0, 1, 2, 3, 4, 6, 8], "the repeat of 50 is present");
    assert_eq!(out.to_write_pos, vec![5, 7]);
    assert_eq!(out.already_present(&batch), vec![k(0), k(10), k(1), k(2), k(11), k(3), k(50)]);
    // k(0) is ready already, k(99) absent: only the two new keys complete, in any order.
    assert_eq!(ix.complete_store(&[k(0), k(51), k(99), k(50)], true), 2);
    assert_eq!(ix.lookup_prefix(&[k(50), k(51)]), 2);

    // A completion walking a chain whose next key failed and whose slot went to another store
    // must not complete that other store (two slots: x takes 0, y 1, and z reuses y's).
    let ix = index(2, PolicyKind::Lru);
    let (x, y, z) = (k(20), k(21), k(22));
    ix.prepare_store(&[x, y], InsertHint::default()).unwrap();
    assert_eq!(ix.complete_store(&[y], false), 1);
    let reuse = ix.prepare_store(&[z], InsertHint::default()).unwrap();
    assert_eq!(reuse.to_write, vec![(z, ix.state_of(&x).unwrap().2 + 1)], "z must sit in the slot after x");
    assert_eq!(ix.complete_store(&[x, y], true), 1, "only x: y is gone");
    assert_eq!(ix.state_of(&z).map(|(s, _, _)| s), Some(BlockState::Writing));
    assert_eq!(ix.complete_store(&[x, z], true), 1);
    assert_eq!(ix.lookup_prefix(&[x, z]), 2);
}

#[test]
fn keys_whose_hashes_collide_are_kept_apart() {
    let ix = index(8, PolicyKind::Lru);
    let forced = |name: &[u8]| BlockKey::with_forced_hash(name, 7);
    let (a, b, c) = (forced(b"key-a"), forced(b"key-b"), forced(b"key-c"));
    // One store per call, in slots that are not adjacent, so no chained compare helps.
    store(&ix, &[a]);
    store(&ix, &[k(100)]);
    store(&ix, &[b]);
    assert_eq!(ix.map.collided_len(), 1);
    let found = |key: &BlockKey| ix.lookup_prefix(std::slice::from_ref(key)) == 1;
    assert!(found(&a) && found(&b) && !found(&c));
    assert_ne!(ix.state_of(&a).unwrap().2, ix.state_of(&b).unwrap().2);
    let out = ix.prepare_store(&[c, a, b], InsertHint::default()).unwrap();
    assert_eq!((out.to_write.len(), out.already_present_pos.clone()), (1, vec![1, 2]));
    ix.complete_store(&[c], true);
    assert_eq!(ix.map.collided_len(), 2);
    // The key holding the hash leaves: the others stay findable, and it comes back.
    assert_eq!(ix.remove(&[a]).len(), 1);
    assert!(!found(&a) && found(&b) && found(&c));
    store(&ix, &[a]);
    assert!(found(&a) && found(&b) && found(&c));
    assert_eq!(ix.pin_for_load(&[b, c]).unwrap().len(), 2);
    assert_eq!(ix.remove(&[a, b, c]).len(), 1, "pinned blocks stay");
    ix.unpin(&[b, c]).unwrap();
    assert_eq!(ix.remove(&[b, c]).len(), 2);
    assert_eq!((ix.map.collided_len(), ix.len()), (0, 1));
}

#[test]
fn random_stores_and_removals_of_colliding_keys_match_a_set() {
    // 24 keys on 3 hashes, stored, failed and removed at random: every key is found exactly
    // when a plain set says it is resident.
    let ix = index(10, PolicyKind::Lru);
    let ks: Vec<BlockKey> =
        (0..24u64).map(|i| BlockKey::with_forced_hash(format!("key-{i}").as_bytes(), i % 3)).collect();
    let mut resident = std::collections::HashSet::new();
    let mut most_collided = 0;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % n) as usize
    };
    let position = |key: &BlockKey| ks.iter().position(|x| x == key).unwrap();
    for _ in 0..5_000 {
        let i = next(24);
        let key = ks[i];
        if next(2) == 0 {
            if let Ok(out) = ix.prepare_store(&[key], InsertHint::default()) {
                for (evicted, _) in &out.evicted {
                    resident.remove(&position(evicted));
                }
                let fail = next(4) == 0;
                ix.complete_store(&[key], !fail);
                if !fail {
                    resident.insert(i);
                }
            }
        } else if ix.remove(&[key]).len() == 1 {
            resident.remove(&i);
        }
        for (i, key) in ks.iter().enumerate() {
            assert_eq!(ix.lookup_prefix(std::slice::from_ref(key)) == 1, resident.contains(&i), "key {i}");
        }
        assert_eq!(ix.len(), resident.len());
        most_collided = most_collided.max(ix.map.collided_len());
    }
    assert!(most_collided >= 2, "the test never made keys collide");
}

fn manual(cap: usize, policy: PolicyKind) -> TierIndex {
    TierIndex::new(IndexConfig { policy, manual_clock: true, ..IndexConfig::new(cap) }).unwrap()
}

fn store_with(ix: &TierIndex, ks: &[BlockKey], priority: u8, duration_ns: Option<u64>) {
    let out = ix.prepare_store(ks, InsertHint { priority, duration_ns }).unwrap();
    assert_eq!(out.to_write.len(), ks.len(), "stored anew");
    ix.complete_store(ks, true);
}

fn hint(priority: u8, duration_ns: Option<u64>) -> InsertHint {
    InsertHint { priority, duration_ns }
}

/// The keys a store of `new` evicts.
fn evicted_by(ix: &TierIndex, new: &[BlockKey]) -> Vec<BlockKey> {
    let out = ix.prepare_store(new, InsertHint::default()).unwrap();
    ix.complete_store(new, true);
    out.evicted.into_iter().map(|(k, _)| k).collect()
}

#[test]
fn a_renewal_overrides_the_priority_of_a_present_block() {
    let ix = manual(2, PolicyKind::Priority);
    store_with(&ix, &[k(1)], 80, None);
    store_with(&ix, &[k(2)], 35, None);
    // A store cannot do it: it leaves present keys alone.
    assert_eq!(ix.prepare_store(&[k(1)], hint(10, None)).unwrap().already_present_pos, vec![0]);
    assert_eq!(ix.with_entry(&k(1), |e| e.priority.load(Ordering::Relaxed)), Some(80));
    assert_eq!(ix.renew(&[k(1)], hint(10, None)).unwrap(), 1);
    assert_eq!(ix.with_entry(&k(1), |e| e.priority.load(Ordering::Relaxed)), Some(10));
    assert_eq!(evicted_by(&ix, &[k(3)]), vec![k(1)], "at 10, below the default-level block");
    assert_eq!(ix.stats().renewals, 1);
}

#[test]
fn a_renewal_with_a_duration_falls_back_to_the_default_level_when_it_lapses() {
    let ix = manual(2, PolicyKind::Priority);
    store_with(&ix, &[k(2)], 35, None);
    store_with(&ix, &[k(1)], 80, None); // for good, until renewed
    assert_eq!(ix.renew(&[k(1)], hint(80, Some(1_000))).unwrap(), 1);
    ix.clock().advance(999).unwrap();
    assert_eq!(evicted_by(&ix, &[k(3)]), vec![k(2)], "still at 80");
    ix.clock().advance(1).unwrap();
    // Back at 35, where it ranks by its renewal, before k(3)'s store.
    assert_eq!(evicted_by(&ix, &[k(4)]), vec![k(1)]);
}

#[test]
fn a_renewal_without_a_duration_clears_the_earlier_one() {
    let ix = manual(2, PolicyKind::Priority);
    store_with(&ix, &[k(1)], 80, Some(1_000));
    assert_eq!(ix.renew(&[k(1)], hint(80, None)).unwrap(), 1);
    store_with(&ix, &[k(2)], 35, None);
    ix.clock().advance(1_000_000).unwrap();
    assert_eq!(evicted_by(&ix, &[k(3)]), vec![k(2)], "k(1) stays at 80 for good");
    assert_eq!(evicted_by(&ix, &[k(4)]), vec![k(3)]);
}

#[test]
fn a_renewed_chain_keeps_its_head_the_more_recent() {
    // Applied tail-first like a store: at the new level the tail goes before the head.
    let ix = manual(3, PolicyKind::Priority);
    store(&ix, &keys(0..3));
    assert_eq!(ix.renew(&keys(0..2), hint(10, None)).unwrap(), 2);
    assert_eq!(evicted_by(&ix, &keys(10..12)), vec![k(1), k(0)]);
}

#[test]
fn a_renewal_ignores_absent_keys_and_counts_each_present_key_once() {
    let ix = manual(8, PolicyKind::Priority);
    store(&ix, &keys(0..3));
    ix.prepare_store(&[k(5)], InsertHint::default()).unwrap(); // being written
    ix.pin_for_load(&[k(1)]).unwrap();
    let batch = [k(0), k(99), k(0), k(5), k(1), k(98)];
    assert_eq!(ix.renew(&batch, hint(90, Some(10))).unwrap(), 3, "k(0), k(5) and the pinned k(1)");
    for key in [k(0), k(1), k(5)] {
        assert_eq!(ix.with_entry(&key, |e| e.priority.load(Ordering::Relaxed)), Some(90), "{key:?}");
    }
    assert_eq!(ix.with_entry(&k(2), |e| e.priority.load(Ordering::Relaxed)), Some(DEFAULT_PRIORITY));
    assert_eq!(ix.renew(&[k(99)], InsertHint::default()).unwrap(), 0);
    assert_eq!(ix.renew(&[], InsertHint::default()).unwrap(), 0);
    assert_eq!((ix.len(), ix.policy_len()), (4, 4), "nothing stored, nothing evicted");
    assert_eq!(ix.stats().renewals, 3);
    // A renewed block being written is still completed as usual.
    assert_eq!(ix.complete_store(&[k(5)], true), 1);
    // Validated like a store's hint, before anything changes.
    let err = ix.renew(&[k(0)], hint(101, None)).unwrap_err();
    assert!(matches!(err, KvError::InvalidArgument { arg: "priority", .. }), "{err}");
    assert_eq!(ix.stats().renewals, 3);
}

#[test]
fn a_renewal_changes_no_order_where_the_policy_ignores_the_hint() {
    for policy in [PolicyKind::Lru, PolicyKind::Fifo, PolicyKind::Arc, PolicyKind::S3Fifo, PolicyKind::HitDensity] {
        let run = |renew: bool| {
            let ix = index(4, policy);
            store(&ix, &keys(0..4)); // tail first: 3 is the least recent
            if renew {
                assert_eq!(ix.renew(&keys(2..4), hint(100, None)).unwrap(), 2);
                assert_eq!(ix.with_entry(&k(3), |e| e.priority.load(Ordering::Relaxed)), Some(100));
            }
            (evicted_by(&ix, &keys(10..12)), ix.stats().touches)
        };
        assert_eq!(run(true), run(false), "{policy:?}");
    }
}

/// Every operation of an index that has failed: reads miss, stores and pins are refused, the
/// other writes change nothing, stats say so.
fn assert_failed_closed(ix: &TierIndex, resident: &[BlockKey]) {
    assert!(ix.failure().is_some());
    assert_eq!(ix.lookup_prefix(resident), 0, "a failed index answers misses");
    assert!(resident.iter().all(|key| ix.lookup_state(key).is_none() && ix.state_of(key).is_none()));
    assert_eq!(ix.contains_ready(resident), vec![false; resident.len()]);
    assert!(matches!(ix.prepare_store(&[k(1000)], InsertHint::default()), Err(KvError::Failed(_))));
    assert!(matches!(ix.try_prepare_store(&[k(1000)], InsertHint::default()), Some(Err(KvError::Failed(_)))));
    assert!(matches!(ix.pin_for_load(resident), Err(KvError::Failed(_))));
    assert_eq!(ix.complete_store(resident, true), 0);
    assert_eq!(ix.complete_store(resident, false), 0);
    assert!(ix.remove(resident).is_empty());
    assert_eq!(ix.renew(resident, InsertHint { priority: 90, duration_ns: None }).unwrap(), 0);
    assert!(matches!(
        ix.renew(resident, InsertHint { priority: 101, duration_ns: None }),
        Err(KvError::InvalidArgument { .. })
    ));
    assert_eq!(ix.clear(), 0);
    ix.unpin(resident).unwrap();
    assert!(ix.snapshot().is_empty());
    assert_eq!(ix.stats().failed, 1);
    assert_eq!(ix.stats().renewals, 0);
}

#[test]
fn a_writer_that_panics_on_a_broken_invariant_fails_the_index_closed() {
    let ix = index(5, PolicyKind::Lru);
    store(&ix, &keys(0..4));
    // A block being written when the index fails: its completion must not make it readable.
    ix.prepare_store(&[k(50)], InsertHint::default()).unwrap();
    assert_eq!(ix.stats().failed, 0);
    // Break the "non-vacant slot => mapped" invariant behind the index's back (a bug
    // elsewhere would), then make a store evict that slot: its detach panics.
    let victim_slot = ix.state_of(&k(3)).unwrap().2;
    assert!(ix.map.remove(&k(3), victim_slot));
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        ix.prepare_store(&[k(10)], InsertHint::default()).ok();
    }));
    assert!(panicked.is_err(), "the store should have hit the broken invariant");
    assert!(ix.failure().unwrap().contains("panicked"), "{:?}", ix.failure());
    assert_eq!(ix.complete_store(&[k(50)], true), 0);
    assert_eq!(ix.lookup_prefix(&[k(50)]), 0);
    assert!(matches!(ix.pin_for_load(&[k(50)]), Err(KvError::Failed(_))));
    assert_failed_closed(&ix, &keys(0..3));
}

#[test]
fn a_panic_in_a_contained_update_fails_the_index_with_its_message() {
    let ix = index(4, PolicyKind::S3Fifo);
    store(&ix, &keys(0..2));
    assert_eq!(ix.contain(|| ix.lookup_prefix(&keys(0..2))), Some(2));
    assert!(ix.failure().is_none());
    let r: Option<()> = ix.contain(|| panic!("a bug on an I/O thread"));
    assert!(r.is_none());
    assert_eq!(ix.failure(), Some("panic: a bug on an I/O thread"));
    assert_failed_closed(&ix, &keys(0..2));
}

#[test]
fn an_injected_store_panic_fails_the_index_and_keeps_the_reason_given() {
    let ix = index(4, PolicyKind::Arc);
    store(&ix, &keys(0..4));
    ix.inject_store_panic();
    store(&ix, &[]); // a store that evicts nothing leaves the fault armed
    assert!(ix.failure().is_none());
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        ix.prepare_store(&keys(10..12), InsertHint::default()).ok();
    }));
    assert!(panicked.is_err());
    // The Python binding catches the panic and records its message; the first reason stays.
    ix.fail("panic: injected fault");
    ix.fail("a later reason");
    assert_eq!(ix.failure(), Some("panic: injected fault"));
    assert_failed_closed(&ix, &keys(0..2));
}

#[test]
fn lookups_count_exactly_when_stripes_pass_to_new_threads() {
    // Waves of threads: each wave's threads take the stripes the last wave handed back, and
    // more are alive at once than there are owned stripes, so some share the last one.
    let ix = Arc::new(index(64, PolicyKind::Lru));
    store(&ix, &keys(0..4));
    let rounds = 10_000;
    for _wave in 0..4 {
        let all_started = Arc::new(std::sync::Barrier::new(24));
        let threads: Vec<_> = (0..24)
            .map(|t| {
                let (ix, all_started) = (ix.clone(), all_started.clone());
                std::thread::spawn(move || {
                    all_started.wait(); // all at once: the shared stripe's adds race
                    for _ in 0..rounds {
                        assert_eq!(ix.lookup_state(&k(t % 4)), Some(BlockState::Ready));
                        assert_eq!(ix.lookup_prefix(&keys(0..4)), 4);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }
    let s = ix.stats();
    let per_kind = 4 * 24 * rounds;
    assert_eq!(s.lookups, 2 * per_kind);
    assert_eq!(s.lookup_keys, per_kind + per_kind * 4);
    assert_eq!(s.hit_blocks, per_kind + per_kind * 4);
}

#[test]
fn lookups_from_many_threads_are_all_counted() {
    // More threads than stripes, so some share one: every lookup still counts exactly once.
    let ix = Arc::new(index(64, PolicyKind::Lru));
    store(&ix, &keys(0..8));
    let threads: Vec<_> = (0..20)
        .map(|t| {
            let ix = ix.clone();
            std::thread::spawn(move || {
                for _ in 0..500 {
                    assert_eq!(ix.lookup_prefix(&keys(0..8)), 8);
                    assert_eq!(ix.lookup_state(&k(t % 8)), Some(BlockState::Ready));
                    assert_eq!(ix.lookup_state(&k(100)), None);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let s = ix.stats();
    let (calls, singles) = (20 * 500, 20 * 500 * 2);
    assert_eq!(s.lookups, calls + singles);
    assert_eq!(s.lookup_keys, calls * 8 + singles);
    assert_eq!(s.hit_blocks, calls * 8 + singles / 2);
}

#[test]
fn serial_lookups_answer_like_threaded_ones_and_count_in_the_same_totals() {
    // The serial forms (the Python binding's, under the GIL) keep their hint and counts in the
    // index instead of thread-locals; the answers and the totals must be the same.
    let ix = index(64, PolicyKind::Lru);
    let chain = keys(0..8);
    store(&ix, &chain);
    ix.complete_store(&chain, true);
    let pending = k(50);
    ix.prepare_store(&[pending], InsertHint::default()).unwrap();
    for round in 0..3 {
        // A chain walked head first (each next block is compared at the slot after the last),
        // then out of order, a block being written, and an absent key: the hint must never
        // make an answer wrong.
        for key in chain.iter().chain(chain.iter().rev()) {
            assert_eq!(ix.lookup_state_serial(key), Some(BlockState::Ready), "round {round}");
            assert_eq!(ix.lookup_state(key), Some(BlockState::Ready));
        }
        assert_eq!(ix.lookup_state_serial(&pending), Some(BlockState::Writing));
        assert_eq!(ix.lookup_state_serial(&k(100)), None);
        assert_eq!(ix.lookup_state(&k(100)), None);
    }
    ix.record_lookup_serial(3, 2);
    let s = ix.stats();
    // Per round: 16 serial + 16 threaded hits, 2 serial misses (Writing is not a hit), 1 threaded.
    let singles = 3 * (16 + 16 + 2 + 1);
    assert_eq!(s.lookups, singles + 1);
    assert_eq!(s.lookup_keys, singles + 3);
    assert_eq!(s.hit_blocks, 3 * 32 + 2);
}

#[test]
fn a_chain_extended_by_a_later_store_still_loses_its_tail_first() {
    // H, T stored; then H, T, U: U is T's child, so U must go before T (and T before H). Before,
    // the present H and T kept their old rank and the new U ranked above them: T, U's parent,
    // was evicted first and U was left unreachable. FIFO has no recency to refresh.
    let (h, t, u, x) = (k(1), k(2), k(3), k(4));
    for policy in [PolicyKind::Lru, PolicyKind::Arc, PolicyKind::Priority, PolicyKind::S3Fifo, PolicyKind::HitDensity] {
        let ix = index(3, policy);
        store(&ix, &[h, t]);
        let out = store(&ix, &[h, t, u]);
        assert_eq!(out.already_present_pos, vec![0, 1]);
        assert_eq!(evicted_by(&ix, &[x]), vec![u], "{policy:?}: the tail goes first");
        assert_eq!(ix.lookup_prefix(&[h, t]), 2, "{policy:?}");
    }
}

#[test]
fn a_store_of_a_chain_already_present_changes_no_rank() {
    // A repeated offer is not a use: with nothing new after them, present blocks keep their rank.
    let ix = index(3, PolicyKind::Lru);
    store(&ix, &[k(1)]);
    store(&ix, &[k(2)]);
    store(&ix, &[k(2), k(1)]); // all present
    store(&ix, &[k(3)]);
    assert_eq!(evicted_by(&ix, &[k(4)]), vec![k(1)], "k(1) kept its older rank");
    assert_eq!(ix.stats().touches, 0);
}

/// Waits (at most 60 s) until the thread whose id lands in `tid` has set it and then sleeps in
/// the kernel: from there on, the only thing it can sleep on is the lock it goes on to take.
fn wait_until_asleep(tid: &std::sync::atomic::AtomicI32) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let id = tid.load(Ordering::SeqCst);
        // The state is the first field after the command name, which is in parentheses.
        let stat = (id != 0).then(|| std::fs::read_to_string(format!("/proc/self/task/{id}/stat")).unwrap());
        if stat.as_deref().and_then(|s| s.rsplit_once(") ")).is_some_and(|(_, rest)| rest.starts_with('S')) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "the thread never went to sleep");
        std::thread::yield_now();
    }
}

#[test]
fn a_store_that_waited_for_the_writers_lock_starts_its_duration_when_it_gets_it() {
    // The clock is read under the lock: a store that waited W keeps its level for the whole
    // duration from when it was made, not duration - W.
    let ix = Arc::new(manual(2, PolicyKind::Priority));
    store_with(&ix, &[k(1)], 50, None);
    let writers = ix.inner.lock();
    let storer_tid = Arc::new(std::sync::atomic::AtomicI32::new(0));
    let storer = {
        let (ix, tid) = (ix.clone(), storer_tid.clone());
        std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            tid.store(unsafe { libc::gettid() }, Ordering::SeqCst);
            store_with(&ix, &[k(2)], 90, Some(100))
        })
    };
    wait_until_asleep(&storer_tid); // the store is waiting for the lock
    ix.clock().advance(200).unwrap();
    drop(writers);
    storer.join().unwrap();
    assert_eq!(evicted_by(&ix, &[k(3)]), vec![k(1)], "k(2) is still at 90");
}

#[test]
fn a_store_refused_for_space_counts_no_refusal_or_skip() {
    let ix = TierIndex::new(IndexConfig { admission: AdmissionRule::AfterUses(2), ..IndexConfig::new(1) }).unwrap();
    for _ in 0..2 {
        store(&ix, &[k(1)]); // admitted on its second offer
    }
    store(&ix, &[k(2)]); // k(2)'s first offer: refused
    ix.pin_for_load(&[k(1)]).unwrap();
    let before = ix.stats();
    // k(1) present; k(2) admitted at its second offer but finds no space (k(1) pinned); k(3)
    // refused at its first. The store fails as a whole: none of that happened.
    let err = ix.prepare_store(&[k(1), k(2), k(3)], InsertHint::default());
    assert!(matches!(err, Err(KvError::NoSpace { .. })), "{err:?}");
    let s = ix.stats();
    assert_eq!(s.store_refused - before.store_refused, 0);
    assert_eq!(s.store_skipped - before.store_skipped, 0);
    assert_eq!(s.store_no_space - before.store_no_space, 1);
}

#[test]
fn clear_lets_other_writers_in_between_its_parts() {
    // Three parts: two full and one short.
    let capacity = 2 * CLEAR_CHUNK as usize + 100;
    let ix = index(capacity, PolicyKind::Lru);
    let resident = keys(0..capacity as i128);
    store(&ix, &resident);
    let pinned = k(5);
    ix.pin_for_load(&[pinned]).unwrap();
    let mut parts = 0;
    let removed = ix.clear_in_parts(|| {
        parts += 1;
        // The writers' lock is free between parts: a store gets it at once and lands.
        let landed = ix.try_prepare_store(&[k(1_000_000 + parts)], InsertHint::default());
        assert!(landed.is_some(), "clear held the writers' lock between its parts");
        landed.unwrap().unwrap();
    });
    assert_eq!(parts, 3);
    // Every resident block went but the pinned one; the stores made between parts are still
    // being written, which a clear leaves alone wherever they landed.
    assert!(ix.state_of(&pinned).is_some(), "a pinned block was cleared");
    assert!(resident.iter().filter(|key| **key != pinned).all(|key| ix.state_of(key).is_none()));
    assert_eq!(removed, capacity - 1);
    assert_eq!(ix.len(), 1 + 3, "the pinned block and the three stores made between parts");
    assert_eq!(ix.policy_len(), ix.len());
}

#[test]
fn withheld_slots_are_not_handed_out_and_not_counted_as_blocks() {
    let ix = index(4, PolicyKind::Lru);
    let first: Vec<u32> = store(&ix, &keys(0..2)).to_write.iter().map(|(_, s)| *s).collect();
    ix.remove(&[k(0)]);
    // Withhold every free slot but the one just freed.
    let freed = first[0];
    assert_eq!(ix.withhold_free_slots(|s| s == freed), 2);
    assert_eq!(ix.len(), 1, "withheld slots are no blocks");
    let out = store(&ix, &keys(10..12));
    assert_eq!(out.to_write.len(), 2);
    assert!(out.to_write.iter().any(|(_, s)| *s == freed), "the usable free slot is handed out");
    assert_eq!(out.evicted.len(), 1, "the second block evicts instead of taking a withheld slot");
    assert_eq!(ix.len(), 2);
    assert_eq!(ix.return_withheld(), 2);
    assert_eq!(ix.len(), 2);
    assert_eq!(store(&ix, &keys(20..22)).evicted.len(), 0, "returned slots are free again");
}

#[test]
fn a_leaves_only_policy_never_strands_an_extension() {
    // 1 extends 0 and is used more: hit density ranks 0 (one use) below 1 (four), and evicting
    // 0 would leave 1 cached and unreachable. The index offers it only the leaf.
    let ix = index(2, PolicyKind::HitDensity);
    store(&ix, &keys(0..2));
    for _ in 0..3 {
        ix.touch(&[k(1)]);
    }
    assert_eq!(evicted_by(&ix, &[k(5)]), vec![k(1)]);
    assert_eq!(ix.lookup_prefix(&keys(0..2)), 1);
}

#[test]
fn a_leaves_only_policy_peels_a_chain_tail_first_when_the_leaves_are_too_few() {
    // One chain fills the tier and has one leaf; a store of three takes its last three blocks,
    // each evicted once the one after it is gone.
    let ix = index(4, PolicyKind::HitDensity);
    store(&ix, &keys(0..4));
    assert_eq!(evicted_by(&ix, &keys(10..13)), vec![k(3), k(2), k(1)]);
    assert_eq!(ix.lookup_prefix(&keys(0..4)), 1);
    assert_eq!(ix.lookup_prefix(&keys(10..13)), 3);
}

#[test]
fn a_leaves_only_policy_keeps_every_block_above_a_pinned_one() {
    // The chain's only leaf is pinned, so nothing of the chain can leave: the store is refused
    // and nothing changes.
    let ix = index(4, PolicyKind::HitDensity);
    store(&ix, &keys(0..4));
    ix.pin_for_load(&[k(3)]).unwrap();
    let err = ix.prepare_store(&[k(10)], InsertHint::default()).unwrap_err();
    assert!(matches!(err, KvError::NoSpace { needed: 1, available: 0 }), "{err}");
    assert_eq!(ix.lookup_prefix(&keys(0..4)), 4);
    ix.unpin(&[k(3)]).unwrap();
    assert_eq!(evicted_by(&ix, &[k(10)]), vec![k(3)]);
}

#[test]
fn a_removed_parent_no_longer_holds_its_extension() {
    // 0 is removed while 1 extends it; 0 stored again is a new block that nothing extends, and
    // 1 (its link dead) is a leaf too: both can leave.
    let ix = index(2, PolicyKind::HitDensity);
    store(&ix, &keys(0..2));
    ix.remove(&[k(0)]);
    store(&ix, &[k(0)]);
    let gone = evicted_by(&ix, &keys(20..22));
    assert!(gone.len() == 2 && gone.contains(&k(0)) && gone.contains(&k(1)), "{gone:?}");
}
