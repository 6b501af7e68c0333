//! Multi-tier replay: GPU, CPU and disk tiers, each its own prefix-tree cache with its own
//! policy and admission rule.
//!
//! Tiers are inclusive and written through, as vLLM's offloading connector stores every
//! computed block to the CPU tier and the CPU tier feeds the secondary ones: every tier sees
//! each request's whole chain (hits touched, new blocks offered to its admission rule) and
//! evicts on its own. A request's usable prefix is the longest prefix whose blocks are each
//! held by some tier; each block of it is served by the fastest tier holding it (tier order),
//! so a block from the CPU tier is a CPU promotion and one from disk a disk promotion.
//!
//! Replicas: the trace may be split across replicas (`replay_replicas`), each request served by
//! one. A private tier (GPU, CPU, disk) is one cache per replica, seen only by that replica's
//! requests; a shared tier (a remote store every replica reads and writes) is one cache seen by
//! every request. With one replica every tier sees every request, whatever it is marked.

use std::collections::BTreeMap;

use super::prefix_tree::{Cache, Mode, Online};
use super::{check_warmup, Trace};
use crate::admission::AdmissionRule;
use crate::error::{KvError, KvResult};
use crate::policy::PolicyKind;

#[derive(Clone, Debug)]
pub struct TierSpec {
    pub name: String,
    pub capacity: usize,
    pub policy: PolicyKind,
    pub admission: AdmissionRule,
    /// One cache for all replicas (a remote store) rather than one per replica.
    pub shared: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TierResult {
    pub name: String,
    /// Measured tokens and blocks served from this tier (GPU hits, or promotions).
    pub served_tokens: u64,
    pub served_blocks: u64,
    /// Blocks written into / evicted from this tier over the whole replay (all its replicas'
    /// caches together).
    pub insertions: u64,
    pub evictions: u64,
    /// Never full during the replay; `filled_at_request`: the request that first filled it
    /// (as in `ReplayStats`). A private tier counts as full only once every replica's cache has
    /// filled: one replica's cache that never filled holds all its replica was offered.
    pub underfilled: bool,
    pub filled_at_request: Option<u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TiersResult {
    pub tiers: Vec<TierResult>,
    pub miss_tokens: u64,
    pub miss_blocks: u64,
    pub total_tokens: u64,
    pub total_blocks: u64,
    pub measured_requests: u64,
    /// Measured requests by how many blocks each tier served them: `(blocks per tier, requests,
    /// tokens per tier)`, tiers in spec order, ascending by blocks. A request's blocks from one
    /// tier are loaded as one job, so the planner weighs load against recompute per entry.
    pub served_histogram: Vec<(Vec<u32>, u64, Vec<u64>)>,
}

/// Most replicas a replay takes: every private tier holds per-key state for each of them.
pub const MAX_REPLICAS: usize = 1024;

/// The whole trace on one replica.
pub fn replay_tiers(trace: &Trace, specs: &[TierSpec], mode: Mode, warmup: f64) -> KvResult<TiersResult> {
    replay_replicas(trace, specs, &[], mode, warmup)
}

/// The trace split across replicas: request `r` is served by replica `replica_of[r]` (empty:
/// every request by replica 0), through that replica's private tiers and the shared ones.
pub fn replay_replicas(
    trace: &Trace,
    specs: &[TierSpec],
    replica_of: &[u32],
    mode: Mode,
    warmup: f64,
) -> KvResult<TiersResult> {
    check_warmup(warmup)?;
    if specs.is_empty() {
        return Err(KvError::invalid("tiers", "give at least one tier"));
    }
    if let Some(t) = specs.iter().find(|t| t.capacity == 0) {
        return Err(KvError::invalid("tiers", format!("tier {:?} has capacity 0", t.name)));
    }
    let replicas = replica_count(trace, replica_of)?;
    // Every cache, tier by tier: a shared tier's one, then a private tier's one per replica.
    // `tier_caches[t]`: tier t's range in `caches`; `slots[replica]`: the cache of each tier
    // that replica uses, fastest first.
    let mut caches: Vec<(Cache, Online)> = Vec::new();
    let mut tier_caches = Vec::with_capacity(specs.len());
    for t in specs {
        let start = caches.len();
        for _ in 0..if t.shared { 1 } else { replicas } {
            caches.push((
                Cache::new(trace.n_keys(), t.capacity, mode, t.admission),
                Online::new(t.policy, t.capacity, trace.n_keys()),
            ));
        }
        tier_caches.push(start..caches.len());
    }
    let slots: Vec<Vec<usize>> = (0..replicas)
        .map(|a| specs.iter().zip(&tier_caches).map(|(t, c)| c.start + if t.shared { 0 } else { a }).collect())
        .collect();
    let mut out = TiersResult {
        tiers: specs.iter().map(|t| TierResult { name: t.name.clone(), ..Default::default() }).collect(),
        ..Default::default()
    };
    let first = trace.warmup_requests(warmup);
    let mut histogram: BTreeMap<Vec<u32>, (u64, Vec<u64>)> = BTreeMap::new();
    for r in 0..trace.n_requests() {
        let mine = &slots[replica_of.get(r).map_or(0, |&a| a as usize)];
        if r >= first {
            let keys = trace.request(r);
            let mut served = 0;
            let (mut blocks, mut tokens) = (vec![0u32; specs.len()], vec![0u64; specs.len()]);
            for (i, &k) in keys.iter().enumerate() {
                let Some(t) = mine.iter().position(|&c| caches[c].0.is_resident(k)) else { break };
                out.tiers[t].served_tokens += trace.block_tokens(r, i);
                out.tiers[t].served_blocks += 1;
                blocks[t] += 1;
                tokens[t] += trace.block_tokens(r, i);
                served += 1;
            }
            let e = histogram.entry(blocks).or_insert_with(|| (0, vec![0; specs.len()]));
            e.0 += 1;
            e.1.iter_mut().zip(&tokens).for_each(|(a, b)| *a += b);
            let served_tokens: u64 = (0..served).map(|i| trace.block_tokens(r, i)).sum();
            out.measured_requests += 1;
            out.total_tokens += trace.input_tokens(r);
            out.total_blocks += keys.len() as u64;
            out.miss_tokens += trace.input_tokens(r) - served_tokens;
            out.miss_blocks += (keys.len() - served) as u64;
        }
        for &c in mine {
            let (cache, policy) = &mut caches[c];
            cache.step(policy, trace, r);
        }
    }
    out.served_histogram = histogram.into_iter().map(|(blocks, (reqs, tokens))| (blocks, reqs, tokens)).collect();
    for (t, range) in out.tiers.iter_mut().zip(tier_caches) {
        let tier = &caches[range];
        t.insertions = tier.iter().map(|(c, _)| c.insertions).sum();
        t.evictions = tier.iter().map(|(c, _)| c.evictions).sum();
        // Full once the last of its caches filled (None: one never did).
        t.filled_at_request =
            tier.iter().map(|(c, _)| c.filled_at()).collect::<Option<Vec<_>>>().and_then(|f| f.into_iter().max());
        t.underfilled = t.filled_at_request.is_none();
    }
    Ok(out)
}

/// How many replicas `replica_of` names (1 when empty), refusing a split that does not give
/// every request one or names more than `MAX_REPLICAS`.
fn replica_count(trace: &Trace, replica_of: &[u32]) -> KvResult<usize> {
    if replica_of.is_empty() {
        return Ok(1);
    }
    if replica_of.len() != trace.n_requests() {
        return Err(KvError::invalid(
            "replicas",
            format!("expected one replica per request ({}), got {}", trace.n_requests(), replica_of.len()),
        ));
    }
    let n = replica_of.iter().max().map_or(1, |&m| m as usize + 1);
    if n > MAX_REPLICAS {
        return Err(KvError::invalid("replicas", format!("replica {} named; at most {MAX_REPLICAS} replicas", n - 1)));
    }
    Ok(n)
}
