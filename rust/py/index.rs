//! `BlockIndex`: one tier's index. Batch methods take a sequence of keys and make one call
//! into the core with the GIL released; `*_one` methods are the single-key forms of the same
//! core operation (a one-element batch, so both share one implementation).

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::convert::{
    self, as_list, exact_bytes_keys, insert_hint, key_from_py, key_to_py, keys_from_py, keys_to_py, probe_from_py,
};
use super::errors::{contain, invalid};
use super::host_pool::HostPool;
use crate::admission::{AdmissionRule, Admit};
use crate::index::{check_capacity, BlockState, IndexConfig, TierIndex};
use crate::keys::{BlockKey, ChainKey};
use crate::policy::{InsertHint, PolicyKind};

/// (key, state, pins, slot) as `entries()` returns them.
type EntryRow<'py> = (Bound<'py, PyAny>, &'static str, u32, u32);

/// Below this many keys a lookup or store completion runs without releasing the GIL: the
/// per-key work is cheaper than releasing and re-taking it.
pub(crate) const LONG_WALK_KEYS: usize = 256;

pub(crate) fn tier_id(name: &str) -> PyResult<u8> {
    match name {
        "gpu" => Ok(0),
        "cpu" => Ok(1),
        "disk" => Ok(2),
        other => Err(invalid("tier", format!("unknown tier {other:?}; expected \"gpu\", \"cpu\" or \"disk\""))),
    }
}

pub(crate) fn positive(arg: &'static str, v: i64) -> PyResult<usize> {
    if v <= 0 {
        return Err(invalid(arg, format!("must be positive, got {v}")));
    }
    Ok(v as usize)
}

/// Outcome of `prepare_store`: which keys to write into which slots, and what happened to the rest.
#[pyclass(frozen, module = "kvtier_rs._core", get_all)]
pub struct StoreOutcome {
    /// Keys to write now, in the order given.
    pub keys: Py<PyList>,
    /// Slot for each of `keys`.
    pub slots: Vec<u32>,
    /// Keys already present (ready or being written).
    pub skipped: Py<PyList>,
    /// Keys turned away by the admission rule.
    pub refused: Py<PyList>,
    /// Keys evicted to make room.
    pub evicted: Py<PyList>,
    /// Slots the evicted keys occupied.
    pub evicted_slots: Vec<u32>,
}

#[pymethods]
impl StoreOutcome {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "StoreOutcome(keys={}, skipped={}, refused={}, evicted={})",
            self.keys.bind(py).len(),
            self.skipped.bind(py).len(),
            self.refused.bind(py).len(),
            self.evicted.bind(py).len()
        )
    }
}

#[pyclass(frozen, module = "kvtier_rs._core")]
pub struct BlockIndex {
    inner: TierIndex,
    tier_name: String,
    /// The caller's own objects for (ready, being written, absent), set once; lets an engine's
    /// per-key lookup be a single call that returns its enum value directly.
    lookup_results: std::sync::OnceLock<[Py<PyAny>; 3]>,
}

/// The per-key lookups. Python reaches them through `fast_calls`, which answers the common case
/// itself and calls these for everything else (so both paths share one definition).
impl BlockIndex {
    pub(crate) fn inner(&self) -> &TierIndex {
        &self.inner
    }

    /// `errors::contain` for this index: a panic in `f` disables it and raises IndexFailedError.
    pub(crate) fn contain<T>(&self, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
        contain(&self.inner, f)
    }

    pub(crate) fn lookup_results(&self) -> Option<&[Py<PyAny>; 3]> {
        self.lookup_results.get()
    }

    /// Which of the lookup results (ready, being written, absent) answers for `key`; counted as
    /// a one-key lookup.
    pub(crate) fn result_index(&self, key: &impl ChainKey) -> usize {
        match self.inner.lookup_state_serial(key) {
            Some(BlockState::Ready) => 0,
            Some(BlockState::Writing) => 1,
            _ => 2,
        }
    }

