//! `Admission`: the core's admission rule and use counter for a tier that keeps no index in the
//! core (the shared remote tier), so that `uses:K` there is the same rule, counted the same way,
//! as in the index's tiers.

use std::sync::{Mutex, MutexGuard, PoisonError};

use pyo3::prelude::*;

use super::convert::{insert_hint, key_from_py};
use super::errors::invalid;
use crate::admission::{Admission, AdmissionRule};

/// The sketch takes 4 bytes a column per key expected: 2^28 keys is 1 GiB, far beyond any tier.
const MAX_EXPECTED_KEYS: i64 = 1 << 28;

/// An admission rule ("always", "uses:K" / "after_uses:K", "priority:T") with the uses it has
/// counted. `uses:K` counts in a count-min sketch sized for `expected_keys` distinct keys
/// (1..=2^28; 4 bytes a column, columns the next power of two, at least 1024) whose counts halve
/// every ten times that many uses: its memory is fixed, a key offered K times within that window
/// is always admitted, and a rare collision can admit a key early, never refuse one.
#[pyclass(module = "kvtier_rs._core", name = "Admission", frozen)]
pub struct PyAdmission {
    // Offers come from the tier's worker threads.
    inner: Mutex<Admission>,
}

impl PyAdmission {
    fn lock(&self) -> MutexGuard<'_, Admission> {
        // The sketch is counters only: a panic mid-update leaves them usable.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[pymethods]
impl PyAdmission {
    #[new]
    #[pyo3(signature = (rule, expected_keys=65536))]
    fn new(rule: &str, expected_keys: i64) -> PyResult<Self> {
        if !(1..=MAX_EXPECTED_KEYS).contains(&expected_keys) {
            return Err(invalid("expected_keys", format!("{expected_keys} is outside 1..={MAX_EXPECTED_KEYS}")));
        }
        let rule = AdmissionRule::parse(rule)?;
        Ok(PyAdmission { inner: Mutex::new(Admission::new(rule, expected_keys as usize)) })
    }

    /// Count this offer of `key` as a use and say whether the tier takes the block
    /// (`priority`, 0..=100, is what `priority:T` compares).
    #[pyo3(signature = (key, priority=35))]
    fn offer(&self, key: &Bound<'_, PyAny>, priority: i64) -> PyResult<bool> {
        let priority = insert_hint(priority, None)?.priority;
        let key = key_from_py(key)?;
        Ok(self.lock().offer(&key, priority))
    }

    /// Count a use of `key` without offering it (a hit served from another tier).
    fn record_use(&self, key: &Bound<'_, PyAny>) -> PyResult<()> {
        let key = key_from_py(key)?;
        self.lock().record_use(&key);
        Ok(())
    }

    /// The rule, in canonical form ("uses:2").
    #[getter]
    fn rule(&self) -> String {
        self.lock().rule().describe()
    }

    /// Forget every counted use.
    fn clear(&self) {
        self.lock().clear();
    }

    fn __repr__(&self) -> String {
        format!("Admission({:?})", self.rule())
    }
}
