//! The single-tier replay engine: cache residency, the cached prefix tree, admission, and the
//! per-request lookup / placement / apply steps. Victim choice is delegated to a `Strategy`:
//! one of the core's `EvictionPolicy` implementations (online) or Belady (`opt`).

use std::sync::atomic::{AtomicU64, Ordering};

use super::opt::Opt;
use super::{check_warmup, Trace, NONE};
use crate::admission::AdmissionRule;
use crate::error::{KvError, KvResult};
use crate::policy::{EvictionPolicy, InsertHint, PolicyKind, DEFAULT_PRIORITY};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Prefix-tree mode (default): admit a block only under a cached parent, evict only leaves.
    Tree,
    /// Flat mode: any block may be admitted or evicted; hits must still be a contiguous prefix.
    Flat,
}

impl Mode {
    pub fn parse(s: &str) -> KvResult<Self> {
        match s {
            "tree" => Ok(Mode::Tree),
            "flat" => Ok(Mode::Flat),
            other => Err(KvError::invalid("mode", format!("unknown mode {other:?}; expected \"tree\" or \"flat\""))),
        }
    }
}

/// What one replay measured (over the requests after warmup only).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReplayStats {
    pub hit_tokens: u64,
    pub total_tokens: u64,
    pub hit_blocks: u64,
    pub total_blocks: u64,
    pub measured_requests: u64,
    /// Over the whole replay, warmup included: hit blocks (what Belady's `opt` maximises, and
    /// so bounds for every policy at the same capacity), insertions, evictions, peak residency.
    pub all_hit_blocks: u64,
    pub insertions: u64,
    pub evictions: u64,
    pub peak_resident: u64,
    /// The cache never became full during the whole replay: nothing was ever evicted for lack
    /// of room, so this capacity holds all the trace offered it (an infinite cache would hit
    /// the same). Never set for the ceiling.
    pub underfilled: bool,
    /// The request whose placement first filled the cache (None: never full). Requests up to
    /// and including it were looked up in a cache not yet full; the planner flags a capacity
    /// whose cache filled only well into the measured window (its rate is mostly warm-up).
    pub filled_at_request: Option<u64>,
    /// Measured requests by their number of hit blocks: `(hit blocks, requests, their hit
    /// tokens)`, for each count > 0 that occurs, ascending. A request's hits are loaded as one
    /// job, so the planner weighs load against recompute per entry (see planner/gains.py).
    pub hit_histogram: Vec<(u32, u64, u64)>,
}

/// Residency and prefix-tree bookkeeping, indexed by dense key id.
pub(crate) struct Cache {
    mode: Mode,
    capacity: usize,
    len: usize,
    resident: Vec<bool>,
    parent: Vec<u32>,
    children: Vec<u32>,
    /// Stamps (request index + 1): "belongs to the request being served", "placed by it",
    /// "already shown to the policy in its apply step".
    in_request: Vec<u32>,
    placed: Vec<u32>,
    applied: Vec<u32>,
    uses: Vec<u32>,
    /// Per position of the request being applied: the nearest block before it that this
    /// request did not place (NONE: none), the prefix a placed block extends.
    prefixes: Vec<u32>,
    admission: AdmissionRule,
    /// The request whose placement first filled the cache.
    filled_at: Option<u32>,
    pub(crate) insertions: u64,
    pub(crate) evictions: u64,
    pub(crate) peak: usize,
}

impl Cache {
    pub(crate) fn new(n_keys: usize, capacity: usize, mode: Mode, admission: AdmissionRule) -> Self {
        Cache {
            mode,
            capacity,
            len: 0,
            resident: vec![false; n_keys],
            parent: vec![NONE; n_keys],
            children: vec![0; n_keys],
            in_request: vec![0; n_keys],
            placed: vec![0; n_keys],
            applied: vec![0; n_keys],
            uses: vec![0; n_keys],
            prefixes: Vec::new(),
            admission,
            filled_at: None,
            insertions: 0,
            evictions: 0,
            peak: 0,
        }
    }

    #[inline]
    pub(crate) fn is_resident(&self, k: u32) -> bool {
        self.resident[k as usize]
    }
    #[inline]
    pub(crate) fn children(&self, k: u32) -> u32 {
        self.children[k as usize]
    }
    pub(crate) fn mode(&self) -> Mode {
        self.mode
    }
    pub(crate) fn filled_at(&self) -> Option<u64> {
        self.filled_at.map(u64::from)
    }

    /// May `k` be evicted while request `stamp - 1` is served?
    #[inline]
    pub(crate) fn evictable(&self, k: u32, stamp: u32) -> bool {
        let k = k as usize;
        self.in_request[k] != stamp && (self.mode == Mode::Flat || self.children[k] == 0)
    }