    pub(crate) fn lookup_one_impl(&self, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.inner.lookup_state_serial(&probe_from_py(key)?) == Some(BlockState::Ready))
    }

    pub(crate) fn lookup_result_impl(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let results =
            self.lookup_results.get().ok_or_else(|| invalid("lookup_results", "call set_lookup_results() first"))?;
        Ok(results[self.result_index(&probe_from_py(key)?)].clone_ref(py))
    }

    /// `prepare_store`'s call into the core (see `prepare_store` for the GIL and mutex rules).
    fn prepare_store_core<'py>(
        &self,
        py: Python<'py>,
        seq: &Bound<'py, PyList>,
        hint: InsertHint,
        admit: Admit,
    ) -> PyResult<(crate::index::StoreOutcome, Option<Vec<Bound<'py, PyAny>>>)> {
        // Like lookups, a short batch keeps the GIL: releasing and re-taking it costs more than
        // placing a request's chain. Its keys are borrowed from the list when they are all
        // exact bytes (the index then hashes only keys it does not find by a chained compare).
        // But it never waits for the index's mutex with the GIL held (another writer may hold
        // the mutex for long, e.g. a clear(), and every Python thread would stall meanwhile):
        // when the mutex is taken, it releases the GIL and waits, with keys of its own.
        //
        // While the GIL is released another thread may change the caller's list, so that path
        // returns a snapshot of its items, taken with the keys, and the outcome's positions
        // refer to it (the result must name exactly the keys the slots were reserved for).
        let mut owned = None;
        let quick = if seq.len() < LONG_WALK_KEYS {
            // SAFETY: attached; nothing runs Python code while the borrowed keys are used.
            match unsafe { exact_bytes_keys(seq.as_any()) } {
                Some(borrowed) => self.inner.try_prepare_store_as(&borrowed, hint, admit),
                None => self.inner.try_prepare_store_as(owned.insert(keys_from_py(seq.as_any())?), hint, admit),
            }
        } else {
            None
        };
        match quick {
            Some(out) => Ok((out?, None)),
            None => {
                // `owned`, if made, was converted from these same items: no Python code ran since.
                let items: Vec<Bound<'py, PyAny>> = seq.iter().collect();
                let core_keys = match owned {
                    Some(keys) => keys,
                    None => keys_from_py(PyList::new(py, &items)?.as_any())?,
                };
                Ok((py.detach(|| self.inner.prepare_store_as(&core_keys, hint, admit))?, Some(items)))
            }
        }
    }

    /// The Python outcome of a store: the caller's own key objects, taken by position from
    /// `snapshot` when the store released the GIL (the list may have changed meanwhile) or from
    /// `seq` itself, all of them before any Python object is allocated (an allocation can run
    /// the garbage collector, and with it arbitrary code that might change the list).
    fn store_outcome(
        &self,
        py: Python<'_>,
        seq: &Bound<'_, PyList>,
        snapshot: Option<Vec<Bound<'_, PyAny>>>,
        out: crate::index::StoreOutcome,
    ) -> PyResult<StoreOutcome> {
        let item = |p: usize| match &snapshot {
            Some(items) => Ok(items[p].clone()),
            None => seq.get_item(p),
        };
        let take = |pos: &[usize]| pos.iter().map(|&p| item(p)).collect::<PyResult<Vec<_>>>();
        let (written, skipped, refused) =
            (take(&out.to_write_pos)?, take(&out.already_present_pos)?, take(&out.refused_pos)?);
        let (ev_keys, ev_slots): (Vec<BlockKey>, Vec<u32>) = out.evicted.into_iter().unzip();
        Ok(StoreOutcome {
            keys: PyList::new(py, written)?.unbind(),
            slots: out.to_write.iter().map(|(_, s)| *s).collect(),
            skipped: PyList::new(py, skipped)?.unbind(),
            refused: PyList::new(py, refused)?.unbind(),
            evicted: keys_to_py(py, ev_keys)?.unbind(),
            evicted_slots: ev_slots,
        })
    }

    /// `complete_store`'s call into the core.
    fn complete_store_core(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, success: bool) -> PyResult<usize> {
        // A successful completion is lock-free: a short list of it is walked with the GIL held,
        // its items borrowed (they stay alive since no Python code runs meanwhile) and hashed only
        // where a chained compare misses.
        if success {
            // SAFETY: attached; nothing below runs Python code while the probes are used.
            if let Some(borrowed) = unsafe { exact_bytes_keys(keys) }.filter(|k| k.len() < LONG_WALK_KEYS) {
                return Ok(self.inner.complete_store(&borrowed, true));
            }
        }
        // Otherwise (a failure, which takes the index's mutex; other key types; invalid keys,
        // whose errors come from `probe_from_py`) probes borrow each bytes key in place and
        // `items` keeps the (immutable) objects alive, also while the GIL is released.
        let items: Vec<Bound<'_, PyAny>> = as_list(keys)?.iter().collect();
        let mut probes = Vec::with_capacity(items.len());
        for item in &items {
            probes.push(probe_from_py(item)?);
        }
        if success && probes.len() < LONG_WALK_KEYS {
            return Ok(self.inner.complete_store(&probes, true));
        }
        Ok(py.detach(|| self.inner.complete_store(&probes, success)))
    }

    /// Length of the longest prefix of `keys` whose blocks are ready.
    ///
    /// Keys after the first miss are neither looked up nor checked, whatever holds them (a list,
    /// a tuple, any iterable, short or long): the walk stops there, as the fast path does.
    /// Counted as serial lookups (`TierIndex::record_lookup_serial`): the count is always made
    /// with the GIL held, which serializes every caller of the serial counters.
    ///
    /// Short batches are walked with the GIL held, converting keys as they go: the per-key work
    /// is one lock-free map read, cheaper than releasing and re-taking the GIL. Batches of
    /// LONG_WALK_KEYS or more are converted first, up to the first invalid key, and walked with
    /// the GIL released; that key's error is raised only if the walk reaches it.
    pub(crate) fn lookup_prefix_impl(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let list = as_list(keys)?;
        if list.len() < LONG_WALK_KEYS {
            let keys = list.iter().map(|item| probe_from_py(&item).map(|p| p.to_key()));
            let n = self.inner.reader().ready_prefix(keys)?;
            self.inner.record_lookup_serial((n + 1).min(list.len()), n);
            return Ok(n);
        }
        let mut owned = Vec::with_capacity(list.len());
        let mut invalid_key = None;
        for item in list.iter() {
            match probe_from_py(&item) {
                Ok(p) => owned.push(p.to_key()),
                Err(e) => {
                    invalid_key = Some(e);
                    break;
                }
            }
        }
        // The walk releases the GIL, and another thread may change the list meanwhile: count
        // against the keys it walked, not the list as it is afterwards.
        let total = owned.len() + usize::from(invalid_key.is_some());
        let Ok(n) = py.detach(|| self.inner.reader().ready_prefix(owned.iter().map(Ok::<_, std::convert::Infallible>)));
        if n == owned.len() {
            if let Some(e) = invalid_key {
                return Err(e);
            }
        }
        self.inner.record_lookup_serial((n + 1).min(total), n);
        Ok(n)
    }
}

