//! Planner replay: a trace object, a parallel (policy, capacity) sweep and a multi-tier replay.
//! Every replay runs with the GIL released; results come back as plain dicts of counts.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::errors::invalid;
use crate::admission::AdmissionRule;
use crate::policy::PolicyKind;
use crate::replay::{self, Job, Mode, Progress, ReplayStats, Replayer, TierSpec, Trace};

fn replayer(name: &str) -> PyResult<Replayer> {
    Ok(match name.to_ascii_lowercase().as_str() {
        "opt" | "belady" => Replayer::Opt,
        "ceiling" | "inf" => Replayer::Ceiling,
        other => Replayer::Policy(PolicyKind::parse(other).map_err(|_| {
            invalid(
                "policy",
                format!("unknown policy {name:?}; expected fifo, lru, arc, priority, s3fifo, lhd, opt or ceiling"),
            )
        })?),
    })
}

fn replayer_name(r: Replayer) -> &'static str {
    match r {
        Replayer::Policy(k) => k.name(),
        Replayer::Opt => "opt",
        Replayer::Ceiling => "ceiling",
    }
}

/// A request trace with its keys remapped to dense ids, shared read-only by replays.
#[pyclass(frozen, module = "kvtier_rs._core")]
pub struct ReplayTrace {
    inner: Arc<Trace>,
}

#[pymethods]
impl ReplayTrace {
    /// `offsets`: requests + 1 cumulative block counts; `keys`: every request's block ids
    /// (unsigned 64-bit) concatenated; `input_tokens` and `timestamps_s`: one per request, the
    /// timestamps in trace order (never decreasing).
    #[new]
    fn new(
        py: Python<'_>,
        offsets: Vec<u64>,
        keys: Vec<u64>,
        input_tokens: Vec<u64>,
        timestamps_s: Vec<f64>,
        block_size: u32,
    ) -> PyResult<Self> {
        let t = py.detach(|| Trace::new(block_size, offsets, keys, input_tokens, timestamps_s))?;
        Ok(ReplayTrace { inner: Arc::new(t) })
    }
    #[getter]
    fn block_size(&self) -> u32 {
        self.inner.block_size()
    }
    #[getter]
    fn n_requests(&self) -> usize {
        self.inner.n_requests()
    }
    #[getter]
    fn n_refs(&self) -> usize {
        self.inner.n_refs()
    }
    #[getter]
    fn n_keys(&self) -> usize {
        self.inner.n_keys()
    }
    #[getter]
    fn total_tokens(&self) -> u64 {
        self.inner.total_tokens()
    }
    /// Every block id always follows the same block id (ids that digest their whole prefix):
    /// only on such a trace is `opt` a bound, and a sweep with `opt` refuses any other.
    #[getter]
    fn prefix_chained(&self) -> bool {
        self.inner.prefix_chained()
    }
    fn __repr__(&self) -> String {
        format!(
            "ReplayTrace(requests={}, refs={}, keys={}, block_size={})",
            self.inner.n_requests(),
            self.inner.n_refs(),
            self.inner.n_keys(),
            self.inner.block_size()
        )
    }

    /// Reuse times and distances, one-hit counts and the top `top` maximal shared prefixes.
    #[pyo3(signature = (top=10))]
    fn analyze<'py>(&self, py: Python<'py>, top: usize) -> PyResult<Bound<'py, PyDict>> {
        let a = py.detach(|| replay::analyze(&self.inner, top));
        let d = PyDict::new(py);
        d.set_item("one_hit_keys", a.one_hit_keys)?;
        d.set_item("one_hit_refs", a.one_hit_refs)?;
        d.set_item("one_hit_tokens", a.one_hit_tokens)?;
        d.set_item("shared_tokens", a.shared_tokens)?;
        d.set_item("block_tokens", a.block_tokens)?;
        d.set_item("reuse_time_s", a.reuse_time_s)?;
        d.set_item("reuse_distance", a.reuse_distance)?;
        let tops = PyList::empty(py);
        for p in &a.top_prefixes {
            let e = PyDict::new(py);
            e.set_item("last_key", p.last_key)?;
            e.set_item("blocks", p.blocks)?;
            e.set_item("tokens", p.tokens)?;
            e.set_item("requests", p.requests)?;
            e.set_item("first_request", p.first_request)?;
            tops.append(e)?;
        }
        d.set_item("top_prefixes", tops)?;
        Ok(d)
    }
}

/// Requests served so far by a running sweep (read it from another thread for a progress bar).
#[pyclass(frozen, module = "kvtier_rs._core")]
pub struct ReplayProgress {
    inner: Arc<Progress>,
}

#[pymethods]
impl ReplayProgress {
    #[new]
    fn new() -> Self {
        ReplayProgress { inner: Arc::new(Progress::default()) }
    }
    #[getter]
    fn done(&self) -> u64 {
        self.inner.done.load(Ordering::Relaxed)
    }
}

fn mode(name: &str) -> PyResult<Mode> {
    Ok(Mode::parse(name)?)
}