    fn admits(&self, k: u32) -> bool {
        match self.admission {
            AdmissionRule::Always => true,
            // Uses are counted exactly (the live tier's count-min sketch can only over-count).
            AdmissionRule::AfterUses(n) => self.uses[k as usize] >= n,
            // Traces carry no retention priority: every block has the default level.
            AdmissionRule::MinPriority(t) => DEFAULT_PRIORITY >= t,
        }
    }

    fn evict<S: Strategy>(&mut self, v: u32, strat: &mut S) {
        let vi = v as usize;
        debug_assert!(self.resident[vi], "victim {v} is not resident");
        self.resident[vi] = false;
        self.len -= 1;
        self.evictions += 1;
        let p = std::mem::replace(&mut self.parent[vi], NONE);
        if p != NONE {
            let c = &mut self.children[p as usize];
            *c -= 1;
            if *c == 0 {
                strat.leaf_gained(self, p);
            }
        }
    }

    fn place<S: Strategy>(&mut self, k: u32, parent: u32, stamp: u32, strat: &mut S) {
        let ki = k as usize;
        self.resident[ki] = true;
        self.len += 1;
        self.peak = self.peak.max(self.len);
        self.insertions += 1;
        self.placed[ki] = stamp;
        if self.mode == Mode::Tree && parent != NONE {
            self.parent[ki] = parent;
            let c = &mut self.children[parent as usize];
            *c += 1;
            if *c == 1 {
                strat.leaf_lost(self, parent);
            }
        }
    }

    /// Serve request `r`: lookup, placement, apply. Returns the number of hit blocks.
    pub(crate) fn step<S: Strategy>(&mut self, strat: &mut S, trace: &Trace, r: usize) -> usize {
        let stamp = r as u32 + 1;
        let keys = trace.request(r);
        let base = trace.range(r).start;
        let now = trace.timestamp_ns(r);
        for &k in keys {
            self.in_request[k as usize] = stamp;
            self.uses[k as usize] = self.uses[k as usize].saturating_add(1);
        }
        let mut hits = 0;
        while hits < keys.len() && self.resident[keys[hits] as usize] {
            hits += 1;
        }
        let mut end = hits;
        while end < keys.len() {
            let k = keys[end];
            if !self.resident[k as usize] {
                if !self.admits(k) {
                    break;
                }
                if self.len >= self.capacity {
                    match strat.victim(self, stamp, base + end, now) {
                        Some(v) => self.evict(v, strat),
                        None => break,
                    }
                }
                let parent = if end > 0 { keys[end - 1] } else { NONE };
                self.place(k, parent, stamp, strat);
            }
            end += 1;
        }
        if self.len >= self.capacity && self.filled_at.is_none() {
            self.filled_at = Some(r as u32);
        }
        let mut prefix = NONE;
        self.prefixes.clear();
        for &k in &keys[..end] {
            self.prefixes.push(prefix);
            if self.placed[k as usize] != stamp {
                prefix = k;
            }
        }
        // Tail first, each key once: the head of the chain ends up the most recent.
        for (i, &k) in keys[..end].iter().enumerate().rev() {
            let ki = k as usize;
            if self.applied[ki] != stamp {
                self.applied[ki] = stamp;
                let placed = self.placed[ki] == stamp;
                strat.apply(self, k, placed, if placed { self.prefixes[i] } else { NONE }, now);
            }
        }
        strat.request_done(self, trace, r);
        hits
    }
}

/// How victims are chosen. Leaf notifications let a strategy keep its own index of leaves.
pub(crate) trait Strategy {
    /// One victim to make room for the block at reference position `incoming`, or None to stop
    /// placing this request's blocks.
    fn victim(&mut self, cache: &Cache, stamp: u32, incoming: usize, now_ns: u64) -> Option<u32>;
    /// `k` got its first cached child (placement).
    fn leaf_lost(&mut self, _cache: &Cache, _k: u32) {}
    /// `k` lost its last cached child (eviction).
    fn leaf_gained(&mut self, _cache: &Cache, _k: u32) {}
    /// The request's chain, tail first: `placed` for blocks this request inserted, with the
    /// block they extend (`prefix`: the nearest one before them in the request that was
    /// cached before it; NONE: none, and always for blocks not placed).
    fn apply(&mut self, cache: &Cache, k: u32, placed: bool, prefix: u32, now_ns: u64);
    fn request_done(&mut self, _cache: &Cache, _trace: &Trace, _r: usize) {}
}

/// One of the core's eviction policies, with the prefix-tree rules as its `evictable` predicate.
pub(crate) struct Online {
    policy: Box<dyn EvictionPolicy<u32>>,
}