#[pymethods]
impl BlockIndex {
    /// A tier index of `capacity` blocks, or over the slots of `pool` (capacity = its slots).
    #[new]
    #[pyo3(signature = (capacity=None, *, policy="lru", admission="always", tier="cpu", pool=None, manual_clock=false, block_bytes=0))]
    fn new(
        capacity: Option<i64>,
        policy: &str,
        admission: &str,
        tier: &str,
        pool: Option<&Bound<'_, HostPool>>,
        manual_clock: bool,
        block_bytes: i64,
    ) -> PyResult<Self> {
        let policy = PolicyKind::parse(policy)?;
        let admission = AdmissionRule::parse(admission)?;
        let tier_num = tier_id(tier)?;
        if block_bytes < 0 {
            return Err(invalid("block_bytes", format!("must not be negative, got {block_bytes}")));
        }
        let base = |capacity: usize| IndexConfig {
            capacity,
            policy,
            admission,
            tier: tier_num,
            manual_clock,
            block_bytes: block_bytes as u64,
        };
        let inner = match (capacity, pool) {
            (_, Some(pool)) => {
                let pool = pool.get();
                let num_slots = pool.region().num_slots();
                if let Some(c) = capacity.filter(|&c| c as usize != num_slots) {
                    return Err(invalid("capacity", format!("{c} does not match the pool's {num_slots} slots")));
                }
                check_capacity(num_slots)?;
                // Claimed only once nothing else can fail: a refused index leaves the pool free.
                let slots = pool.claim_slots()?;
                let bytes = if block_bytes == 0 { pool.region().slot_bytes() as u64 } else { block_bytes as u64 };
                TierIndex::with_slots(IndexConfig { block_bytes: bytes, ..base(num_slots) }, slots)?
            }
            (Some(c), None) => TierIndex::new(base(positive("capacity", c)?))?,
            (None, None) => return Err(invalid("capacity", "give a capacity in blocks or a pool")),
        };
        Ok(BlockIndex { inner, tier_name: tier.to_string(), lookup_results: std::sync::OnceLock::new() })
    }

