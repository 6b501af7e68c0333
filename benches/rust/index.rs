//! Criterion benches of the tier index: single-key and batch operations, and lookup throughput
//! from 1 and 2 threads. `cargo bench --bench index` (`make bench`).

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvtier::index::{IndexConfig, TierIndex};
use kvtier::policy::{InsertHint, PolicyKind};
use kvtier::BlockKey;

const CAPACITY: usize = 16_384;

fn key(i: u64) -> BlockKey {
    // 36-byte keys like vLLM's (32-byte digest + 4-byte group index).
    let mut b = [0u8; 36];
    b[..8].copy_from_slice(&i.to_le_bytes());
    b[8..16].copy_from_slice(&i.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
    BlockKey::from_bytes(&b).unwrap()
}

fn filled(policy: PolicyKind) -> TierIndex {
    let ix = TierIndex::new(IndexConfig { policy, ..IndexConfig::new(CAPACITY) }).unwrap();
    let keys: Vec<_> = (0..CAPACITY as u64).map(key).collect();
    ix.prepare_store(&keys, InsertHint::default()).unwrap();
    ix.complete_store(&keys, true);
    ix
}

fn single_key(c: &mut Criterion) {
    let mut g = c.benchmark_group("single_key");
    for policy in [PolicyKind::Lru, PolicyKind::Arc, PolicyKind::S3Fifo] {
        let ix = filled(policy);
        let keys: Vec<_> = (0..CAPACITY as u64).map(key).collect();
        let mut i = 0usize;
        g.bench_function(format!("lookup/{}", policy.name()), |b| {
            b.iter(|| {
                i = (i + 7919) % CAPACITY;
                black_box(ix.lookup_prefix(std::slice::from_ref(&keys[i])))
            })
        });
        g.bench_function(format!("touch/{}", policy.name()), |b| {
            b.iter(|| {
                i = (i + 7919) % CAPACITY;
                ix.touch(std::slice::from_ref(&keys[i]))
            })
        });
        let mut next = CAPACITY as u64;
        g.bench_function(format!("store_evict/{}", policy.name()), |b| {
            b.iter(|| {
                next += 1;
                let k = key(next);
                let out = ix.prepare_store(std::slice::from_ref(&k), InsertHint::default()).unwrap();
                ix.complete_store(std::slice::from_ref(&k), true);
                black_box(out)
            })
        });
    }
    g.finish();
}

fn batch(c: &mut Criterion) {
    let mut g = c.benchmark_group("batch_64");
    g.throughput(Throughput::Elements(64));
    for policy in [PolicyKind::Lru, PolicyKind::Arc, PolicyKind::S3Fifo] {
        let ix = filled(policy);
        let keys: Vec<_> = (0..CAPACITY as u64).map(key).collect();
        let mut start = 0usize;
        g.bench_function(format!("lookup_prefix/{}", policy.name()), |b| {
            b.iter(|| {
                start = (start + 64) % (CAPACITY - 64);
                black_box(ix.lookup_prefix(&keys[start..start + 64]))
            })
        });
        let mut next = 1u64 << 40;
        g.bench_function(format!("store_evict/{}", policy.name()), |b| {
            b.iter_batched(
                || {
                    let ks: Vec<_> = (0..64).map(|j| key(next + j)).collect();
                    next += 64;
                    ks
                },
                |ks| {
                    let out = ix.prepare_store(&ks, InsertHint::default()).unwrap();
                    ix.complete_store(&ks, true);
                    out
                },
                BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

/// Lookups per second from 1 and 2 reader threads over the same index (readers are lock-free,
/// so 2 threads should come close to twice the throughput on 2 free cores).
fn lookup_threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("lookup_threads");
    let ix = Arc::new(filled(PolicyKind::Lru));
    let keys: Arc<Vec<_>> = Arc::new((0..CAPACITY as u64).map(key).collect());
    for threads in [1usize, 2] {
        g.throughput(Throughput::Elements(64 * threads as u64));
        g.bench_function(format!("{threads}_threads_x64"), |b| {
            b.iter_custom(|iters| {
                let t0 = Instant::now();
                let hs: Vec<_> = (0..threads)
                    .map(|t| {
                        let ix = ix.clone();
                        let keys = keys.clone();
                        std::thread::spawn(move || {
                            let mut s = t * 4096;
                            for _ in 0..iters {
                                s = (s + 64) % (CAPACITY - 64);
                                black_box(ix.lookup_prefix(&keys[s..s + 64]));
                            }
                        })
                    })
                    .collect();
                for h in hs {
                    h.join().unwrap();
                }
                t0.elapsed()
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).warm_up_time(std::time::Duration::from_millis(300)).measurement_time(std::time::Duration::from_secs(1));
    targets = single_key, batch, lookup_threads
}
criterion_main!(benches);
