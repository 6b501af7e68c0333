//! `DiskTier`: the NVMe tier. Reads land in, and writes come from, slots of a `HostPool`; the
//! pool is kept alive (a `Py<HostPool>` held by each job) until the job's result is taken.
//! Every call that touches the disk or walks keys releases the GIL; only `wait`, `wait_idle`
//! and `close` block on I/O, and only because they are asked to.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::convert::{self, keys_from_py, keys_to_py};
use super::errors::{contain, invalid};
use super::host_pool::HostPool;
use super::index::positive;
use crate::admission::AdmissionRule;
use crate::disk::io::{choose, uring, EngineChoice};
use crate::disk::slab::DirectMode;
use crate::disk::{self, DiskConfig, HostMemory, JobKind, JobResult};
use crate::policy::PolicyKind;

/// A host pool seen by the core as `HostMemory`; holding it keeps the pool's memory alive.
struct PoolRef(Py<HostPool>);

impl HostMemory for PoolRef {
    fn base_ptr(&self) -> *mut u8 {
        self.0.get().region().as_ptr()
    }
    fn slot_bytes(&self) -> usize {
        self.0.get().region().slot_bytes()
    }
    fn num_slots(&self) -> usize {
        self.0.get().region().num_slots()
    }
}

fn slots_from_py(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let raw: Vec<i64> = obj.extract().map_err(|_| invalid("slots", "expected a sequence of int slot numbers"))?;
    raw.into_iter()
        .map(|s| u32::try_from(s).map_err(|_| invalid("slots", format!("slot {s} is not a valid slot number"))))
        .collect()
}

fn seconds(arg: &'static str, v: Option<f64>) -> PyResult<Option<Duration>> {
    v.map(|s| convert::seconds(arg, s)).transpose()
}

/// Result of one disk job.
#[pyclass(frozen, module = "kvtier_rs._core", get_all)]
pub struct DiskJobResult {
    pub job_id: u64,
    /// "read" or "write".
    pub kind: &'static str,
    /// True when every key of the job succeeded.
    pub success: bool,
    /// Keys written, or read and verified (their host slots hold the block).
    pub ok_keys: Py<PyList>,
    /// Keys that failed: misses, checksum or key mismatches, I/O errors, a full device.
    pub failed_keys: Py<PyList>,
    /// Payload bytes moved for the ok keys.
    pub bytes: u64,
    /// Seconds from submission to the last completion.
    pub seconds: f64,
}

#[pymethods]
impl DiskJobResult {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "DiskJobResult(job_id={}, kind={:?}, ok={}, failed={}, bytes={}, seconds={:.6})",
            self.job_id,
            self.kind,
            self.ok_keys.bind(py).len(),
            self.failed_keys.bind(py).len(),
            self.bytes,
            self.seconds
        )
    }
}

/// How long a blocking wait runs with the GIL released before it looks for a signal.
const SIGNAL_CHECK_EVERY: Duration = Duration::from_millis(50);

/// Wait with `step` (which waits at most the slice it is given and answers Some when done) in
/// slices of SIGNAL_CHECK_EVERY with the GIL released, checking for signals in between: a wait
/// that held the GIL released for its whole length could not be interrupted by Ctrl-C (Python
/// runs signal handlers only between bytecodes, on the main thread). None at the deadline.
fn interruptible_wait<R>(
    py: Python<'_>,
    timeout: Option<Duration>,
    mut step: impl FnMut(Duration) -> PyResult<Option<R>> + Send,
) -> PyResult<Option<R>>
where
    R: Send,
{
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        let slice = deadline
            .map_or(SIGNAL_CHECK_EVERY, |d| d.saturating_duration_since(Instant::now()).min(SIGNAL_CHECK_EVERY));
        if let Some(r) = py.detach(|| step(slice))? {
            return Ok(Some(r));
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(None);
        }
        py.check_signals()?;
    }
}

fn result_to_py(py: Python<'_>, r: JobResult) -> PyResult<DiskJobResult> {
    let success = r.success();
    let out = DiskJobResult {
        job_id: r.id,
        kind: match r.kind {
            JobKind::Read => "read",
            JobKind::Write => "write",
        },
        success,
        ok_keys: keys_to_py(py, r.ok_keys)?.unbind(),
        failed_keys: keys_to_py(py, r.failed_keys)?.unbind(),
        bytes: r.bytes,
        seconds: r.seconds,
    };
    // The pool reference (r.keepalive) is dropped here, with the GIL held.
    drop(r.keepalive);
    Ok(out)
}