    #[getter]
    fn capacity(&self) -> usize {
        self.inner.capacity()
    }
    #[getter]
    fn policy(&self) -> &'static str {
        self.inner.config().policy.name()
    }
    #[getter]
    fn admission(&self) -> String {
        self.inner.config().admission.describe()
    }
    #[getter]
    fn tier(&self) -> &str {
        &self.tier_name
    }
    fn __len__(&self) -> usize {
        self.inner.len()
    }
    /// Why the index was disabled (an internal error: it then misses and refuses stores), or None.
    #[getter]
    fn failure(&self) -> Option<&str> {
        self.inner.failure()
    }
    fn __repr__(&self) -> String {
        format!(
            "BlockIndex(tier={:?}, capacity={}, policy={:?}, admission={:?}, resident={})",
            self.tier_name,
            self.inner.capacity(),
            self.policy(),
            self.admission(),
            self.inner.len()
        )
    }

    /// Whether each key is ready (no prefix semantics).
    fn contains(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let keys = keys_from_py(keys)?;
        self.contain(|| Ok(py.detach(|| self.inner.contains_ready(&keys))))
    }

    /// Reserve slots for the new blocks among `keys` (a request's chain, head first), evicting
    /// if needed. All-or-nothing: raises NoSpaceError and changes nothing when it cannot fit.
    /// `admitted`: the blocks are being staged up from a lower tier that admitted them already
    /// (a promotion), so this tier's admission rule is not asked.
    #[pyo3(signature = (keys, *, priority=35, duration_s=None, admitted=false))]
    fn prepare_store(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        priority: i64,
        duration_s: Option<f64>,
        admitted: bool,
    ) -> PyResult<StoreOutcome> {
        let hint = insert_hint(priority, duration_s)?;
        let admit = if admitted { Admit::Already } else { Admit::ByRule };
        // Hand back the caller's own key objects (by position) rather than new ones.
        let seq = as_list(keys)?;
        let (out, snapshot) = self.contain(|| self.prepare_store_core(py, &seq, hint, admit))?;
        let to_write: Vec<BlockKey> = out.to_write.iter().map(|(k, _)| *k).collect();
        let result = self.store_outcome(py, &seq, snapshot, out);
        if result.is_err() {
            // The caller never learns of the reservation: give it back rather than leave its
            // blocks being written (unevictable) for good.
            self.inner.complete_store(&to_write, false);
        }
        result
    }

    /// Finish stores; failure drops the blocks and frees their slots. Returns how many changed.
    #[pyo3(signature = (keys, success=true))]
    fn complete_store(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, success: bool) -> PyResult<usize> {
        self.contain(|| self.complete_store_core(py, keys, success))
    }

    /// Pin all keys for a load and return their slots; all-or-nothing (NotReadyError).
    fn pin_for_load(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let keys = keys_from_py(keys)?;
        self.contain(|| Ok(py.detach(|| self.inner.pin_for_load(&keys))?))
    }

    fn unpin(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let keys = keys_from_py(keys)?;
        self.contain(|| Ok(py.detach(|| self.inner.unpin(&keys))?))
    }

    /// Record a use of each resident key (applied tail-first: the head stays the most recent).
    fn touch(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let keys = keys_from_py(keys)?;
        self.contain(|| {
            py.detach(|| self.inner.touch(&keys));
            Ok(())
        })
    }

    /// Rank each resident key as the most recent of its list or level without counting a use
    /// (applied tail-first, like `touch`): prefix order for blocks a request only stored.
    fn refresh(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let keys = keys_from_py(keys)?;
        self.contain(|| {
            py.detach(|| self.inner.refresh(&keys));
            Ok(())
        })
    }

    /// Set the retention priority and duration of the present keys (ready or being written;
    /// absent keys are ignored) as if they had just been stored with them: a later claim
    /// overrides an earlier one. Only the priority policy's order reads them; a renewal is not a
    /// use. Returns how many keys were renewed.
    #[pyo3(signature = (keys, *, priority=35, duration_s=None))]
    fn renew(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        priority: i64,
        duration_s: Option<f64>,
    ) -> PyResult<usize> {
        let hint = insert_hint(priority, duration_s)?;
        let keys = keys_from_py(keys)?;
        self.contain(|| Ok(py.detach(|| self.inner.renew(&keys, hint))?))
    }

    /// Count uses toward the admission rule without storing.
    fn record_use(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let keys = keys_from_py(keys)?;
        self.contain(|| {
            py.detach(|| self.inner.record_use(&keys));
            Ok(())
        })
    }

    /// Remove ready, unpinned blocks; returns the keys removed.
    fn remove<'py>(&self, py: Python<'py>, keys: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
        let keys = keys_from_py(keys)?;
        let removed = self.contain(|| Ok(py.detach(|| self.inner.remove(&keys))))?;
        keys_to_py(py, removed.into_iter().map(|(k, _)| k))
    }

    /// Remove every block that is not pinned or being written; returns how many.
    fn clear(&self, py: Python<'_>) -> PyResult<usize> {
        self.contain(|| Ok(py.detach(|| self.inner.clear())))
    }

    // ---- single-key forms ------------------------------------------------------------------

    /// Choose the objects `lookup_result` returns for a ready, a being-written and an absent
    /// block (e.g. vLLM's LookupResult.HIT, HIT_PENDING, MISS). Can be set once.
    fn set_lookup_results(&self, ready: Py<PyAny>, writing: Py<PyAny>, absent: Py<PyAny>) -> PyResult<()> {
        self.lookup_results
            .set([ready, writing, absent])
            .map_err(|_| invalid("lookup_results", "already set for this index"))
    }

    /// Reserve a slot for one key: the slot, or None if it was present or refused.
    #[pyo3(signature = (key, *, priority=35, duration_s=None))]
    fn prepare_store_one(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        priority: i64,
        duration_s: Option<f64>,
    ) -> PyResult<Option<u32>> {
        let (k, hint) = (key_from_py(key)?, insert_hint(priority, duration_s)?);
        let one = std::slice::from_ref(&k);
        // As `prepare_store`: the writers' lock if it is free now, else wait for it without
        // the GIL (another writer may hold it for long, and every Python thread would stall).
        let out = self.contain(|| match self.inner.try_prepare_store(one, hint) {
            Some(out) => Ok(out?),
            None => Ok(py.detach(|| self.inner.prepare_store(one, hint))?),
        })?;
        Ok(out.to_write.first().map(|(_, s)| *s))
    }

    #[pyo3(signature = (key, success=true))]
    fn complete_store_one(&self, py: Python<'_>, key: &Bound<'_, PyAny>, success: bool) -> PyResult<bool> {
        if success {
            // Lock-free: no wait to fear, and no GIL release to pay for.
            let probe = probe_from_py(key)?;
            return self.contain(|| Ok(self.inner.complete_store(&[probe], true) == 1));
        }
        let k = key_from_py(key)?;
        self.contain(|| Ok(py.detach(|| self.inner.complete_store(std::slice::from_ref(&k), false)) == 1))
    }

    // The other one-key writers take the writers' lock, so they wait for it without the GIL,
    // as the batch forms do: they are not the per-request hot path that a GIL release would
    // slow down measurably.
    fn pin_one(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<u32> {
        let k = key_from_py(key)?;
        self.contain(|| Ok(py.detach(|| self.inner.pin_for_load(std::slice::from_ref(&k)))?[0]))
    }

    fn unpin_one(&self, key: &Bound<'_, PyAny>) -> PyResult<()> {
        let k = key_from_py(key)?;
        self.contain(|| Ok(self.inner.unpin(std::slice::from_ref(&k))?))
    }

    fn touch_one(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<()> {
        let k = key_from_py(key)?;
        self.contain(|| {
            py.detach(|| self.inner.touch(std::slice::from_ref(&k)));
            Ok(())
        })
    }

    /// `renew` for one key: whether it was present (and renewed).
    #[pyo3(signature = (key, *, priority=35, duration_s=None))]
    fn renew_one(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        priority: i64,
        duration_s: Option<f64>,
    ) -> PyResult<bool> {
        let (k, hint) = (key_from_py(key)?, insert_hint(priority, duration_s)?);
        self.contain(|| Ok(py.detach(|| self.inner.renew(std::slice::from_ref(&k), hint))? == 1))
    }

    fn remove_one(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let k = key_from_py(key)?;
        self.contain(|| Ok(py.detach(|| self.inner.remove(std::slice::from_ref(&k))).len() == 1))
    }

    /// (state, pins, slot) of one key, or None. State is "writing", "ready" or "evicting".
    fn state(&self, key: &Bound<'_, PyAny>) -> PyResult<Option<(&'static str, u32, u32)>> {
        let k = key_from_py(key)?;
        self.contain(|| Ok(self.inner.state_of(&k).map(|(s, p, slot)| (s.name(), p, slot))))
    }

    /// All resident keys as (key, state, pins, slot) tuples.
    fn entries<'py>(&self, py: Python<'py>) -> PyResult<Vec<EntryRow<'py>>> {
        self.contain(|| Ok(py.detach(|| self.inner.snapshot())))?
            .into_iter()
            .map(|(k, s, p, slot)| Ok((key_to_py(py, &k)?, s.name(), p, slot)))
            .collect()
    }

    /// Counters and gauges as a dict of ints (one consistent call for metrics scrapes).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let snap = self.contain(|| Ok(py.detach(|| self.inner.stats())))?;
        let d = PyDict::new(py);
        for (name, v) in snap.fields() {
            d.set_item(name, v)?;
        }
        Ok(d)
    }

    /// Test hook: `kind="store_panic"` makes the next store that evicts panic midway (after its
    /// evictions), as a bug there would; the index must then disable itself.
    #[cfg(feature = "fault-injection")]
    fn _inject_fault(&self, kind: &str) -> PyResult<()> {
        match kind {
            "store_panic" => {
                self.inner.inject_store_panic();
                Ok(())
            }
            other => Err(invalid("kind", format!("{other:?}: expected \"store_panic\""))),
        }
    }

    /// Move a manual clock forward (indexes built with manual_clock=True only).
    fn advance_clock(&self, seconds: f64) -> PyResult<()> {
        let ns = convert::seconds("seconds", seconds)?.as_nanos() as u64;
        Ok(self.inner.clock().advance(ns)?)
    }
}
