//! Python exceptions, all under `KvTierError`, and the mapping from the core's error type.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::intern;
use pyo3::prelude::*;

use crate::error::KvError;
use crate::index::TierIndex;

create_exception!(kvtier_rs._core, KvTierError, PyException, "Base class of every kvtier error.");
create_exception!(
    kvtier_rs._core,
    InvalidArgumentError,
    KvTierError,
    "An argument can never work; the message names it, `.arg` is its name and `.reason` what is wrong."
);
create_exception!(kvtier_rs._core, NoSpaceError, KvTierError, "A store could not be placed; nothing was changed.");
create_exception!(
    kvtier_rs._core,
    NotReadyError,
    KvTierError,
    "A load asked for a block that is not ready; nothing was pinned."
);
create_exception!(kvtier_rs._core, NotPinnedError, KvTierError, "unpin() on a block without a pin.");
create_exception!(
    kvtier_rs._core,
    DiskIoError,
    KvTierError,
    "A filesystem operation failed; the message names the path and the OS reason."
);
create_exception!(
    kvtier_rs._core,
    DirectoryLockedError,
    KvTierError,
    "The disk tier's directory is already open in this or another process."
);
create_exception!(kvtier_rs._core, ClosedError, KvTierError, "The tier was used after close().");
create_exception!(
    kvtier_rs._core,
    IndexFailedError,
    KvTierError,
    "The index hit an internal error (a bug) and is disabled: lookups miss, stores are refused."
);

impl From<KvError> for PyErr {
    fn from(e: KvError) -> PyErr {
        let msg = e.to_string();
        match e {
            KvError::InvalidArgument { arg, reason } => invalid_argument_error(msg, arg, reason),
            KvError::NoSpace { .. } => NoSpaceError::new_err(msg),
            KvError::NotReady(_) => NotReadyError::new_err(msg),
            KvError::NotPinned(_) => NotPinnedError::new_err(msg),
            KvError::Io { .. } => DiskIoError::new_err(msg),
            KvError::Locked(_) => DirectoryLockedError::new_err(msg),
            KvError::Closed(_) => ClosedError::new_err(msg),
            KvError::Failed(_) => IndexFailedError::new_err(msg),
        }
    }
}

/// InvalidArgumentError with `.arg` and `.reason` set on the instance. A create_exception! type
/// has no fields and no `__init__` of its own, and a `#[pyclass(extends = ...)]` cannot extend a
/// create_exception! base such as KvTierError, so the attributes go on the instance (exception
/// instances have a `__dict__`); Python code builds the same with `checks.invalid_argument`.
fn invalid_argument_error(msg: String, arg: &'static str, reason: String) -> PyErr {
    Python::attach(|py| {
        let err = InvalidArgumentError::new_err(msg);
        let value = err.value(py);
        match value.setattr(intern!(py, "arg"), arg).and_then(|()| value.setattr(intern!(py, "reason"), reason)) {
            Ok(()) => err,
            Err(e) => e,
        }
    })
}

pub fn invalid(arg: &'static str, reason: impl Into<String>) -> PyErr {
    KvError::invalid(arg, reason).into()
}

/// Run one call into `index`. A panic in it (always a bug) fails the index (`index::failure`:
/// lookups miss, stores are refused from then on) and is raised as IndexFailedError, an
/// ordinary KvTierError that the engine adapters treat as a miss. pyo3 would raise its
/// PanicException instead, a BaseException that passes through an engine's `except Exception`
/// and stops the engine.
pub fn contain<T>(index: &TierIndex, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    index.contain(f).unwrap_or_else(|| Err(failed_error(index)))
}

/// The error to raise once `index` has failed.
pub fn failed_error(index: &TierIndex) -> PyErr {
    KvError::Failed(index.failure().unwrap_or("panic").to_string()).into()
}
