//! Python exceptions, all under `KvTierError`, and the mapping from the core's error type.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::PyErr;

use crate::error::KvError;

create_exception!(kvtier_rs._core, KvTierError, PyException, "Base class of every kvtier error.");
create_exception!(
    kvtier_rs._core,
    InvalidArgumentError,
    KvTierError,
    "An argument can never work; the message names it."
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

impl From<KvError> for PyErr {
    fn from(e: KvError) -> PyErr {
        let msg = e.to_string();
        match e {
            KvError::InvalidArgument { .. } => InvalidArgumentError::new_err(msg),
            KvError::NoSpace { .. } => NoSpaceError::new_err(msg),
            KvError::NotReady(_) => NotReadyError::new_err(msg),
            KvError::NotPinned(_) => NotPinnedError::new_err(msg),
            KvError::Io { .. } => DiskIoError::new_err(msg),
            KvError::Locked(_) => DirectoryLockedError::new_err(msg),
            KvError::Closed(_) => ClosedError::new_err(msg),
        }
    }
}

pub fn invalid(arg: &'static str, reason: impl Into<String>) -> PyErr {
    KvError::invalid(arg, reason).into()
}