/// What `submit_write` did with each key.
#[pyclass(frozen, module = "kvtier_rs._core", get_all)]
pub struct DiskWriteTicket {
    pub job_id: u64,
    /// Keys the job writes.
    pub keys: Py<PyList>,
    /// Already on disk or being written.
    pub skipped: Py<PyList>,
    /// Turned away by admission, or because the device is full.
    pub refused: Py<PyList>,
    /// Evicted from the disk tier to make room.
    pub evicted: Py<PyList>,
}

#[pymethods]
impl DiskWriteTicket {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "DiskWriteTicket(job_id={}, keys={}, skipped={}, refused={}, evicted={})",
            self.job_id,
            self.keys.bind(py).len(),
            self.skipped.bind(py).len(),
            self.refused.bind(py).len(),
            self.evicted.bind(py).len()
        )
    }
}

#[pyclass(frozen, module = "kvtier_rs._core", name = "DiskTier")]
pub struct PyDiskTier {
    inner: disk::DiskTier,
    policy: &'static str,
    admission: String,
}

impl PyDiskTier {
    /// `errors::contain` for the tier's index: a panic in `f` disables the index (the tier then
    /// misses and refuses writes) and raises IndexFailedError.
    fn contain<T>(&self, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
        contain(self.inner.index(), f)
    }
}

