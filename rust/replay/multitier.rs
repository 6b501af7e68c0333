//! Multi-tier replay: GPU, CPU and disk tiers, each its own prefix-tree cache with its own
//! policy and admission rule.
//!
//! Tiers are inclusive and written through, as vLLM's offloading connector stores every
//! computed block to the CPU tier and the CPU tier feeds the secondary ones: every tier sees
//! each request's whole chain (hits touched, new blocks offered to its admission rule) and
//! evicts on its own. A request's usable prefix is the longest prefix whose blocks are each
//! held by some tier; each block of it is served by the fastest tier holding it (tier order),
//! so a block from the CPU tier is a CPU promotion and one from disk a disk promotion.

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
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TierResult {
    pub name: String,
    /// Measured tokens and blocks served from this tier (GPU hits, or promotions).
    pub served_tokens: u64,
    pub served_blocks: u64,
    /// Blocks written into / evicted from this tier over the whole replay.
    pub insertions: u64,
    pub evictions: u64,
    /// Never full during the replay; `filled_at_request`: the request that first filled it
    /// (as in `ReplayStats`).
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

pub fn replay_tiers(trace: &Trace, specs: &[TierSpec], mode: Mode, warmup: f64) -> KvResult<TiersResult> {
    check_warmup(warmup)?;
    if specs.is_empty() {
        return Err(KvError::invalid("tiers", "give at least one tier"));
    }
    if let Some(t) = specs.iter().find(|t| t.capacity == 0) {
        return Err(KvError::invalid("tiers", format!("tier {:?} has capacity 0", t.name)));
    }
    let mut caches: Vec<Cache> =
        specs.iter().map(|t| Cache::new(trace.n_keys(), t.capacity, mode, t.admission)).collect();
    let mut policies: Vec<Online> = specs.iter().map(|t| Online::new(t.policy, t.capacity, trace.n_keys())).collect();
    let mut out = TiersResult {
        tiers: specs.iter().map(|t| TierResult { name: t.name.clone(), ..Default::default() }).collect(),
        ..Default::default()
    };
    let first = trace.warmup_requests(warmup);
    let mut histogram: BTreeMap<Vec<u32>, (u64, Vec<u64>)> = BTreeMap::new();
    for r in 0..trace.n_requests() {
        if r >= first {
            let keys = trace.request(r);
            let mut served = 0;
            let (mut blocks, mut tokens) = (vec![0u32; specs.len()], vec![0u64; specs.len()]);
            for (i, &k) in keys.iter().enumerate() {
                let Some(t) = caches.iter().position(|c| c.is_resident(k)) else { break };
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
        for (cache, policy) in caches.iter_mut().zip(policies.iter_mut()) {
            cache.step(policy, trace, r);
        }
    }
    out.served_histogram = histogram.into_iter().map(|(blocks, (reqs, tokens))| (blocks, reqs, tokens)).collect();
    for (t, c) in out.tiers.iter_mut().zip(&caches) {
        t.insertions = c.insertions;
        t.evictions = c.evictions;
        t.filled_at_request = c.filled_at();
        t.underfilled = t.filled_at_request.is_none();
    }
    Ok(out)
}
