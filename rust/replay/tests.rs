use proptest::prelude::*;

use super::*;
use crate::admission::AdmissionRule;
use crate::policy::PolicyKind;

const ONLINE: [PolicyKind; 6] = PolicyKind::ALL;

/// A trace of full 4-token blocks from chains given as key lists.
fn trace_of(chains: &[Vec<u64>]) -> Trace {
    let mut offsets = vec![0u64];
    let mut keys = Vec::new();
    let mut tokens = Vec::new();
    for c in chains {
        keys.extend_from_slice(c);
        offsets.push(keys.len() as u64);
        tokens.push(c.len() as u64 * 4);
    }
    let ts = (0..chains.len()).map(|i| i as f64).collect();
    Trace::new(4, offsets, keys, tokens, ts).unwrap()
}

fn run(t: &Trace, which: Replayer, cap: usize, mode: Mode) -> ReplayStats {
    replay_one(t, which, cap, AdmissionRule::Always, mode, 0.0, None).unwrap()
}

/// Chained random traces: each request continues a prefix of an earlier request (or starts a
/// new chain) and appends fresh blocks, so a key always has the same parent.
fn chained(seed_ops: &[(u8, u8, u8)]) -> Trace {
    let mut chains: Vec<Vec<u64>> = Vec::new();
    let mut next = 0u64;
    for &(pick, keep, add) in seed_ops {
        let mut c = if chains.is_empty() || pick % 4 == 0 {
            Vec::new()
        } else {
            let base = &chains[pick as usize % chains.len()];
            base[..(keep as usize % (base.len() + 1))].to_vec()
        };
        for _ in 0..(add % 5) {
            c.push(next);
            next += 1;
        }
        if c.is_empty() {
            c.push(next);
            next += 1;
        }
        chains.push(c);
    }
    trace_of(&chains)
}

#[test]
fn hand_computed_fifo_prefix_tree() {
    // Capacity 3, prefix-tree mode; chains applied tail first. Queue front = next victim.
    // r0 [1,2]: places 2, 1           -> queue 2, 1
    // r1 [3]:   places 3               -> queue 2, 1, 3 (full)
    // r2 [1,4]: hit 1; 4 needs room: front leaf 2 goes. 4 extends the cached chain [1]: it
    //           joins 1's place, just ahead of it, and the hit does not move 1 -> queue 4, 1, 3
    // r3 [5,6]: 5 evicts 4 (1 is a leaf again), 6 evicts 1 -> queue 3, 6, 5
    // r4 [1,7]: 1 misses; it evicts 3, 7 evicts 6 (5 is not a leaf)
    // Block hits: r2 only (1). Victims: 2, 4, 1, 3, 6.
    // LRU, for contrast: r2's hit moves 1 behind 3, so r3 evicts 3 and 4, and r4 hits 1.
    // (When an extension went to the back of the queue and only leaves could go, the cached
    // prefix 1 outlived 3 exactly as under LRU: FIFO matched LRU hit for hit.)
    let t = trace_of(&[vec![1, 2], vec![3], vec![1, 4], vec![5, 6], vec![1, 7]]);
    let fifo = run(&t, Replayer::Policy(PolicyKind::Fifo), 3, Mode::Tree);
    assert_eq!((fifo.all_hit_blocks, fifo.evictions), (1, 5));
    let lru = run(&t, Replayer::Policy(PolicyKind::Lru), 3, Mode::Tree);
    assert_eq!((lru.all_hit_blocks, lru.evictions), (2, 4));
}

#[test]
fn hand_computed_lru_prefix_tree() {
    // Capacity 3. r0 places [1,2]; r1 hits 1, places 3 (cache 1,2,3 full); r2 = [4]:
    // leaves are 2 and 3; tail-first apply made 2 older than 3's chain head, so LRU evicts 2.
    let t = trace_of(&[vec![1, 2], vec![1, 3], vec![4], vec![1, 3], vec![1, 2]]);
    let s = run(&t, Replayer::Policy(PolicyKind::Lru), 3, Mode::Tree);
    // Hits: r1: 1 block, r3: 2 blocks ([1,3] still cached), r4: 1 block (2 was evicted).
    assert_eq!(s.hit_blocks, 4);
    assert_eq!(s.hit_tokens, 16);
    assert_eq!(s.total_blocks, 9);
    assert_eq!(s.evictions, 2); // 2 for r2's block 4, then 4 (a leaf, least recent) for r4's 2
    assert!(!s.underfilled);
}

