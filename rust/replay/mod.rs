//! Trace replay for the planner: the core's eviction policies driven by a request trace under
//! prefix-cache rules, plus the offline pieces the planner needs (Belady `opt`, an infinite
//! "ceiling" cache, a multi-tier replay and trace statistics).
//!
//! Semantics (kept identical to the independent Python model in tests/support/planner_reference.py):
//! - Requests are replayed in trace order. Each request is a chain of block keys; block `i`
//!   holds `min(block_size, input_tokens - i * block_size)` tokens, and tokens not covered by any
//!   block (traces that list only full blocks) always miss.
//! - Lookup: the request's hit blocks are the longest prefix of its chain that is resident.
//!   After the first miss every later block is a miss, even if resident.
//! - Placement: from the first miss on, blocks are placed one at a time. A block already
//!   resident is kept as is; otherwise it must pass the admission rule, and, when the cache is
//!   full, one victim is asked for. Victims are never blocks of the request being served and,
//!   in prefix-tree mode, only leaves of the cached prefix tree (blocks with no cached child).
//!   Placement stops at the first block that cannot be placed. In prefix-tree mode a block is
//!   therefore only admitted when its parent (the previous block of the chain) is cached.
//! - Apply: the policy then sees the request's chain tail first, as the live index applies it
//!   and as vLLM frees a finished request's blocks: `insert` for blocks placed by this request,
//!   `touch` for the rest, so the head of a chain is always more recent than its tail. A placed
//!   block extends the nearest block before it that the request did not place
//!   (`insert_extending`): FIFO puts it just ahead of that block in its queue.
//! - Hit rate is token-weighted over the measured requests (all but the first `warmup` share).
//! - `opt` needs a prefix-chained trace (each block id always follows the same one) and refuses
//!   any other: only there is Belady a bound on every policy's block hits.

mod analysis;
mod multitier;
mod opt;
mod prefix_tree;
mod sweep;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::OnceLock;

pub use analysis::{analyze, SharedPrefix, TraceAnalysis};
pub use multitier::{replay_replicas, replay_tiers, TierResult, TierSpec, TiersResult, MAX_REPLICAS};
pub use prefix_tree::{replay_one, Mode, ReplayStats, Replayer};
pub use sweep::{run_sweep, Job, JobKind, Progress};

use crate::error::{KvError, KvResult};

/// Marker for "no next use" / "no parent".
pub(crate) const NONE: u32 = u32::MAX;

/// A request trace with keys remapped to dense ids `0..n_keys`.
pub struct Trace {
    block_size: u32,
    /// `offsets[r]..offsets[r + 1]` are request `r`'s positions in `keys`.
    offsets: Vec<u32>,
    keys: Vec<u32>,
    input_tokens: Vec<u64>,
    timestamps_ns: Vec<u64>,
    raw_keys: Vec<u64>,
    /// The first block that breaks prefix chaining, if any (see `check_chained_for_opt`).
    unchained: Option<Unchained>,
    /// Per reference: index of the next request that uses the same key (NONE if never).
    next_use: OnceLock<Vec<u32>>,
}

