//! The pyo3 layer: thin wrappers that convert arguments, release the GIL around core calls and
//! map `KvError` onto Python exceptions. No policy or bookkeeping logic lives here.

mod admission;
mod convert;
mod disk;
mod errors;
mod fast_calls;
mod host_pool;
mod index;
mod replay;

use pyo3::prelude::*;

// gil_used: the fast paths borrow list items and key bytes on the premise that no other thread
// runs Python code meanwhile, so on a free-threaded interpreter importing the module must turn
// the GIL back on.
#[pymodule(name = "_core", gil_used = true)]
mod core_module {
    #[pymodule_export]
    use super::admission::PyAdmission;
    #[cfg(feature = "fault-injection")]
    #[pymodule_export]
    use super::disk::_inject_spawn_failure;
    #[pymodule_export]
    use super::disk::disk_status;
    #[pymodule_export]
    use super::disk::{io_uring_probe, DiskJobResult, DiskWriteTicket, PyDiskTier};
    #[pymodule_export]
    use super::errors::{ClosedError, DirectoryLockedError, DiskIoError, IndexFailedError};
    #[pymodule_export]
    use super::errors::{InvalidArgumentError, KvTierError, NoSpaceError, NotPinnedError, NotReadyError};
    #[pymodule_export]
    use super::host_pool::HostPool;
    #[pymodule_export]
    use super::index::{BlockIndex, StoreOutcome};
    #[pymodule_export]
    use super::replay::{replay_sweep, replay_tiers, ReplayProgress, ReplayTrace};

    use pyo3::prelude::*;

    /// Version of the compiled core.
    #[pyfunction]
    fn version() -> &'static str {
        env!("CARGO_PKG_VERSION")
    }

    /// Check an admission rule ("always", "uses:K", "priority:T") with the core's own parser and
    /// return it in canonical form; raises InvalidArgumentError otherwise.
    #[pyfunction]
    fn parse_admission(spec: &str) -> PyResult<String> {
        Ok(crate::admission::AdmissionRule::parse(spec)?.describe())
    }

    /// Names of the eviction policies the core implements.
    #[pyfunction]
    fn policy_names() -> Vec<&'static str> {
        crate::policy::PolicyKind::ALL.iter().map(|k| k.name()).collect()
    }

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add("MAX_KEY_BYTES", crate::keys::MAX_KEY_BYTES)?;
        m.add("DEFAULT_PRIORITY", crate::policy::DEFAULT_PRIORITY)?;
        m.add("MAX_REPLICAS", crate::replay::MAX_REPLICAS)?;
        // Whether the `_inject_*` test hooks are compiled in (the development build only).
        m.add("FAULT_INJECTION", crate::fault::ENABLED)?;
        // The per-key lookups are CPython method descriptors, not pyo3 methods (see fast_calls).
        super::fast_calls::install(&m.py().get_type::<BlockIndex>())?;
        Ok(())
    }
}

// The methods taking a priority write its default as the literal 35 in their pyo3 signatures, so
// that `help()` and `__text_signature__` show the value (pyo3 renders a constant as `...`).
const _: () = assert!(crate::policy::DEFAULT_PRIORITY == 35, "update the `priority=35` defaults in rust/py");

#[allow(unused_imports)]
pub(crate) use convert::{key_to_py, keys_from_py};