#[test]
fn interior_blocks_and_current_request_are_never_victims() {
    // Capacity 2 holding the chain [1,2]: a new root block can only evict the leaf 2, never the
    // interior 1; a request [1,5] cannot evict its own hit 1 and evicts leaf 2.
    let t = trace_of(&[vec![1, 2], vec![3], vec![1], vec![1, 5], vec![1, 5]]);
    for kind in ONLINE {
        let s = run(&t, Replayer::Policy(kind), 2, Mode::Tree);
        // r1 evicts 2 (only leaf) -> {1,3}; r2 hits 1; r3 hits 1, evicts 3 (1 is protected);
        // r4 hits [1,5].
        assert_eq!(s.hit_blocks, 4, "{kind:?}");
    }
}

#[test]
fn placement_stops_at_first_block_that_cannot_be_placed() {
    // Capacity 2 and a 3-block request: only 2 blocks fit, the third has no evictable victim.
    let t = trace_of(&[vec![1, 2, 3], vec![1, 2, 3]]);
    let s = run(&t, Replayer::Policy(PolicyKind::Lru), 2, Mode::Tree);
    assert_eq!(s.hit_blocks, 2);
    assert_eq!(s.insertions, 2);
}

#[test]
fn hits_stop_at_first_miss_even_if_later_blocks_are_cached() {
    // Flat mode lets the interior block 1 be evicted while 2 stays: [1,2] then hits nothing.
    let t = trace_of(&[vec![1, 2], vec![2], vec![3], vec![1, 2]]);
    let s = run(&t, Replayer::Policy(PolicyKind::Lru), 2, Mode::Flat);
    // r1 hits 2 (a chain head here). r2 evicts LRU = 1. r3: 1 misses, so 2 is not a hit.
    assert_eq!(s.hit_blocks, 1);
}

#[test]
fn token_weighting_counts_partial_last_blocks_and_uncovered_tokens() {
    // Block size 4; r0 has 10 tokens over [1,2,3] (last block 2 tokens); r1 has 9 tokens but
    // lists only [1,2] (a full-blocks-only trace): its last token is never a hit.
    let t = Trace::new(4, vec![0, 3, 5], vec![1, 2, 3, 1, 2], vec![10, 9], vec![0.0, 1.0]).unwrap();
    let s = replay_one(&t, Replayer::Ceiling, 0, AdmissionRule::Always, Mode::Tree, 0.0, None).unwrap();
    assert_eq!((s.hit_tokens, s.total_tokens), (8, 19));
}

#[test]
fn trace_validation_names_the_field() {
    let e = Trace::new(4, vec![0, 3], vec![1, 2, 3], vec![8], vec![0.0]).err().unwrap().to_string();
    assert!(e.contains("hash_ids") && e.contains("3 blocks"), "{e}");
    let e = Trace::new(4, vec![0, 1], vec![1], vec![8, 8], vec![0.0]).err().unwrap().to_string();
    assert!(e.contains("offsets"), "{e}");
    let e = Trace::new(0, vec![0], vec![], vec![], vec![]).err().unwrap().to_string();
    assert!(e.contains("block_size"), "{e}");
    let e = Trace::new(4, vec![0, 1, 2], vec![1, 2], vec![4, 4], vec![0.0, f64::NAN]).err().unwrap().to_string();
    assert!(e.contains("timestamps") && e.contains("request 1"), "{e}");
    let e = Trace::new(4, vec![0, 0, 0], vec![], vec![u64::MAX, 2], vec![0.0, 1.0]).err().unwrap().to_string();
    assert!(e.contains("input_tokens") && e.contains("2^64"), "{e}");
}

#[test]
fn timestamps_must_not_decrease_and_may_be_negative() {
    let e =
        Trace::new(4, vec![0, 1, 2, 3], vec![1, 1, 1], vec![4, 4, 4], vec![0.0, 3.0, 1.0]).err().unwrap().to_string();
    assert!(e.contains("timestamps") && e.contains("request 2") && e.contains("earlier than request 1's 3"), "{e}");
    // Equal timestamps are fine (many Mooncake requests share one); reuse times are differences,
    // so a trace on a negative clock gives the same ones as on a positive clock.
    let t = Trace::new(4, vec![0, 1, 2, 3], vec![1, 1, 1], vec![4, 4, 4], vec![-5.0, -5.0, -2.5]).unwrap();
    assert_eq!(analyze(&t, 1).reuse_time_s, vec![0.0, 2.5]);
}