impl Trace {
    /// `offsets` has one entry per request plus a final one (`offsets[0] == 0`,
    /// `offsets[last] == keys.len()`); `input_tokens` and `timestamps_s` one per request.
    pub fn new(
        block_size: u32,
        offsets: Vec<u64>,
        keys: Vec<u64>,
        input_tokens: Vec<u64>,
        timestamps_s: Vec<f64>,
    ) -> KvResult<Self> {
        if block_size == 0 {
            return Err(KvError::invalid("block_size", "must be positive"));
        }
        let n = input_tokens.len();
        if offsets.len() != n + 1 {
            return Err(KvError::invalid(
                "offsets",
                format!("expected {} entries (requests + 1), got {}", n + 1, offsets.len()),
            ));
        }
        if timestamps_s.len() != n {
            return Err(KvError::invalid("timestamps", format!("expected {n} entries, got {}", timestamps_s.len())));
        }
        if let Some((r, t)) = timestamps_s.iter().enumerate().find(|(_, t)| !t.is_finite()) {
            return Err(KvError::invalid("timestamps", format!("request {r}: {t} is not a finite number of seconds")));
        }
        // Requests replay in trace order and reuse times are differences of timestamps: a
        // timestamp earlier than the one before it would make them negative.
        if let Some(r) = (1..n).find(|&r| timestamps_s[r] < timestamps_s[r - 1]) {
            return Err(KvError::invalid(
                "timestamps",
                format!(
                    "request {r}: {} s is earlier than request {}'s {} s; requests replay in trace order, so \
                     timestamps must not decrease",
                    timestamps_s[r],
                    r - 1,
                    timestamps_s[r - 1]
                ),
            ));
        }
        // The replays sum tokens in u64 (hit tokens, totals): refuse a trace whose sum would wrap.
        if input_tokens.iter().try_fold(0u64, |sum, &t| sum.checked_add(t)).is_none() {
            return Err(KvError::invalid("input_tokens", "their sum is beyond 2^64"));
        }
        if offsets[0] != 0 || offsets[n] != keys.len() as u64 {
            return Err(KvError::invalid("offsets", "must start at 0 and end at the number of keys"));
        }
        if keys.len() >= u32::MAX as usize || n >= u32::MAX as usize {
            return Err(KvError::invalid("keys", "trace too large (more than 2^32 - 1 block references)"));
        }
        let bs = u64::from(block_size);
        for r in 0..n {
            let (a, b) = (offsets[r], offsets[r + 1]);
            if b < a {
                return Err(KvError::invalid("offsets", format!("decrease at request {r}")));
            }
            // Every block must hold at least one token.
            let blocks = b - a;
            if blocks > 0 && input_tokens[r] <= (blocks - 1) * bs {
                return Err(KvError::invalid(
                    "hash_ids",
                    format!(
                        "request {r} has {blocks} blocks but only {} input tokens (block size {bs})",
                        input_tokens[r]
                    ),
                ));
            }
        }
        let mut ids: HashMap<u64, u32, foldhash::fast::RandomState> = HashMap::default();
        let mut raw_keys = Vec::new();
        let dense = keys
            .iter()
            .map(|&k| {
                *ids.entry(k).or_insert_with(|| {
                    raw_keys.push(k);
                    (raw_keys.len() - 1) as u32
                })
            })
            .collect::<Vec<u32>>();
        let unchained = first_unchained(&offsets, &dense, &raw_keys);
        // Nanoseconds since the first request, so negative (but ordered) timestamps work too.
        let t0 = timestamps_s.first().copied().unwrap_or(0.0);
        let timestamps_ns = timestamps_s.iter().map(|&t| ((t - t0) * 1e9) as u64).collect();
        Ok(Trace {
            block_size,
            offsets: offsets.into_iter().map(|o| o as u32).collect(),
            keys: dense,
            input_tokens,
            timestamps_ns,
            raw_keys,
            unchained,
            next_use: OnceLock::new(),
        })
    }

    /// Every block id always follows the same block id (or always starts its request), as
    /// when ids digest their whole prefix (Mooncake's hash ids, `chain_hash`). Such a trace
    /// never repeats a block inside one request either.
    pub fn prefix_chained(&self) -> bool {
        self.unchained.is_none()
    }