impl Online {
    /// `kind` for `capacity` blocks of a trace with `n_keys` distinct blocks (its node ids).
    pub(crate) fn new(kind: PolicyKind, capacity: usize, n_keys: usize) -> Self {
        Online { policy: kind.build_for_ids(capacity, capacity.min(n_keys)) }
    }
}

impl Strategy for Online {
    fn victim(&mut self, cache: &Cache, stamp: u32, _incoming: usize, now_ns: u64) -> Option<u32> {
        // One victim at a time: evicting a leaf can make its parent a leaf, and the predicate
        // must answer the same for a key throughout one call.
        self.policy.select_victims(1, now_ns, &mut |k: &u32| cache.evictable(*k, stamp)).map(|v| v[0])
    }
    fn apply(&mut self, _cache: &Cache, k: u32, placed: bool, prefix: u32, now_ns: u64) {
        if placed && prefix != NONE {
            self.policy.insert_extending(&k, &prefix, InsertHint::default(), now_ns);
        } else if placed {
            self.policy.insert(&k, InsertHint::default(), now_ns);
        } else {
            self.policy.touch(&k, now_ns);
        }
    }
}

/// The infinite cache: never full, so never asked for a victim.
struct Unbounded;

impl Strategy for Unbounded {
    fn victim(&mut self, _: &Cache, _: u32, _: usize, _: u64) -> Option<u32> {
        None
    }
    fn apply(&mut self, _: &Cache, _: u32, _: bool, _: u32, _: u64) {}
}

/// Which replay to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replayer {
    Policy(PolicyKind),
    Opt,
    Ceiling,
}

/// Replay the whole trace through one cache of `capacity` blocks.
/// `progress` is bumped by the number of requests served, in chunks.
pub fn replay_one(
    trace: &Trace,
    which: Replayer,
    capacity: usize,
    admission: AdmissionRule,
    mode: Mode,
    warmup: f64,
    progress: Option<&AtomicU64>,
) -> KvResult<ReplayStats> {
    check_warmup(warmup)?;
    if capacity == 0 && which != Replayer::Ceiling {
        return Err(KvError::invalid("capacity", "must be at least 1 block"));
    }
    Ok(match which {
        Replayer::Policy(kind) => {
            let mut cache = Cache::new(trace.n_keys(), capacity, mode, admission);
            run(trace, &mut cache, &mut Online::new(kind, capacity, trace.n_keys()), warmup, progress, true)
        }
        Replayer::Opt => {
            trace.check_chained_for_opt()?;
            let mut cache = Cache::new(trace.n_keys(), capacity, mode, admission);
            run(trace, &mut cache, &mut Opt::new(trace), warmup, progress, true)
        }
        Replayer::Ceiling => {
            let mut cache = Cache::new(trace.n_keys(), usize::MAX, mode, AdmissionRule::Always);
            run(trace, &mut cache, &mut Unbounded, warmup, progress, false)
        }
    })
}

fn run<S: Strategy>(
    trace: &Trace,
    cache: &mut Cache,
    strat: &mut S,
    warmup: f64,
    progress: Option<&AtomicU64>,
    bounded: bool,
) -> ReplayStats {
    const CHUNK: usize = 1024;
    let first = trace.warmup_requests(warmup);
    let mut st = ReplayStats::default();
    // (requests, hit tokens) by hit blocks.
    let mut by_hits: Vec<(u64, u64)> = Vec::new();
    for r in 0..trace.n_requests() {
        let hits = cache.step(strat, trace, r);
        st.all_hit_blocks += hits as u64;
        if r >= first {
            let hit_tokens = (0..hits).map(|i| trace.block_tokens(r, i)).sum::<u64>();
            st.measured_requests += 1;
            st.total_tokens += trace.input_tokens(r);
            st.total_blocks += trace.request(r).len() as u64;
            st.hit_blocks += hits as u64;
            st.hit_tokens += hit_tokens;
            if hits > 0 {
                if by_hits.len() <= hits {
                    by_hits.resize(hits + 1, (0, 0));
                }
                by_hits[hits].0 += 1;
                by_hits[hits].1 += hit_tokens;
            }
        }
        if let Some(p) = progress {
            if (r + 1) % CHUNK == 0 {
                p.fetch_add(CHUNK as u64, Ordering::Relaxed);
            }
        }
    }
    if let Some(p) = progress {
        p.fetch_add((trace.n_requests() % CHUNK) as u64, Ordering::Relaxed);
    }
    st.insertions = cache.insertions;
    st.evictions = cache.evictions;
    st.peak_resident = cache.peak as u64;
    st.hit_histogram =
        by_hits.iter().enumerate().filter(|(_, e)| e.0 > 0).map(|(n, &(reqs, toks))| (n as u32, reqs, toks)).collect();
    st.filled_at_request = cache.filled_at();
    st.underfilled = bounded && st.filled_at_request.is_none();
    st
}
