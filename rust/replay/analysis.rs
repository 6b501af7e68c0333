//! Trace statistics for the planner's four questions: which prefixes are shared, how soon
//! blocks come back (reuse time and reuse distance), and how many blocks are used only once.

use super::{Trace, NONE};

/// A maximal shared prefix: used by `requests` requests, and no longer prefix is used by as many.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedPrefix {
    /// Raw trace id of the prefix's last block.
    pub last_key: u64,
    pub blocks: u32,
    pub tokens: u64,
    pub requests: u64,
    /// Index of the first request that used it.
    pub first_request: u64,
}

#[derive(Clone, Debug, Default)]
pub struct TraceAnalysis {
    pub one_hit_keys: u64,
    pub one_hit_refs: u64,
    pub one_hit_tokens: u64,
    /// Tokens in blocks used by at least two requests.
    pub shared_tokens: u64,
    pub block_tokens: u64,
    /// For every reuse of a key seen in an earlier request: seconds since its previous use and
    /// the number of distinct other blocks referenced in between (an LRU cache of C blocks
    /// without prefix rules keeps the block iff that number is below C).
    pub reuse_time_s: Vec<f64>,
    pub reuse_distance: Vec<u64>,
    /// Top maximal shared prefixes by reusable tokens ((requests - 1) * tokens).
    pub top_prefixes: Vec<SharedPrefix>,
}

struct Fenwick(Vec<i64>);

impl Fenwick {
    fn add(&mut self, mut i: usize, d: i64) {
        i += 1;
        while i < self.0.len() {
            self.0[i] += d;
            i += i & i.wrapping_neg();
        }
    }
    /// Sum over positions 0..=i.
    fn prefix(&self, i: usize) -> i64 {
        let mut i = i + 1;
        let mut s = 0;
        while i > 0 {
            s += self.0[i];
            i -= i & i.wrapping_neg();
        }
        s
    }
}

pub fn analyze(trace: &Trace, top: usize) -> TraceAnalysis {
    let n_keys = trace.n_keys();
    let mut refs = vec![0u64; n_keys]; // requests using the key
    let mut last_req = vec![NONE; n_keys];
    let mut last_pos = vec![usize::MAX; n_keys];
    let mut depth = vec![0u32; n_keys];
    let mut prefix_tokens = vec![0u64; n_keys];
    let mut parent = vec![NONE; n_keys];
    let mut first_req = vec![0u64; n_keys];
    let mut fen = Fenwick(vec![0; trace.n_refs() + 1]);
    let mut out = TraceAnalysis::default();
    for r in 0..trace.n_requests() {
        let start = trace.range(r).start;
        let mut tokens = 0u64;
        for (i, &k) in trace.request(r).iter().enumerate() {
            let ki = k as usize;
            let bt = trace.block_tokens(r, i);
            tokens += bt;
            out.block_tokens += bt;
            let p = start + i;
            if last_req[ki] == NONE {
                depth[ki] = i as u32 + 1;
                prefix_tokens[ki] = tokens;
                parent[ki] = if i > 0 { trace.request(r)[i - 1] } else { NONE };
                first_req[ki] = r as u64;
            } else if last_req[ki] != r as u32 {
                let q = last_pos[ki];
                let between = fen.prefix(p - 1) - fen.prefix(q);
                out.reuse_distance.push(between as u64);
                let dt = trace.timestamp_ns(r).saturating_sub(trace.timestamp_ns(last_req[ki] as usize));
                out.reuse_time_s.push(dt as f64 / 1e9);
            }
            if last_req[ki] != r as u32 {
                refs[ki] += 1;
            }
            if last_pos[ki] != usize::MAX {
                fen.add(last_pos[ki], -1);
            }
            fen.add(p, 1);
            last_pos[ki] = p;
            last_req[ki] = r as u32;
        }
    }
    for r in 0..trace.n_requests() {
        for (i, &k) in trace.request(r).iter().enumerate() {
            let bt = trace.block_tokens(r, i);
            if refs[k as usize] == 1 {
                out.one_hit_refs += 1;
                out.one_hit_tokens += bt;
            } else {
                out.shared_tokens += bt;
            }
        }
    }
    out.one_hit_keys = refs.iter().filter(|&&c| c == 1).count() as u64;
    // A prefix is maximal when no child prefix is used by as many requests.
    let mut max_child = vec![0u64; n_keys];
    for k in 0..n_keys {
        if parent[k] != NONE {
            let p = parent[k] as usize;
            max_child[p] = max_child[p].max(refs[k]);
        }
    }
    let mut cands: Vec<usize> = (0..n_keys).filter(|&k| refs[k] >= 2 && max_child[k] < refs[k]).collect();
    let score = |k: usize| (refs[k] - 1) * prefix_tokens[k];
    cands.sort_by(|&a, &b| score(b).cmp(&score(a)).then(first_req[a].cmp(&first_req[b])));
    out.top_prefixes = cands
        .into_iter()
        .take(top)
        .map(|k| SharedPrefix {
            last_key: trace.raw_key(k as u32),
            blocks: depth[k],
            tokens: prefix_tokens[k],
            requests: refs[k],
            first_request: first_req[k],
        })
        .collect();
    out
}