#[test]
fn warmup_excludes_early_requests_and_flags_underfilled() {
    let t = trace_of(&[vec![1], vec![1], vec![2], vec![1]]);
    let lru = |cap| {
        replay_one(&t, Replayer::Policy(PolicyKind::Lru), cap, AdmissionRule::Always, Mode::Tree, 0.5, None).unwrap()
    };
    let s = lru(10);
    assert_eq!((s.measured_requests, s.hit_blocks, s.total_blocks), (2, 1, 2));
    assert!(s.underfilled);
    assert_eq!(s.filled_at_request, None);
    let s = lru(1);
    assert!(!s.underfilled);
    assert_eq!(s.filled_at_request, Some(0));
    assert!(replay_one(&t, Replayer::Opt, 1, AdmissionRule::Always, Mode::Tree, 1.0, None).is_err());
}

#[test]
fn a_cache_that_fills_inside_the_measured_window_is_not_underfilled() {
    // Two blocks fill capacity 2 at request 2, inside the measured window (requests 2 and 3):
    // the cache did fill, so it is not underfilled; when it filled is reported.
    let t = trace_of(&[vec![1], vec![1], vec![2], vec![1]]);
    for which in [Replayer::Policy(PolicyKind::Lru), Replayer::Policy(PolicyKind::Fifo), Replayer::Opt] {
        let s = replay_one(&t, which, 2, AdmissionRule::Always, Mode::Tree, 0.5, None).unwrap();
        assert!(!s.underfilled, "{which:?}");
        assert_eq!(s.filled_at_request, Some(2), "{which:?}");
    }
    let spec = TierSpec {
        name: "cpu".into(),
        capacity: 2,
        policy: PolicyKind::Lru,
        admission: AdmissionRule::Always,
        shared: false,
    };
    let m = replay_tiers(&t, &[spec], Mode::Tree, 0.5).unwrap();
    assert!(!m.tiers[0].underfilled);
    assert_eq!(m.tiers[0].filled_at_request, Some(2));
}

#[test]
fn admission_after_two_uses_keeps_one_hit_blocks_out() {
    let t = trace_of(&[vec![1], vec![2], vec![1], vec![1], vec![3]]);
    let s = replay_one(&t, Replayer::Policy(PolicyKind::Lru), 4, AdmissionRule::AfterUses(2), Mode::Tree, 0.0, None)
        .unwrap();
    assert_eq!(s.insertions, 1); // only key 1, on its second use
    assert_eq!(s.hit_blocks, 1); // its third use
}

#[test]
fn opt_bounds_block_hits_over_the_whole_replay_not_in_the_measured_window() {
    // Belady maximises hits over the whole replay: here FIFO and opt both hit 13 blocks in all,
    // but opt spends one more in the warm-up, so FIFO hits more in the measured window (9 > 8).
    let t = trace_of(&[
        vec![2, 7],
        vec![1, 4],
        vec![1, 5, 16],
        vec![1, 4],
        vec![1],
        vec![2],
        vec![1, 5, 16],
        vec![1, 5],
        vec![1, 5, 16],
        vec![2, 8],
    ]);
    let measured = |which| replay_one(&t, which, 4, AdmissionRule::Always, Mode::Tree, 0.6, None).unwrap();
    let (fifo, opt) = (measured(Replayer::Policy(PolicyKind::Fifo)), measured(Replayer::Opt));
    assert_eq!((fifo.all_hit_blocks, opt.all_hit_blocks), (13, 13));
    assert_eq!((fifo.hit_blocks, opt.hit_blocks), (9, 8));
}

#[test]
fn opt_refuses_a_block_used_later_than_every_leaf() {
    // Capacity 1: [1] cached; [2] is next used after 1 is, so opt keeps 1 and refuses 2.
    let t = trace_of(&[vec![1], vec![2], vec![1], vec![2]]);
    let s = run(&t, Replayer::Opt, 1, Mode::Tree);
    assert_eq!(s.hit_blocks, 1);
    assert_eq!(s.evictions, 1); // r3 evicts 1 (never used again) for 2
}