#[pymethods]
impl PyDiskTier {
    /// Open (or create) a disk tier in directory `path`: `capacity_bytes` of slab files holding
    /// blocks of `block_bytes`. Reopening a directory recovers its blocks; the geometry must
    /// match the one it was created with.
    #[new]
    #[pyo3(signature = (path, capacity_bytes, block_bytes, *, num_files=0, policy="lru", admission="always",
                        engine="auto", queue_depth=16, direct="auto", verify_on_open=false, full_retry_s=10.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: std::path::PathBuf,
        capacity_bytes: i64,
        block_bytes: i64,
        num_files: i64,
        policy: &str,
        admission: &str,
        engine: &str,
        queue_depth: i64,
        direct: &str,
        verify_on_open: bool,
        full_retry_s: f64,
    ) -> PyResult<Self> {
        let mut cfg = DiskConfig::new(
            path,
            positive("capacity_bytes", capacity_bytes)? as u64,
            positive("block_bytes", block_bytes)?,
        );
        if num_files < 0 {
            return Err(invalid("num_files", format!("must be 0 (automatic) or positive, got {num_files}")));
        }
        cfg.num_files = num_files as usize;
        cfg.policy = PolicyKind::parse(policy)?;
        cfg.admission = AdmissionRule::parse(admission)?;
        cfg.engine = EngineChoice::parse(engine)?;
        cfg.queue_depth = positive("queue_depth", queue_depth)?;
        cfg.direct = DirectMode::parse(direct)?;
        cfg.verify_on_open = verify_on_open;
        cfg.full_retry = seconds("full_retry_s", Some(full_retry_s))?.expect("given");
        let policy_name = cfg.policy.name();
        let admission_name = cfg.admission.describe();
        let inner = py.detach(|| disk::DiskTier::open(cfg))?;
        Ok(PyDiskTier { inner, policy: policy_name, admission: admission_name })
    }

    #[getter]
    fn path(&self) -> std::path::PathBuf {
        self.inner.dir().to_path_buf()
    }
    /// "io_uring" or "pool".
    #[getter]
    fn engine(&self) -> &'static str {
        self.inner.engine_name()
    }
    #[getter]
    fn queue_depth(&self) -> usize {
        self.inner.queue_depth()
    }
    /// "direct" (O_DIRECT on every slab) or "buffered" (the filesystem refused O_DIRECT).
    #[getter]
    fn io_mode(&self) -> &'static str {
        self.inner.io_mode()
    }
    #[getter]
    fn preallocated(&self) -> bool {
        self.inner.preallocated()
    }
    /// What `engine="auto"` measured and chose at open (see `probe_dict`); None for an engine
    /// named outright, or where io_uring is refused.
    #[getter]
    fn engine_probe<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        self.inner.engine_probe().map(|(rec, cached)| probe_dict(py, rec, Some(*cached))).transpose()
    }
    /// Fallbacks taken at open, in words (buffered I/O, sparse files, io_uring refused), and
    /// the engine `auto` chose with its figures.
    #[getter]
    fn notes(&self) -> Vec<String> {
        self.inner.notes().to_vec()
    }
    #[getter]
    fn block_bytes(&self) -> usize {
        self.inner.geometry().block_bytes
    }
    /// Bytes one block takes on disk (payload rounded to 4 KiB plus a 4 KiB header).
    #[getter]
    fn slot_stride(&self) -> usize {
        self.inner.geometry().slot_stride
    }
    #[getter]
    fn capacity_blocks(&self) -> usize {
        self.inner.capacity_blocks()
    }
    #[getter]
    fn num_files(&self) -> usize {
        self.inner.geometry().num_files
    }
    #[getter]
    fn policy(&self) -> &'static str {
        self.policy
    }
    #[getter]
    fn admission(&self) -> &str {
        &self.admission
    }
    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }
    /// True while writes are refused after the device reported it is full.
    #[getter]
    fn disk_full(&self) -> bool {
        self.inner.is_full()
    }
    fn __len__(&self) -> usize {
        self.inner.len()
    }
    fn __repr__(&self) -> String {
        format!(
            "DiskTier(path={:?}, capacity_blocks={}, block_bytes={}, engine={:?}, io_mode={:?}, resident={})",
            self.inner.dir().display().to_string(),
            self.inner.capacity_blocks(),
            self.inner.geometry().block_bytes,
            self.inner.engine_name(),
            self.inner.io_mode(),
            self.inner.len()
        )
    }
    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }
    fn __exit__(
        &self,
        py: Python<'_>,
        _t: &Bound<'_, PyAny>,
        _v: &Bound<'_, PyAny>,
        _tb: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    /// Queue writes of `keys` from `pool` slots `slots` (same order). Keys already on disk are
    /// skipped; keys the admission rule refuses (or all, while the device is full) are
    /// refused. Returns at once; the host slots must stay unchanged until the job is done.
    #[pyo3(signature = (keys, pool, slots, *, priority=35, duration_s=None))]
    fn submit_write(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        pool: &Bound<'_, HostPool>,
        slots: &Bound<'_, PyAny>,
        priority: i64,
        duration_s: Option<f64>,
    ) -> PyResult<DiskWriteTicket> {
        let keys = keys_from_py(keys)?;
        let slots = slots_from_py(slots)?;
        let hint = convert::insert_hint(priority, duration_s)?;
        let host: Arc<dyn HostMemory> = Arc::new(PoolRef(pool.clone().unbind()));
        let t = self.contain(|| Ok(py.detach(|| self.inner.submit_write(&keys, &slots, host, hint))?))?;
        Ok(DiskWriteTicket {
            job_id: t.job_id,
            keys: keys_to_py(py, t.keys)?.unbind(),
            skipped: keys_to_py(py, t.skipped)?.unbind(),
            refused: keys_to_py(py, t.refused)?.unbind(),
            evicted: keys_to_py(py, t.evicted)?.unbind(),
        })
    }

    /// Queue reads of `keys` into `pool` slots `slots` (same order). Missing keys fail at
    /// once; the rest are verified before they are reported ok. Returns the job id; the host
    /// slots must not be used until the job is done.
    fn submit_read(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        pool: &Bound<'_, HostPool>,
        slots: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let keys = keys_from_py(keys)?;
        let slots = slots_from_py(slots)?;
        let host: Arc<dyn HostMemory> = Arc::new(PoolRef(pool.clone().unbind()));
        self.contain(|| Ok(py.detach(|| self.inner.submit_read(&keys, &slots, host))?))
    }

    /// Results of every job finished since the last call (each returned once). Never blocks.
    fn poll(&self, py: Python<'_>) -> PyResult<Vec<DiskJobResult>> {
        let done = self.contain(|| Ok(py.detach(|| self.inner.poll())))?;
        done.into_iter().map(|r| result_to_py(py, r)).collect()
    }

    /// The result of `job_id` if it finished, else None. Never blocks.
    fn try_take(&self, py: Python<'_>, job_id: u64) -> PyResult<Option<DiskJobResult>> {
        match self.contain(|| Ok(self.inner.try_take(job_id)?))? {
            Some(r) => Ok(Some(result_to_py(py, r)?)),
            None => Ok(None),
        }
    }

    /// Wait for `job_id` (at most `timeout` seconds; None = no limit) and return its result,
    /// or None on timeout. The GIL is released while waiting; a signal (Ctrl-C) interrupts the
    /// wait, not the job.
    #[pyo3(signature = (job_id, timeout=None))]
    fn wait(&self, py: Python<'_>, job_id: u64, timeout: Option<f64>) -> PyResult<Option<DiskJobResult>> {
        let t = seconds("timeout", timeout)?;
        let done = self.contain(|| interruptible_wait(py, t, |slice| Ok(self.inner.wait(job_id, Some(slice))?)))?;
        match done {
            Some(r) => Ok(Some(result_to_py(py, r)?)),
            None => Ok(None),
        }
    }

    /// Wait until no job is running; False on timeout. Results stay collectable. Interrupted
    /// by a signal (Ctrl-C) like `wait`.
    #[pyo3(signature = (timeout=None))]
    fn wait_idle(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let t = seconds("timeout", timeout)?;
        let idle =
            self.contain(|| interruptible_wait(py, t, |slice| Ok(self.inner.wait_idle(Some(slice)).then_some(()))))?;
        Ok(idle.is_some())
    }

    #[getter]
    fn running_jobs(&self) -> usize {
        self.inner.running_jobs()
    }

    /// Length of the longest prefix of `keys` on disk.
    fn lookup_prefix(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let keys = keys_from_py(keys)?;
        self.contain(|| Ok(py.detach(|| self.inner.lookup_prefix(&keys))?))
    }

    fn contains(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let keys = keys_from_py(keys)?;
        self.contain(|| Ok(py.detach(|| self.inner.contains(&keys))?))
    }

    /// Record a use of blocks on disk (eviction order).
    fn touch(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let keys = keys_from_py(keys)?;
        self.contain(|| Ok(py.detach(|| self.inner.touch(&keys))?))
    }

    /// Set the retention priority and duration of blocks on disk (or being written) as if just
    /// written with them (`BlockIndex.renew`); returns how many were renewed. Not
    /// written to disk: a reopened tier ranks a block by the hint it was written with.
    #[pyo3(signature = (keys, *, priority=35, duration_s=None))]
    fn renew(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        priority: i64,
        duration_s: Option<f64>,
    ) -> PyResult<usize> {
        let hint = convert::insert_hint(priority, duration_s)?;
        let keys = keys_from_py(keys)?;
        self.contain(|| Ok(py.detach(|| self.inner.renew(&keys, hint))?))
    }

    /// Count uses toward disk admission without writing (e.g. hits served by the CPU tier).
    fn record_use(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let keys = keys_from_py(keys)?;
        self.contain(|| Ok(py.detach(|| self.inner.record_use(&keys))?))
    }

    /// Drop ready, unread blocks; returns the keys removed.
    fn remove<'py>(&self, py: Python<'py>, keys: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
        let keys = keys_from_py(keys)?;
        let removed = self.contain(|| Ok(py.detach(|| self.inner.remove(&keys))?))?;
        keys_to_py(py, removed)
    }

    /// Forget every block, now and after a restart (a cache reset); refused while jobs run
    /// (`wait_idle` first). Returns how many blocks were dropped.
    fn clear(&self, py: Python<'_>) -> PyResult<usize> {
        self.contain(|| Ok(py.detach(|| self.inner.clear())?))
    }

    /// Counters (ints) plus `write_amplification` (bytes written per payload byte read back)
    /// and the engine and I/O mode names.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.contain(|| Ok(py.detach(|| self.inner.stats())))?;
        let d = PyDict::new(py);
        let (mut written, mut read) = (0u64, 0u64);
        for (name, v) in s {
            match name {
                "bytes_written" => written = v,
                "bytes_read" => read = v,
                _ => {}
            }
            d.set_item(name, v)?;
        }
        d.set_item("write_amplification", if read == 0 { f64::NAN } else { written as f64 / read as f64 })?;
        d.set_item("engine", self.inner.engine_name())?;
        d.set_item("io_mode", self.inner.io_mode())?;
        Ok(d)
    }

    /// Finish queued I/O, sync the files and release the directory. Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.contain(|| Ok(py.detach(|| self.inner.close())?))
    }

    /// Test hook: make the next `count` block writes ("enospc", "eio_write") or reads
    /// ("eio_read") fail at the I/O layer; None clears it. "store_panic": the next write that
    /// evicts panics inside the tier's index; "completion_panic": the next `count` writes land
    /// and their completions panic on the I/O thread (either way the index must disable itself).
    /// "enter_eagain" / "enter_eio": the io_uring engine's next `count` io_uring_enter calls
    /// fail with EAGAIN (retried) / EIO (the engine stops; every I/O then fails).
    /// "read_delay_ms:<ms>": the next `count` block reads start that late (a slow device).
    #[cfg(feature = "fault-injection")]
    #[pyo3(signature = (kind, count=1))]
    fn _inject_fault(&self, kind: Option<&str>, count: u32) -> PyResult<()> {
        let fault = match kind {
            None => None,
            Some("store_panic") => {
                self.inner.index().inject_store_panic();
                return Ok(());
            }
            Some("enospc") => Some(disk::Fault::WriteErrno(libc::ENOSPC)),
            Some("eio_write") => Some(disk::Fault::WriteErrno(libc::EIO)),
            Some("eio_read") => Some(disk::Fault::ReadErrno(libc::EIO)),
            Some("completion_panic") => Some(disk::Fault::CompletionPanic),
            Some("enter_eagain") => Some(disk::Fault::EnterErrno(libc::EAGAIN)),
            Some("enter_eio") => Some(disk::Fault::EnterErrno(libc::EIO)),
            Some(other) => match other.strip_prefix("read_delay_ms:").map(str::parse::<u32>) {
                Some(Ok(ms)) => Some(disk::Fault::ReadDelayMs(ms)),
                _ => {
                    return Err(invalid(
                        "kind",
                        format!(
                            "{other:?}: expected \"enospc\", \"eio_write\", \"eio_read\", \"read_delay_ms:<ms>\", \
                             \"store_panic\", \"completion_panic\", \"enter_eagain\" or \"enter_eio\""
                        ),
                    ))
                }
            },
        };
        Ok(self.inner.inject_fault(fault, count)?)
    }
}

