//! Eviction policies behind one trait.
//!
//! A policy only orders resident keys; it never owns data or slots. The index tells it what
//! became resident (`insert`), what was used (`touch`), which resident key was claimed again
//! with a new retention hint (`renew`) and what left outside eviction (`remove`), and asks it
//! for victims (`select_victims`).
//!
//! Contract shared by every policy (the hypothesis and proptest models check it):
//! - `select_victims(n, ..)` is all-or-nothing: it returns exactly `n` victims, removed from the
//!   resident set, or `None` with nothing changed.
//! - A key for which `evictable` answers false (pinned, being written, or, in the planner, an
//!   interior node of the prefix tree) is never chosen. `evictable` must give the same answer for
//!   a key throughout one call.
//! - Prefix awareness comes from the index: it applies a request's chain in reverse (tail first),
//!   so every policy sees the head as the more recent and evicts the tail first, and it names
//!   the cached prefix of the blocks a store adds to a chain (`insert_extending`).

mod arc;
mod dense_lists;
mod lhd;
mod lru;
mod priority;
mod s3fifo;

use std::hash::Hash;

pub use arc::Arc as ArcPolicy;
pub use dense_lists::DenseId;
pub use lhd::HitDensity;
pub use lru::Lru;
pub use priority::{Priority, DEFAULT_PRIORITY, MAX_PRIORITY};
pub use s3fifo::S3Fifo;

use crate::error::{KvError, KvResult};

/// What a policy needs to know about a key when it becomes resident.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InsertHint {
    /// Retention priority 0..=100 (TensorRT-LLM's scale); only the priority policy reads it.
    pub priority: u8,
    /// After this many nanoseconds the block falls back to the default priority.
    pub duration_ns: Option<u64>,
}

impl Default for InsertHint {
    fn default() -> Self {
        InsertHint { priority: DEFAULT_PRIORITY, duration_ns: None }
    }
}

/// What a policy orders. Resident keys are named by where they live: `dense_id` (the index's
/// slot, the planner's node id), unique among resident keys, is where the policy's lists keep
/// them (`dense_lists`). Ghost entries (ARC's B1/B2, S3-FIFO's ghost queue) remember a key after
/// it left and are matched by `ghost_id` instead, so they still follow the block's identity
/// after its slot is reused. Two keys sharing a ghost id can only mislead the policy's
/// adaptation, never make the index confuse blocks.
pub trait PolicyKey: DenseId + Eq + Hash + Send + 'static {
    fn ghost_id(&self) -> u64;
}

macro_rules! integer_policy_keys {
    ($($t:ty),*) => {$(
        impl DenseId for $t {
            fn dense_id(&self) -> u32 {
                u32::from(*self)
            }
        }
        impl PolicyKey for $t {
            fn ghost_id(&self) -> u64 {
                u64::from(*self)
            }
        }
    )*};
}
integer_policy_keys!(u8, u32);