#[test]
fn multitier_serves_each_block_from_the_fastest_holder() {
    let t = chained(&[(0, 0, 3), (1, 2, 2), (0, 0, 4), (2, 3, 1), (1, 1, 3), (3, 9, 2), (5, 4, 1), (2, 5, 2)]);
    let specs = |caps: &[usize]| -> Vec<TierSpec> {
        caps.iter()
            .enumerate()
            .map(|(i, &c)| TierSpec {
                name: format!("t{i}"),
                capacity: c,
                policy: PolicyKind::Lru,
                admission: AdmissionRule::Always,
                shared: false,
            })
            .collect()
    };
    let m = replay_tiers(&t, &specs(&[2, 5, 1000]), Mode::Tree, 0.0).unwrap();
    let gpu = run(&t, Replayer::Policy(PolicyKind::Lru), 2, Mode::Tree);
    let ceil = run(&t, Replayer::Ceiling, 0, Mode::Tree);
    // Tiers are independent inclusive caches: the first serves what it alone would hit, and
    // with a last tier larger than the trace, the union serves exactly the ceiling.
    assert_eq!(m.tiers[0].served_tokens, gpu.hit_tokens);
    let served: u64 = m.tiers.iter().map(|t| t.served_tokens).sum();
    assert_eq!(served, ceil.hit_tokens);
    assert_eq!(served + m.miss_tokens, m.total_tokens);
    assert!(m.tiers[2].underfilled && !m.tiers[0].underfilled);
}

#[test]
fn histograms_count_measured_requests_by_blocks_served() {
    // LRU, capacity 3, no warm-up: r1 hits 1 block (4 tokens), r3 hits 2, r4 hits 1.
    let t = trace_of(&[vec![1, 2], vec![1, 3], vec![4], vec![1, 3], vec![1, 2]]);
    let s = run(&t, Replayer::Policy(PolicyKind::Lru), 3, Mode::Tree);
    assert_eq!(s.hit_histogram, vec![(1, 2, 8), (2, 1, 8)]);
    let sum: u64 = s.hit_histogram.iter().map(|e| e.2).sum();
    assert_eq!(sum, s.hit_tokens);
    // Two tiers: a 1-block GPU tier in front of a 3-block CPU tier. r0 and r2 find nothing;
    // r1 and r4 find block 1 on the GPU (r2 evicted it there, r3 brought it back) and their
    // second block nowhere; r3 finds [1, 3] in the CPU tier only.
    let spec = |name: &str, capacity| TierSpec {
        name: name.into(),
        capacity,
        policy: PolicyKind::Lru,
        admission: AdmissionRule::Always,
        shared: false,
    };
    let m = replay_tiers(&t, &[spec("gpu", 1), spec("cpu", 3)], Mode::Tree, 0.0).unwrap();
    assert_eq!(
        m.served_histogram,
        vec![(vec![0, 0], 2, vec![0, 0]), (vec![0, 2], 1, vec![0, 8]), (vec![1, 0], 2, vec![8, 0])]
    );
    assert_eq!((m.tiers[0].served_tokens, m.tiers[1].served_tokens), (8, 8));
}

#[test]
fn sweep_matches_individual_replays() {
    let t = chained(&(0..200u32).map(|i| ((i * 7 % 13) as u8, (i * 5 % 11) as u8, (i % 6) as u8)).collect::<Vec<_>>());
    let mut jobs = Vec::new();
    for kind in [Replayer::Policy(PolicyKind::Lru), Replayer::Policy(PolicyKind::Arc), Replayer::Opt, Replayer::Ceiling]
    {
        for cap in [3, 10, 40] {
            jobs.push(Job { kind, capacity: cap, admission: AdmissionRule::Always });
        }
    }
    let p = Progress::default();
    let out = run_sweep(&t, &jobs, Mode::Tree, 0.25, 2, &p).unwrap();
    for (j, s) in jobs.iter().zip(&out) {
        assert_eq!(*s, replay_one(&t, j.kind, j.capacity, j.admission, Mode::Tree, 0.25, None).unwrap());
    }
    assert_eq!(p.done.load(std::sync::atomic::Ordering::Relaxed), (jobs.len() * t.n_requests()) as u64);
}