    /// Belady's `opt` is optimal (a bound on every policy's block hits) only on a prefix-chained
    /// trace: there a block's next use is a hit whenever it is cached, since its parent is used
    /// with it. Without chaining a block's next use can sit behind a miss, so `opt` keeps
    /// blocks worth nothing and online policies beat it (see the test
    /// `opt_is_never_beaten_it_is_refused_on_a_trace_that_is_not_prefix_chained`); it is
    /// refused rather than reported as a bound.
    pub(crate) fn check_chained_for_opt(&self) -> KvResult<()> {
        let Some((key, r1, p1, r2, p2)) = self.unchained else { return Ok(()) };
        let after =
            |p: Option<u64>| p.map_or("starts request".to_string(), |p| format!("follows block {p} in request"));
        Err(KvError::invalid(
            "policy",
            format!(
                "opt (Belady) bounds hits only on a prefix-chained trace (each block id always after the same \
                 block, as ids that digest their whole prefix are); here block {key} {} {r1} but {} {r2}, so a policy could \
                 beat opt: leave opt out of the policies",
                after(p1),
                after(p2)
            ),
        ))
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }
    pub fn n_requests(&self) -> usize {
        self.input_tokens.len()
    }
    pub fn n_refs(&self) -> usize {
        self.keys.len()
    }
    pub fn n_keys(&self) -> usize {
        self.raw_keys.len()
    }
    pub fn raw_key(&self, id: u32) -> u64 {
        self.raw_keys[id as usize]
    }
    pub fn total_tokens(&self) -> u64 {
        self.input_tokens.iter().sum()
    }
    pub(crate) fn range(&self, r: usize) -> std::ops::Range<usize> {
        self.offsets[r] as usize..self.offsets[r + 1] as usize
    }
    pub(crate) fn request(&self, r: usize) -> &[u32] {
        &self.keys[self.range(r)]
    }
    pub(crate) fn input_tokens(&self, r: usize) -> u64 {
        self.input_tokens[r]
    }
    pub(crate) fn timestamp_ns(&self, r: usize) -> u64 {
        self.timestamps_ns[r]
    }
    /// Tokens held by block `i` of request `r`.
    #[inline]
    pub(crate) fn block_tokens(&self, r: usize, i: usize) -> u64 {
        let bs = u64::from(self.block_size);
        bs.min(self.input_tokens[r] - i as u64 * bs)
    }

    /// First measured request for a warmup share `warmup` in [0, 1).
    pub fn warmup_requests(&self, warmup: f64) -> usize {
        ((self.n_requests() as f64) * warmup).floor() as usize
    }

    /// Next request using the same key, per reference (computed once, shared by `opt` jobs).
    pub(crate) fn next_use(&self) -> &[u32] {
        self.next_use.get_or_init(|| {
            let mut last = vec![NONE; self.n_keys()];
            let mut out = vec![NONE; self.keys.len()];
            for r in (0..self.n_requests()).rev() {
                let range = self.range(r);
                // Read every key's next use before recording this request, so a key repeated
                // inside one request still points past it.
                for p in range.clone() {
                    out[p] = last[self.keys[p] as usize];
                }
                for p in range {
                    last[self.keys[p] as usize] = r as u32;
                }
            }
            out
        })
    }
}

/// A block that breaks prefix chaining: (raw key, its first request, its predecessor there,
/// a later request, its predecessor there); None: the start of the request.
type Unchained = (u64, u64, Option<u64>, u64, Option<u64>);

/// The first reference whose block id follows a different block (or none) than at its first
/// occurrence.
fn first_unchained(offsets: &[u64], dense: &[u32], raw_keys: &[u64]) -> Option<Unchained> {
    // Per dense key: (predecessor at its first occurrence, NONE for none; that request).
    let mut first: Vec<Option<(u32, u64)>> = vec![None; raw_keys.len()];
    let raw = |k: u32| (k != NONE).then(|| raw_keys[k as usize]);
    for r in 0..offsets.len().saturating_sub(1) {
        let chain = &dense[offsets[r] as usize..offsets[r + 1] as usize];
        for (i, &k) in chain.iter().enumerate() {
            let pred = if i == 0 { NONE } else { chain[i - 1] };
            match first[k as usize] {
                None => first[k as usize] = Some((pred, r as u64)),
                Some((p, r1)) if p != pred => return Some((raw_keys[k as usize], r1, raw(p), r as u64, raw(pred))),
                Some(_) => {}
            }
        }
    }
    None
}

pub(crate) fn check_warmup(warmup: f64) -> KvResult<()> {
    if !(0.0..1.0).contains(&warmup) {
        return Err(KvError::invalid("warmup", format!("must be in [0, 1), got {warmup}")));
    }
    Ok(())
}