pub trait EvictionPolicy<K: PolicyKey>: Send {
    fn kind(&self) -> PolicyKind;
    /// `key` became resident. Inserting a resident key is a caller bug; policies ignore it.
    fn insert(&mut self, key: &K, hint: InsertHint, now_ns: u64);
    /// `key` became resident as an extension of a cached chain: `prefix` is the nearest block
    /// before it in the same call (store, request) that was resident before the call. The
    /// default is `insert`, right for every policy that ranks by use: the caller then touches
    /// the chain's present blocks, which ranks them behind `key`. FIFO has no use to rank by
    /// and puts `key` just ahead of `prefix` instead, so an extension leaves with its chain (and
    /// before it), never after it. An unknown `prefix` makes it a plain `insert`.
    fn insert_extending(&mut self, key: &K, prefix: &K, hint: InsertHint, now_ns: u64) {
        let _ = prefix;
        self.insert(key, hint, now_ns);
    }
    /// `key` was used. Unknown keys are ignored.
    fn touch(&mut self, key: &K, now_ns: u64);
    /// `key`, resident, was claimed again with `hint` (TensorRT-LLM: "a later claim with a new
    /// priority always overrides the old one"): it ranks as if it had just been inserted with
    /// `hint` at `now_ns`. A renewal is not a use: it never counts toward recency or frequency.
    /// Unknown keys are ignored. The default does nothing, which is right for every policy whose
    /// order ignores the hint (FIFO, LRU, ARC, S3-FIFO: their insert reads no hint, and moving a
    /// key as if re-inserted would be a use in disguise); the priority policy overrides it.
    fn renew(&mut self, key: &K, hint: InsertHint, now_ns: u64) {
        let _ = (key, hint, now_ns);
    }
    /// `key`, resident, ranks as the most recent of the list or level it already holds, and the
    /// call is not a use: no promotion, no frequency. An engine calls it to put back in prefix
    /// order the blocks a request only stored (out-of-order stores, several KV-cache groups),
    /// which a touch would count as reuse. Unknown keys are ignored. The default does nothing,
    /// which is right where the order is arrival order (FIFO, S3-FIFO's queues); LRU, priority
    /// and ARC override it.
    fn refresh(&mut self, key: &K, now_ns: u64) {
        let _ = (key, now_ns);
    }
    /// Whether the index must offer this policy only blocks that no resident block extends
    /// (the leaves of the prefix tree). The default, false, is right for every policy that
    /// ranks by recency: the index applies a chain tail first, so the head is the more recent
    /// and the tail leaves first anyway. A policy that ranks by learned value may rank a
    /// chain's head below its tail, and evicting the head would strand the tail.
    fn leaves_only(&self) -> bool {
        false
    }
    /// `key` left the tier without being evicted (removed, or its store failed). No ghost entry.
    fn remove(&mut self, key: &K);
    /// Choose and detach exactly `n` victims, or change nothing and return None.
    fn select_victims(&mut self, n: usize, now_ns: u64, evictable: &mut dyn FnMut(&K) -> bool) -> Option<Vec<K>>;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn contains(&self, key: &K) -> bool;
    fn clear(&mut self);
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    Fifo,
    Lru,
    Arc,
    Priority,
    S3Fifo,
    HitDensity,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 6] = [
        PolicyKind::Fifo,
        PolicyKind::Lru,
        PolicyKind::Arc,
        PolicyKind::Priority,
        PolicyKind::S3Fifo,
        PolicyKind::HitDensity,
    ];

    pub fn parse(name: &str) -> KvResult<Self> {
        match name.to_ascii_lowercase().replace('-', "_").as_str() {
            "fifo" => Ok(PolicyKind::Fifo),
            "lru" => Ok(PolicyKind::Lru),
            "arc" => Ok(PolicyKind::Arc),
            "priority" => Ok(PolicyKind::Priority),
            "s3fifo" | "s3_fifo" => Ok(PolicyKind::S3Fifo),
            "lhd" | "hit_density" => Ok(PolicyKind::HitDensity),
            other => Err(KvError::invalid(
                "policy",
                format!("unknown policy {other:?}; expected one of fifo, lru, arc, priority, s3fifo, lhd"),
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Fifo => "fifo",
            PolicyKind::Lru => "lru",
            PolicyKind::Arc => "arc",
            PolicyKind::Priority => "priority",
            PolicyKind::S3Fifo => "s3fifo",
            PolicyKind::HitDensity => "lhd",
        }
    }

    /// Build a policy for a tier of `capacity` blocks whose keys' dense ids are its slots
    /// (ARC and S3-FIFO size their queues from it).
    pub fn build<K: PolicyKey>(self, capacity: usize) -> Box<dyn EvictionPolicy<K>> {
        self.build_for_ids(capacity, capacity)
    }

    /// `build`, with the per-key arrays sized for dense ids below `ids` (they grow past it on
    /// demand): the planner's ids number a trace's distinct blocks, which a swept capacity
    /// may far exceed or fall far short of.
    pub fn build_for_ids<K: PolicyKey>(self, capacity: usize, ids: usize) -> Box<dyn EvictionPolicy<K>> {
        match self {
            PolicyKind::Fifo => Box::new(Lru::fifo(ids)),
            PolicyKind::Lru => Box::new(Lru::recency(ids)),
            PolicyKind::Arc => Box::new(ArcPolicy::new(capacity, ids)),
            PolicyKind::Priority => Box::new(Priority::with_ids(ids)),
            PolicyKind::S3Fifo => Box::new(S3Fifo::new(capacity, ids)),
            PolicyKind::HitDensity => Box::new(HitDensity::new(capacity, ids)),
        }
    }
}

/// Scan `keys` in order and collect the first `n` that are evictable; None if fewer exist.
/// Shared by the policies whose victim order is a plain scan of one ordered structure.
pub(crate) fn first_n_evictable<K: PolicyKey>(
    keys: impl Iterator<Item = K>,
    n: usize,
    evictable: &mut dyn FnMut(&K) -> bool,
) -> Option<Vec<K>> {
    if n == 0 {
        return Some(Vec::new());
    }
    let mut out = Vec::with_capacity(n);
    for k in keys {
        if evictable(&k) {
            out.push(k);
            if out.len() == n {
                return Some(out);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests;
