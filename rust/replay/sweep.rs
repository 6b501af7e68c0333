//! A sweep of (policy, capacity) replays over one trace, spread over worker threads. Each job
//! owns its cache and policy; the trace is shared read-only, so jobs never contend.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use super::prefix_tree::{replay_one, Mode, ReplayStats, Replayer};
use super::Trace;
use crate::admission::AdmissionRule;
use crate::error::KvResult;

pub type JobKind = Replayer;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Job {
    pub kind: JobKind,
    pub capacity: usize,
    pub admission: AdmissionRule,
}

/// Requests served so far over all jobs, for a progress bar polled from another thread.
#[derive(Debug, Default)]
pub struct Progress {
    pub done: AtomicU64,
}

/// Run every job; results come back in job order. `threads == 0` uses every core.
pub fn run_sweep(
    trace: &Trace,
    jobs: &[Job],
    mode: Mode,
    warmup: f64,
    threads: usize,
    progress: &Progress,
) -> KvResult<Vec<ReplayStats>> {
    if jobs.iter().any(|j| j.kind == Replayer::Opt) {
        // Refused before any job runs, not after the others' long replays.
        trace.check_chained_for_opt()?;
        // Built once here rather than by whichever opt job comes first.
        trace.next_use();
    }
    let threads =
        if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads }
            .min(jobs.len())
            .max(1);
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<KvResult<ReplayStats>>>> = Mutex::new(vec![None; jobs.len()]);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(job) = jobs.get(i) else { break };
                let r = replay_one(trace, job.kind, job.capacity, job.admission, mode, warmup, Some(&progress.done));
                results.lock().unwrap()[i] = Some(r);
            });
        }
    });
    results.into_inner().unwrap().into_iter().map(|r| r.expect("every job ran")).collect()
}
