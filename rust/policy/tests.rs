//! Property tests shared by every policy: random operation sequences on a small key domain,
//! checked against the policy contract (all-or-nothing, never a non-evictable victim, resident
//! set bookkeeping), plus exact-order checks for LRU/FIFO against a Vec model.

use std::collections::HashSet;

use proptest::prelude::*;

use super::*;

#[derive(Clone, Debug)]
enum Op {
    Insert(u8, u8),
    /// Insert the first key as an extension of a chain whose cached block is the second.
    Extend(u8, u8),
    Touch(u8),
    Refresh(u8),
    Renew(u8, u8, Option<u64>),
    Remove(u8),
    Pin(u8),
    Unpin(u8),
    Evict(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..24, prop_oneof![Just(35u8), 0u8..=100]).prop_map(|(k, p)| Op::Insert(k, p)),
        2 => (0u8..24, 0u8..24).prop_map(|(k, at)| Op::Extend(k, at)),
        3 => (0u8..24).prop_map(Op::Touch),
        1 => (0u8..24).prop_map(Op::Refresh),
        1 => (0u8..24, 0u8..=100, prop_oneof![Just(None), Just(Some(25u64))]).prop_map(|(k, p, d)| Op::Renew(k, p, d)),
        1 => (0u8..24).prop_map(Op::Remove),
        1 => (0u8..24).prop_map(Op::Pin),
        1 => (0u8..24).prop_map(Op::Unpin),
        2 => (1u8..4).prop_map(Op::Evict),
    ]
}

fn op_prefix(op: &Op) -> u8 {
    match *op {
        Op::Extend(_, at) => at,
        _ => unreachable!("only extensions name a prefix"),
    }
}

fn check_contract(kind: PolicyKind, ops: &[Op]) {
    let capacity = 8;
    let mut p: Box<dyn EvictionPolicy<u8>> = kind.build(capacity);
    let mut resident: HashSet<u8> = HashSet::new();
    let mut pinned: HashSet<u8> = HashSet::new();
    for (now, op) in ops.iter().enumerate() {
        let now = now as u64 * 10;
        match *op {
            Op::Insert(k, _) | Op::Extend(k, _) => {
                if resident.contains(&k) {
                    continue;
                }
                if resident.len() == capacity {
                    let mut ev = |x: &u8| !pinned.contains(x);
                    match p.select_victims(1, now, &mut ev) {
                        Some(v) => {
                            assert_eq!(v.len(), 1);
                            assert!(resident.remove(&v[0]));
                            assert!(!pinned.contains(&v[0]));
                        }
                        None => continue,
                    }
                }
                match *op {
                    Op::Insert(_, prio) => p.insert(&k, InsertHint { priority: prio, duration_ns: Some(25) }, now),
                    _ => p.insert_extending(&k, &op_prefix(op), InsertHint::default(), now),
                }
                resident.insert(k);
            }
            Op::Touch(k) => p.touch(&k, now),
            Op::Refresh(k) => p.refresh(&k, now),
            Op::Renew(k, prio, d) => p.renew(&k, InsertHint { priority: prio, duration_ns: d }, now),
            Op::Remove(k) => {
                if !pinned.contains(&k) {
                    p.remove(&k);
                    resident.remove(&k);
                }
            }
            Op::Pin(k) => {
                if resident.contains(&k) {
                    pinned.insert(k);
                }
            }
            Op::Unpin(k) => {
                pinned.remove(&k);
            }
            Op::Evict(n) => {
                let before_len = p.len();
                let evictable = resident.iter().filter(|k| !pinned.contains(k)).count();
                let mut ev = |x: &u8| !pinned.contains(x);
                match p.select_victims(n as usize, now, &mut ev) {
                    Some(v) => {
                        assert_eq!(v.len(), n as usize);
                        let uniq: HashSet<_> = v.iter().collect();
                        assert_eq!(uniq.len(), v.len(), "victim chosen twice");
                        for x in v {
                            assert!(!pinned.contains(&x), "pinned {x} evicted");
                            assert!(resident.remove(&x), "{x} not resident");
                        }
                    }
                    None => {
                        assert!(evictable < n as usize, "refused although {evictable} evictable");
                        assert_eq!(p.len(), before_len, "a refused eviction changed the size");
                    }
                }
            }
        }
        assert_eq!(p.len(), resident.len());
        for k in &resident {
            assert!(p.contains(k));
        }
    }
}