fn stats_dict<'py>(py: Python<'py>, s: &ReplayStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("hit_tokens", s.hit_tokens)?;
    d.set_item("total_tokens", s.total_tokens)?;
    d.set_item("hit_blocks", s.hit_blocks)?;
    d.set_item("total_blocks", s.total_blocks)?;
    d.set_item("measured_requests", s.measured_requests)?;
    d.set_item("all_hit_blocks", s.all_hit_blocks)?;
    d.set_item("insertions", s.insertions)?;
    d.set_item("evictions", s.evictions)?;
    d.set_item("peak_resident", s.peak_resident)?;
    d.set_item("underfilled", s.underfilled)?;
    d.set_item("filled_at_request", s.filled_at_request)?;
    d.set_item("hit_histogram", &s.hit_histogram)?;
    Ok(d)
}

/// Replay every `(policy, capacity_blocks, admission)` job over `trace`, in parallel over
/// `threads` workers (0: every core). Policies: fifo, lru, arc, priority, s3fifo, lhd,
/// opt, ceiling.
#[pyfunction]
#[pyo3(signature = (trace, jobs, *, warmup=0.5, mode="tree", threads=0, progress=None))]
pub fn replay_sweep<'py>(
    py: Python<'py>,
    trace: &Bound<'py, ReplayTrace>,
    jobs: Vec<(String, i64, String)>,
    warmup: f64,
    mode: &str,
    threads: usize,
    progress: Option<&Bound<'py, ReplayProgress>>,
) -> PyResult<Bound<'py, PyList>> {
    let m = self::mode(mode)?;
    let mut parsed = Vec::with_capacity(jobs.len());
    for (policy, cap, adm) in &jobs {
        let kind = replayer(policy)?;
        if *cap <= 0 && kind != Replayer::Ceiling {
            return Err(invalid("capacity", format!("must be a positive number of blocks, got {cap}")));
        }
        parsed.push(Job { kind, capacity: (*cap).max(0) as usize, admission: AdmissionRule::parse(adm)? });
    }
    let t = trace.get().inner.clone();
    let p = progress.map(|p| p.get().inner.clone()).unwrap_or_default();
    let out = py.detach(|| replay::run_sweep(&t, &parsed, m, warmup, threads, &p))?;
    let list = PyList::empty(py);
    for (job, s) in parsed.iter().zip(&out) {
        let d = stats_dict(py, s)?;
        d.set_item("policy", replayer_name(job.kind))?;
        d.set_item("capacity_blocks", if job.kind == Replayer::Ceiling { None } else { Some(job.capacity) })?;
        d.set_item("admission", job.admission.describe())?;
        list.append(d)?;
    }
    Ok(list)
}

/// Replay `trace` through inclusive, write-through tiers given fastest first as
/// `(name, capacity_blocks, policy, admission)`. `replicas`: the replica serving each request
/// (None: one replica); the tiers named in `shared` (None: none) are one cache for all replicas,
/// the others one per replica.
#[pyfunction]
#[pyo3(signature = (trace, tiers, *, warmup=0.5, mode="tree", replicas=None, shared=None))]
pub fn replay_tiers<'py>(
    py: Python<'py>,
    trace: &Bound<'py, ReplayTrace>,
    tiers: Vec<(String, i64, String, String)>,
    warmup: f64,
    mode: &str,
    replicas: Option<Vec<u32>>,
    shared: Option<Vec<String>>,
) -> PyResult<Bound<'py, PyDict>> {
    let m = self::mode(mode)?;
    let shared = shared.unwrap_or_default();
    if let Some(name) = shared.iter().find(|s| !tiers.iter().any(|t| &t.0 == *s)) {
        return Err(invalid("shared", format!("{name:?} names no tier")));
    }
    let mut specs = Vec::with_capacity(tiers.len());
    for (name, cap, policy, adm) in tiers {
        if cap <= 0 {
            return Err(invalid("capacity", format!("tier {name:?} needs a positive number of blocks, got {cap}")));
        }
        specs.push(TierSpec {
            shared: shared.contains(&name),
            name,
            capacity: cap as usize,
            policy: PolicyKind::parse(&policy)?,
            admission: AdmissionRule::parse(&adm)?,
        });
    }
    let t = trace.get().inner.clone();
    let replica_of = replicas.unwrap_or_default();
    let r = py.detach(|| replay::replay_replicas(&t, &specs, &replica_of, m, warmup))?;
    let d = PyDict::new(py);
    let list = PyList::empty(py);
    for (spec, tr) in specs.iter().zip(&r.tiers) {
        let e = PyDict::new(py);
        e.set_item("name", &tr.name)?;
        e.set_item("capacity_blocks", spec.capacity)?;
        e.set_item("policy", spec.policy.name())?;
        e.set_item("admission", spec.admission.describe())?;
        e.set_item("served_tokens", tr.served_tokens)?;
        e.set_item("served_blocks", tr.served_blocks)?;
        e.set_item("insertions", tr.insertions)?;
        e.set_item("evictions", tr.evictions)?;
        e.set_item("underfilled", tr.underfilled)?;
        e.set_item("filled_at_request", tr.filled_at_request)?;
        list.append(e)?;
    }
    d.set_item("tiers", list)?;
    d.set_item("miss_tokens", r.miss_tokens)?;
    d.set_item("miss_blocks", r.miss_blocks)?;
    d.set_item("total_tokens", r.total_tokens)?;
    d.set_item("total_blocks", r.total_blocks)?;
    d.set_item("measured_requests", r.measured_requests)?;
    d.set_item("served_histogram", &r.served_histogram)?;
    Ok(d)
}