#[test]
fn analysis_reuse_distance_and_shared_prefixes() {
    // Refs: 1 2 | 3 | 1 2 | 1 4: block 1 is reused after {2,3} (distance 2) and after {2}
    // (distance 1); block 2 after {3,1}... within r2 block 1 was referenced just before it.
    let t = trace_of(&[vec![1, 2], vec![3], vec![1, 2], vec![1, 4]]);
    let a = analyze(&t, 5);
    assert_eq!(a.reuse_distance, vec![2, 2, 1]);
    assert_eq!(a.reuse_time_s, vec![2.0, 2.0, 1.0]);
    assert_eq!((a.one_hit_keys, a.one_hit_refs), (2, 2));
    // Maximal shared prefixes: [1,2] used by 2 requests (8 tokens) and [1] by 3 (4 tokens):
    // [1] is not maximal-dominated since its child 2 has fewer users.
    let tops: Vec<(u64, u64, u64)> = a.top_prefixes.iter().map(|p| (p.last_key, p.tokens, p.requests)).collect();
    assert_eq!(tops, vec![(1, 4, 3), (2, 8, 2)]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Belady is optimal in blocks on chained traces over the whole replay (warm-up included),
    /// in both modes and against any admission rule; the infinite cache bounds everything; a
    /// cache that holds every key equals the ceiling.
    #[test]
    fn opt_dominates_and_ceiling_bounds(ops in prop::collection::vec((0u8..255, 0u8..255, 0u8..255), 1..120),
                                         cap in 1usize..30, flat in any::<bool>(), uses in 1u32..4) {
        let t = chained(&ops);
        let mode = if flat { Mode::Flat } else { Mode::Tree };
        let adm = if uses == 1 { AdmissionRule::Always } else { AdmissionRule::AfterUses(uses) };
        let ceil = run(&t, Replayer::Ceiling, 0, mode);
        let opt = run(&t, Replayer::Opt, cap, mode);
        prop_assert!(opt.hit_blocks <= ceil.hit_blocks);
        for kind in ONLINE {
            let s = replay_one(&t, Replayer::Policy(kind), cap, adm, mode, 0.5, None).unwrap();
            prop_assert!(s.all_hit_blocks <= opt.all_hit_blocks, "{:?} {} > opt {}", kind, s.all_hit_blocks, opt.all_hit_blocks);
            let big = run(&t, Replayer::Policy(kind), t.n_keys(), mode);
            prop_assert_eq!(big.hit_tokens, ceil.hit_tokens);
        }
    }

    /// The cached set stays prefix-closed in tree mode: every hit prefix is exactly the
    /// resident blocks of the request, so a flat-mode-style gap never appears.
    #[test]
    fn tree_mode_keeps_cached_set_prefix_closed(ops in prop::collection::vec((0u8..255, 0u8..255, 0u8..255), 1..80),
                                                cap in 1usize..12, k in 0usize..5) {
        let t = chained(&ops);
        let kind = ONLINE[k];
        let mut cache = prefix_tree::Cache::new(t.n_keys(), cap, Mode::Tree, AdmissionRule::Always);
        let mut pol = prefix_tree::Online::new(kind, cap, t.n_keys());
        for r in 0..t.n_requests() {
            for c in t.request(r).windows(2) {
                prop_assert!(!cache.is_resident(c[1]) || cache.is_resident(c[0]));
            }
            cache.step(&mut pol, &t, r);
        }
    }

    /// FIFO keeps every block ahead of its prefix in the queue, so on a prefix-chained trace the
    /// first block outside the request is always a leaf: the tree rules never skip one, tree and
    /// flat mode evict alike, and the victim scan stays short.
    #[test]
    fn fifo_tree_equals_flat_on_chained_traces(ops in prop::collection::vec((0u8..255, 0u8..255, 0u8..255), 1..150),
                                               cap in 1usize..25, uses in 1u32..3) {
        let t = chained(&ops);
        let adm = if uses == 1 { AdmissionRule::Always } else { AdmissionRule::AfterUses(uses) };
        let mut tree = prefix_tree::Cache::new(t.n_keys(), cap, Mode::Tree, adm);
        let mut flat = prefix_tree::Cache::new(t.n_keys(), cap, Mode::Flat, adm);
        let mut p1 = prefix_tree::Online::new(PolicyKind::Fifo, cap, t.n_keys());
        let mut p2 = prefix_tree::Online::new(PolicyKind::Fifo, cap, t.n_keys());
        for r in 0..t.n_requests() {
            prop_assert_eq!(tree.step(&mut p1, &t, r), flat.step(&mut p2, &t, r), "request {}", r);
            for k in 0..t.n_keys() as u32 {
                prop_assert_eq!(tree.is_resident(k), flat.is_resident(k));
            }
        }
    }

    /// LRU without prefix rules is a stack algorithm, and so is Belady: more capacity never
    /// loses hits.
    #[test]
    fn lru_flat_and_opt_tree_are_monotone(ops in prop::collection::vec((0u8..255, 0u8..255, 0u8..255), 1..100),
                                     cap in 1usize..20) {
        let t = chained(&ops);
        for (which, mode) in [(Replayer::Policy(PolicyKind::Lru), Mode::Flat), (Replayer::Opt, Mode::Tree)] {
            let a = run(&t, which, cap, mode);
            let b = run(&t, which, cap + 1, mode);
            prop_assert!(a.hit_blocks <= b.hit_blocks, "{:?}: {} at {} > {} at {}", which, a.hit_blocks, cap, b.hit_blocks, cap + 1);
        }
    }
}

#[test]
fn a_capacity_far_above_the_traces_blocks_costs_only_what_the_trace_needs() {
    // The policies' per-key arrays are sized by the trace's distinct blocks, not by the swept
    // capacity (a 2^40-block sweep point would otherwise ask for terabytes up front).
    let t = trace_of(&[vec![1, 2], vec![1, 3], vec![4], vec![1, 3], vec![1, 2]]);
    for kind in [PolicyKind::Lru, PolicyKind::Arc, PolicyKind::S3Fifo, PolicyKind::Priority, PolicyKind::HitDensity] {
        let huge = run(&t, Replayer::Policy(kind), 1 << 40, Mode::Tree);
        let ample = run(&t, Replayer::Policy(kind), 8, Mode::Tree);
        assert_eq!((huge.hit_blocks, huge.evictions), (ample.hit_blocks, ample.evictions), "{kind:?}");
        assert_eq!(huge.evictions, 0);
    }
}

#[test]
fn opt_is_never_beaten_it_is_refused_on_a_trace_that_is_not_prefix_chained() {
    // Block ids that do not digest their whole prefix: 0 starts r0 but follows 4 in r1, 4
    // follows 2 in r1 but 1 in r2, 2 starts r1 but follows 4 in r3. Belady's next use then
    // overstates a block's worth (its next use may sit behind a miss) and, at capacity 2, opt
    // hits nothing while every online policy hits a block: opt would not be a bound.
    let t = trace_of(&[vec![0], vec![2, 4, 0], vec![1, 4, 3], vec![4, 2], vec![3, 2, 0]]);
    for mode in [Mode::Tree, Mode::Flat] {
        let opt = replay_one(&t, Replayer::Opt, 2, AdmissionRule::Always, mode, 0.0, None);
        for kind in ONLINE {
            let s = run(&t, Replayer::Policy(kind), 2, mode);
            if let Ok(o) = &opt {
                assert!(
                    s.all_hit_blocks <= o.all_hit_blocks,
                    "{kind:?} {mode:?}: {} > opt {}",
                    s.all_hit_blocks,
                    o.all_hit_blocks
                );
            }
        }
        let e = opt.expect_err("opt refused on an unchained trace").to_string();
        assert!(e.contains("prefix-chained") && e.contains("block 0") && e.contains("request 1"), "{e}");
        // The sweep refuses it before running any job (an error, not a late failure).
        let jobs = [
            Job { kind: Replayer::Policy(PolicyKind::Lru), capacity: 2, admission: AdmissionRule::Always },
            Job { kind: Replayer::Opt, capacity: 2, admission: AdmissionRule::Always },
        ];
        let p = Progress::default();
        assert!(run_sweep(&t, &jobs, mode, 0.0, 1, &p).is_err());
        assert_eq!(p.done.load(std::sync::atomic::Ordering::Relaxed), 0);
    }
    // A key repeated inside one request is unchained too; chained traces are accepted.
    assert!(!trace_of(&[vec![1, 2, 1]]).prefix_chained());
    assert!(trace_of(&[vec![1, 2], vec![1, 3], vec![1, 2, 5]]).prefix_chained());
}

fn tier(name: &str, capacity: usize, shared: bool) -> TierSpec {
    TierSpec { name: name.into(), capacity, policy: PolicyKind::Lru, admission: AdmissionRule::Always, shared }
}

#[test]
fn a_prefix_computed_on_one_replica_is_a_remote_hit_on_another() {
    // Round robin over two replicas, A (r0, r2) and B (r1, r3), each with a private CPU tier,
    // all large. r0 computes [1, 2] on A; r1 on B finds it only in the shared remote store; r2
    // finds 1 in A's CPU tier; r3 finds [1, 2] in B's own tier (stored there by r1).
    let t = trace_of(&[vec![1, 2], vec![1, 2], vec![1, 3], vec![1, 2, 4]]);
    let split = [0, 1, 0, 1];
    let m = replay_replicas(&t, &[tier("cpu", 10, false), tier("remote", 10, true)], &split, Mode::Tree, 0.0).unwrap();
    let served = |m: &TiersResult| m.tiers.iter().map(|t| t.served_blocks).collect::<Vec<_>>();
    assert_eq!(served(&m), vec![3, 2]);
    assert_eq!((m.miss_blocks, m.miss_tokens, m.total_blocks), (4, 16, 9));
    // Each replica's CPU cache stores its own requests' blocks: A {1, 2, 3}, B {1, 2, 4}.
    assert_eq!(m.tiers[0].insertions, 6);
    assert_eq!(m.tiers[1].insertions, 4);
    // Without the remote store, r1's two blocks are recomputed.
    let alone = replay_replicas(&t, &[tier("cpu", 10, false)], &split, Mode::Tree, 0.0).unwrap();
    assert_eq!(served(&alone), vec![3]);
    assert_eq!(alone.miss_blocks, 6);
    // On one replica the CPU tier serves everything the remote store would.
    let one = replay_tiers(&t, &[tier("cpu", 10, false), tier("remote", 10, true)], Mode::Tree, 0.0).unwrap();
    assert_eq!(served(&one), vec![5, 0]);
    assert_eq!(one.miss_blocks, 4);
}

#[test]
fn a_private_tier_is_full_only_once_every_replica_cache_filled() {
    // Capacity 1 per replica: A fills at r0, B at r1; the shared tier (capacity 2) at r1.
    let t = trace_of(&[vec![1], vec![2], vec![1]]);
    let m =
        replay_replicas(&t, &[tier("cpu", 1, false), tier("remote", 2, true)], &[0, 1, 0], Mode::Tree, 0.0).unwrap();
    assert_eq!((m.tiers[0].filled_at_request, m.tiers[1].filled_at_request), (Some(1), Some(1)));
    // Replica B never gets a request: its cache never fills, so the tier is underfilled.
    let m = replay_replicas(&t, &[tier("cpu", 1, false)], &[0, 2, 0], Mode::Tree, 0.0).unwrap();
    assert!(m.tiers[0].underfilled);
}

#[test]
fn every_tier_shared_is_the_one_replica_replay() {
    let t = chained(&(0..120u32).map(|i| ((i * 7 % 13) as u8, (i * 5 % 11) as u8, (i % 6) as u8)).collect::<Vec<_>>());
    let split: Vec<u32> = (0..t.n_requests() as u32).map(|r| r % 3).collect();
    let specs = [tier("cpu", 8, true), tier("remote", 30, true)];
    assert_eq!(
        replay_replicas(&t, &specs, &split, Mode::Tree, 0.25).unwrap(),
        replay_tiers(&t, &specs, Mode::Tree, 0.25).unwrap()
    );
    // And one replica named for every request is no split at all.
    let private = [tier("cpu", 8, false), tier("remote", 30, true)];
    assert_eq!(
        replay_replicas(&t, &private, &vec![0; t.n_requests()], Mode::Tree, 0.25).unwrap(),
        replay_tiers(&t, &private, Mode::Tree, 0.25).unwrap()
    );
}

#[test]
fn a_split_must_name_one_replica_per_request_and_not_too_many() {
    let t = trace_of(&[vec![1], vec![2]]);
    let err = |split: &[u32]| replay_replicas(&t, &[tier("cpu", 1, false)], split, Mode::Tree, 0.0).unwrap_err();
    assert!(err(&[0]).to_string().contains("one replica per request (2), got 1"), "{}", err(&[0]));
    let too_many = err(&[0, MAX_REPLICAS as u32]).to_string();
    assert!(too_many.contains("at most 1024 replicas"), "{too_many}");
}