/// `n` victims from `p`, checked against the front of a queue model (front = next victim),
/// which loses them too; None from both when fewer than `n` are left.
fn evicts_like_the_model(p: &mut dyn EvictionPolicy<u8>, model: &mut Vec<u8>, n: u8) -> Result<(), TestCaseError> {
    let got = p.select_victims(n as usize, 0, &mut |_| true);
    if model.len() >= n as usize {
        let want: Vec<u8> = model.drain(..n as usize).collect();
        prop_assert_eq!(got, Some(want));
    } else {
        prop_assert_eq!(got, None);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn every_policy_keeps_the_contract(ops in proptest::collection::vec(op(), 1..120)) {
        for kind in PolicyKind::ALL {
            check_contract(kind, &ops);
        }
    }

    #[test]
    fn lru_matches_vec_model(ops in proptest::collection::vec(op(), 1..120)) {
        let mut p: Box<dyn EvictionPolicy<u8>> = PolicyKind::Lru.build(8);
        let mut model: Vec<u8> = Vec::new(); // front = LRU
        for op in ops {
            match op {
                Op::Insert(k, _) if !model.contains(&k) && model.len() < 8 => {
                    p.insert(&k, InsertHint::default(), 0);
                    model.push(k);
                }
                // LRU ranks an extension as an insert: its touches come from the caller.
                Op::Extend(k, at) if !model.contains(&k) && model.len() < 8 => {
                    p.insert_extending(&k, &at, InsertHint::default(), 0);
                    model.push(k);
                }
                Op::Touch(k) | Op::Refresh(k) => {
                    if matches!(op, Op::Touch(_)) { p.touch(&k, 0) } else { p.refresh(&k, 0) }
                    if let Some(i) = model.iter().position(|&x| x == k) {
                        model.remove(i);
                        model.push(k);
                    }
                }
                // Not a use: LRU's order ignores the hint, so a renewal leaves it as it was.
                Op::Renew(k, prio, d) => p.renew(&k, InsertHint { priority: prio, duration_ns: d }, 0),
                Op::Evict(n) => evicts_like_the_model(p.as_mut(), &mut model, n)?,
                _ => {}
            }
        }
    }

    /// FIFO: first insertion order; nothing but an extension's prefix places a key elsewhere
    /// than the back, and no use, refresh or renewal moves one.
    #[test]
    fn fifo_matches_vec_model(ops in proptest::collection::vec(op(), 1..120)) {
        let mut p: Box<dyn EvictionPolicy<u8>> = PolicyKind::Fifo.build(8);
        let mut model: Vec<u8> = Vec::new(); // front = first in
        for op in ops {
            match op {
                Op::Insert(k, _) if !model.contains(&k) && model.len() < 8 => {
                    p.insert(&k, InsertHint::default(), 0);
                    model.push(k);
                }
                Op::Extend(k, at) if !model.contains(&k) && model.len() < 8 => {
                    p.insert_extending(&k, &at, InsertHint::default(), 0);
                    match model.iter().position(|&x| x == at) {
                        Some(i) => model.insert(i, k),
                        None => model.push(k),
                    }
                }
                Op::Touch(k) => p.touch(&k, 0),
                Op::Refresh(k) => p.refresh(&k, 0),
                Op::Renew(k, prio, d) => p.renew(&k, InsertHint { priority: prio, duration_ns: d }, 0),
                Op::Remove(k) => {
                    p.remove(&k);
                    model.retain(|&x| x != k);
                }
                Op::Evict(n) => evicts_like_the_model(p.as_mut(), &mut model, n)?,
                _ => {}
            }
            prop_assert_eq!(p.len(), model.len());
        }
    }
}

#[test]
fn priority_evicts_lowest_level_then_lru_and_durations_expire() {
    let mut p = Priority::<u32>::new();
    p.insert(&1, InsertHint { priority: 80, duration_ns: Some(100) }, 0);
    p.insert(&2, InsertHint { priority: 10, duration_ns: None }, 0);
    p.insert(&3, InsertHint::default(), 0);
    p.insert(&4, InsertHint::default(), 0);
    p.touch(&3, 0);
    assert_eq!(p.select_victims(1, 50, &mut |_| true), Some(vec![2]));
    assert_eq!(p.select_victims(1, 50, &mut |_| true), Some(vec![4]));
    // At t=100 block 1 returns to the default level; it was used before 3, so it goes first.
    assert_eq!(p.level_of(&1), Some(80));
    assert_eq!(p.select_victims(1, 100, &mut |_| true), Some(vec![1]));
    assert_eq!(p.select_victims(1, 100, &mut |_| true), Some(vec![3]));
}

/// Victims, one at a time, until the policy is empty.
fn drain(p: &mut dyn EvictionPolicy<u32>, now: u64) -> Vec<u32> {
    std::iter::from_fn(|| p.select_victims(1, now, &mut |_| true).map(|v| v[0])).collect()
}

#[test]
fn a_renewal_overrides_the_level_and_ranks_as_a_fresh_insert() {
    let mut p = Priority::<u32>::new();
    p.insert(&1, InsertHint { priority: 80, duration_ns: None }, 0);
    p.insert(&2, InsertHint::default(), 0);
    p.insert(&3, InsertHint { priority: 10, duration_ns: None }, 0);
    // 1 moves from 80 to 10, where it is more recent than 3: evicted after 3, before 2.
    p.renew(&1, InsertHint { priority: 10, duration_ns: None }, 0);
    assert_eq!(p.level_of(&1), Some(10));
    assert_eq!(drain(&mut p, 0), vec![3, 1, 2]);
    // Renewing at the same level still ranks the key as freshly inserted there.
    for k in [1, 2, 3] {
        p.insert(&k, InsertHint::default(), 0);
    }
    p.renew(&1, InsertHint::default(), 0);
    assert_eq!(drain(&mut p, 0), vec![2, 3, 1]);
}

#[test]
fn a_renewal_restarts_or_clears_the_duration() {
    let hint = |priority, duration_ns| InsertHint { priority, duration_ns };
    // Restarted from the renewal: stored at t=0 for 100 ns, renewed at t=50 for 100 ns, the
    // block stays at 80 until t=150 (not t=100).
    let mut p = Priority::<u32>::new();
    p.insert(&1, hint(80, Some(100)), 0);
    p.insert(&2, InsertHint::default(), 0);
    p.renew(&1, hint(80, Some(100)), 50);
    assert_eq!(p.select_victims(1, 120, &mut |_| true), Some(vec![2]));
    assert_eq!(p.level_of(&1), Some(80), "the first duration no longer applies");
    p.insert(&2, InsertHint::default(), 120);
    assert_eq!(p.select_victims(1, 150, &mut |_| true), Some(vec![1]), "back at 35, and used before 2");
    // Cleared by a renewal without one: the block stays at its level for good.
    let mut p = Priority::<u32>::new();
    p.insert(&1, hint(80, Some(100)), 0);
    p.insert(&2, InsertHint::default(), 0);
    p.renew(&1, hint(80, None), 10);
    assert_eq!(drain(&mut p, 1_000_000), vec![2, 1]);
    // A renewal gives a duration to a block stored without one, which then falls back to 35.
    let mut p = Priority::<u32>::new();
    p.insert(&1, hint(80, None), 0);
    p.insert(&2, InsertHint::default(), 0);
    p.renew(&1, hint(80, Some(100)), 10);
    assert_eq!(p.select_victims(1, 109, &mut |_| true), Some(vec![2]));
    p.insert(&2, InsertHint::default(), 109);
    assert_eq!(drain(&mut p, 110), vec![1, 2], "at 35 from t=110, and renewed before 2 was stored");
}

#[test]
fn a_renewal_of_an_unknown_key_changes_nothing() {
    for kind in PolicyKind::ALL {
        let mut p: Box<dyn EvictionPolicy<u32>> = kind.build(4);
        p.insert(&1, InsertHint::default(), 0);
        p.renew(&7, InsertHint { priority: 90, duration_ns: Some(5) }, 0);
        assert!(!p.contains(&7), "{kind:?}");
        assert_eq!(p.len(), 1, "{kind:?}");
    }
}

#[test]
fn a_renewal_is_not_a_use_for_the_policies_whose_order_ignores_the_hint() {
    // The same operations with renewals, with nothing, and with touches in between: renewals
    // change no victim and no order, where touches would (except for FIFO, which ignores both).
    #[derive(Clone, Copy, PartialEq)]
    enum Between {
        Nothing,
        Renewals,
        Touches,
    }
    for kind in [PolicyKind::Fifo, PolicyKind::Lru, PolicyKind::Arc, PolicyKind::S3Fifo, PolicyKind::HitDensity] {
        let run = |between: Between| {
            let mut p: Box<dyn EvictionPolicy<u32>> = kind.build(10);
            for k in 0..10 {
                p.insert(&k, InsertHint::default(), 0);
            }
            p.touch(&5, 0);
            for k in [0, 1, 5] {
                match between {
                    Between::Nothing => {}
                    Between::Renewals => p.renew(&k, InsertHint { priority: 100, duration_ns: None }, 0),
                    Between::Touches => p.touch(&k, 0),
                }
            }
            drain(p.as_mut(), 0)
        };
        assert_eq!(run(Between::Renewals), run(Between::Nothing), "{kind:?}");
        if kind != PolicyKind::Fifo {
            assert_ne!(run(Between::Touches), run(Between::Nothing), "{kind:?}: the test would not see a use");
        }
    }
}

#[test]
fn arc_moves_reused_keys_to_t2_and_adapts_on_ghost_hits() {
    let mut a = ArcPolicy::<u32>::new(4, 4);
    for k in 0..4 {
        a.insert(&k, InsertHint::default(), 0);
    }
    a.touch(&0, 0); // 0 -> T2
    let v = a.select_victims(1, 0, &mut |_| true).unwrap();
    assert_eq!(v, vec![1]); // |T1| = 3 > p = 0: LRU of T1
    a.insert(&1, InsertHint::default(), 0); // B1 ghost hit: p grows, 1 enters T2
    assert_eq!(a.target_p(), 1);
    assert_eq!(a.ghost_len(), (0, 0));
}

#[test]
fn arc_refresh_reorders_t1_without_promoting() {
    // 0..4 in T1, 9 in T2. Refreshing 0 makes it T1's most recent; it stays in T1, so with
    // |T1| > p the T1 victims come first, now 1, 2, 3, then 0, and T2's key last. A touch
    // would have moved 0 to T2, after 9.
    let mut a = ArcPolicy::<u32>::new(8, 16);
    a.insert(&9, InsertHint::default(), 0);
    a.touch(&9, 0);
    for k in 0..4 {
        a.insert(&k, InsertHint::default(), 0);
    }
    a.refresh(&0, 0);
    a.refresh(&42, 0); // unknown: ignored
    assert_eq!(drain(&mut a, 0), vec![1, 2, 3, 0, 9]);
}

#[test]
fn a_refresh_is_recency_alone() {
    // Refreshes order like LRU touches for LRU and priority, change nothing for the arrival-
    // order policies, and never count as a use (S3-FIFO would otherwise promote).
    for kind in PolicyKind::ALL {
        let run = |refresh: bool| {
            let mut p: Box<dyn EvictionPolicy<u32>> = kind.build(10);
            for k in 0..10 {
                p.insert(&k, InsertHint::default(), 0);
            }
            if refresh {
                p.refresh(&0, 0);
            }
            drain(p.as_mut(), 0)
        };
        let (plain, refreshed) = (run(false), run(true));
        match kind {
            PolicyKind::Fifo | PolicyKind::S3Fifo => assert_eq!(refreshed, plain, "{kind:?}"),
            _ => {
                assert_eq!(refreshed.last(), Some(&0), "{kind:?}");
                assert_eq!(refreshed[..9], plain[1..], "{kind:?}");
            }
        }
    }
}

#[test]
fn s3fifo_one_hit_wonders_leave_through_small_queue() {
    let mut s = S3Fifo::<u32>::new(10, 10);
    for k in 0..10 {
        s.insert(&k, InsertHint::default(), 0);
    }
    s.touch(&0, 0);
    // Small queue holds all 10 (>= target 1): 0 was reused so it is promoted, 1 is the victim.
    assert_eq!(s.select_victims(1, 0, &mut |_| true), Some(vec![1]));
    assert!(s.contains(&0));
    // A ghost comes back straight into the main queue.
    s.insert(&1, InsertHint::default(), 0);
    assert!(s.contains(&1));
}

#[test]
fn hit_density_before_learning_evicts_the_oldest_of_the_least_used_class() {
    // No density is learned before the first rebuild (all 1.0, ties go to the lower class): the
    // order is one-use keys oldest first, then 2-3 uses, then 4+.
    let mut h = HitDensity::<u32>::new(8, 8);
    for k in 0..4 {
        h.insert(&k, InsertHint::default(), 0);
    }
    h.touch(&0, 0); // 2 uses: class 1
    for _ in 0..3 {
        h.touch(&1, 0); // 4 uses: class 2
    }
    h.refresh(&2, 0); // no use: 2 stays in class 0, now behind 3
    assert_eq!(drain(&mut h, 0), vec![3, 2, 0, 1]);
}

#[test]
fn hit_density_learns_that_reused_keys_outlive_a_scan() {
    // Four keys in use round after round, and a stream of keys each seen once. Once the
    // densities are learned, a scan key is evicted at once and the reused keys stay.
    let mut h = HitDensity::<u32>::new(8, 1 << 12);
    let mut next_scan = 100;
    let mut resident = 0;
    let admit = |h: &mut HitDensity<u32>, k: u32, resident: &mut usize| {
        if *resident == 8 {
            h.select_victims(1, 0, &mut |_| true).expect("a victim");
        } else {
            *resident += 1;
        }
        h.insert(&k, InsertHint::default(), 0);
    };
    for round in 0..400 {
        for k in 0..4 {
            if h.contains(&k) {
                h.touch(&k, 0);
            } else {
                admit(&mut h, k, &mut resident);
            }
        }
        for _ in 0..3 {
            admit(&mut h, next_scan, &mut resident);
            next_scan += 1;
        }
        if round >= 300 {
            assert!((0..4).all(|k| h.contains(&k)), "round {round}: a reused key was evicted");
        }
    }
}

#[test]
fn hit_density_moves_its_stamps_epoch_without_changing_recent_ages() {
    // Stamps are 32-bit offsets from an epoch that moves up half a span when the clock runs a
    // span past it; here the span is 16 ticks. Ages under half a span are kept exactly, older
    // ones are raised to half a span (the real span's half is past the last age bucket).
    let mut h = HitDensity::<u32>::with_stamp_span(8, 8, 16);
    for k in 0..4 {
        h.insert(&k, InsertHint::default(), 0); // clock 1..=4
    }
    for _ in 0..14 {
        h.touch(&0, 0); // clock 5..=18: the epoch moves at 16, to 8
    }
    h.touch(&3, 0); // clock 19
    assert_eq!(h.age_of(&0), Some(1));
    assert_eq!(h.age_of(&3), Some(0));
    assert_eq!(h.age_of(&1), Some(11), "clock 19 - epoch 8: raised to the epoch");
    for _ in 0..40 {
        h.touch(&0, 0); // two more moves
    }
    assert_eq!(h.age_of(&0), Some(0));
    assert_eq!(h.age_of(&3), Some(11), "40 ticks old: read as the 11 since the epoch, 48");
}

#[test]
fn policy_names_parse_and_unknown_is_a_clear_error() {
    for k in PolicyKind::ALL {
        assert_eq!(PolicyKind::parse(k.name()).unwrap(), k);
    }
    let e = PolicyKind::parse("mru").unwrap_err().to_string();
    assert!(e.contains("policy") && e.contains("mru"), "{e}");
}
