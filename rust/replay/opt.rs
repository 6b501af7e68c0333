//! Belady's offline policy for the planner (`opt`): evict the evictable leaf whose next use is
//! farthest in the future, and do not admit a block whose next use is later than every
//! evictable leaf's (ties admit). Needs the whole trace, so it is planner-only.
//!
//! With chained keys a parent is used whenever its child is, so its next use is never later
//! than its child's: the farthest-next-use block always has a leaf of equal next use below it,
//! and choosing among leaves loses nothing against unconstrained Belady. Without chaining
//! (ids that do not digest their prefix) a next use can sit behind a miss and be no hit, so
//! this is not optimal there; `replay_one` refuses such a trace (`Trace::check_chained_for_opt`).

use std::collections::BTreeSet;

use super::prefix_tree::{Cache, Mode, Strategy};
use super::{Trace, NONE};

pub(crate) struct Opt<'t> {
    next_use: &'t [u32],
    /// Next use of each resident key, as of its last use.
    nu: Vec<u32>,
    /// Evictable candidates: resident leaves (tree mode) or resident keys (flat mode), except
    /// blocks placed by the request being served, which join in `request_done`.
    leaves: BTreeSet<(u32, u32)>,
}

impl<'t> Opt<'t> {
    pub(crate) fn new(trace: &'t Trace) -> Self {
        Opt { next_use: trace.next_use(), nu: vec![NONE; trace.n_keys()], leaves: BTreeSet::new() }
    }
}

impl Strategy for Opt<'_> {
    fn victim(&mut self, _cache: &Cache, stamp: u32, incoming: usize, _now_ns: u64) -> Option<u32> {
        let r = stamp - 1;
        let &(far, v) = self.leaves.last()?;
        // Every resident key outside this request is next used after it; a candidate whose
        // next use is this request means only this request's blocks are left.
        if far <= r || self.next_use[incoming] > far {
            return None;
        }
        self.leaves.remove(&(far, v));
        Some(v)
    }

    fn leaf_lost(&mut self, _cache: &Cache, k: u32) {
        self.leaves.remove(&(self.nu[k as usize], k));
    }

    fn leaf_gained(&mut self, _cache: &Cache, k: u32) {
        self.leaves.insert((self.nu[k as usize], k));
    }

    fn apply(&mut self, _cache: &Cache, _k: u32, _placed: bool, _prefix: u32, _now_ns: u64) {}

    fn request_done(&mut self, cache: &Cache, trace: &Trace, r: usize) {
        // Every resident block of the request was used now (hit, placed, or, in flat mode,
        // cached past a gap): refresh its next use and its place among the candidates.
        let start = trace.range(r).start;
        for (j, &k) in trace.request(r).iter().enumerate() {
            if !cache.is_resident(k) {
                continue;
            }
            let ki = k as usize;
            self.leaves.remove(&(self.nu[ki], k));
            self.nu[ki] = self.next_use[start + j];
            if cache.mode() == Mode::Flat || cache.children(k) == 0 {
                self.leaves.insert((self.nu[ki], k));
            }
        }
    }
}