/// Test hook: let the next `after` threads the disk tier starts from the calling thread (engine
/// and recovery threads, all started by `DiskTier(...)`) succeed and refuse the one after them
/// with EAGAIN, as the OS does under a pids limit; None disarms it.
#[cfg(feature = "fault-injection")]
#[pyfunction]
pub fn _inject_spawn_failure(after: Option<u32>) {
    disk::spawn::inject_spawn_failure(after);
}

/// None when io_uring works in this process, else the reason (seccomp, gVisor, sysctl).
#[pyfunction]
pub fn io_uring_probe(py: Python<'_>) -> Option<String> {
    py.detach(|| uring::probe().err())
}

/// Read-only snapshot of a disk-tier directory (see `disk::status`): takes no lock, creates and
/// changes nothing, so it works while another process has the tier open.
#[pyfunction]
#[pyo3(signature = (path, *, verify=false))]
pub fn disk_status<'py>(py: Python<'py>, path: std::path::PathBuf, verify: bool) -> PyResult<Bound<'py, PyDict>> {
    if path.as_os_str().is_empty() {
        return Err(invalid("path", "must not be empty"));
    }
    let s = py.detach(|| disk::status::disk_status(&path, verify))?;
    let d = PyDict::new(py);
    d.set_item("path", path.display().to_string())?;
    for (name, v) in s.fields() {
        d.set_item(name, v)?;
    }
    d.set_item("verified_payloads", s.verified_payloads)?;
    let kept = py.detach(|| disk::tierdir::TierDir::open(&path).ok().and_then(|dir| choose::load(&dir)));
    d.set_item("engine_probe", kept.map(|rec| probe_dict(py, &rec, None)).transpose()?)?;
    Ok(d)
}

/// An engine probe's record as a dict: chosen, block_bytes, queue_depth, kernel, measured_unix,
/// and io_uring / pool as {"write_mib_s", "read_mib_s"}; with "cached" when known.
fn probe_dict<'py>(py: Python<'py>, rec: &choose::ProbeRecord, cached: Option<bool>) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("chosen", choose::engine_name(rec.chosen))?;
    d.set_item("block_bytes", rec.block_bytes)?;
    d.set_item("queue_depth", rec.queue_depth)?;
    d.set_item("kernel", &rec.kernel)?;
    d.set_item("measured_unix", rec.measured_unix)?;
    for (name, f) in [("io_uring", rec.io_uring), ("pool", rec.pool)] {
        let e = PyDict::new(py);
        e.set_item("write_mib_s", f.write_bps / (1u64 << 20) as f64)?;
        e.set_item("read_mib_s", f.read_bps / (1u64 << 20) as f64)?;
        d.set_item(name, e)?;
    }
    if let Some(c) = cached {
        d.set_item("cached", c)?;
    }
    Ok(d)
}
