//! kvtier core: block identity, a concurrent block index per tier, pluggable eviction and
//! admission policies, and a page-aligned host pool. No Python types live here; the pyo3 layer
//! in `py/` is compiled only with the `python` feature, so `cargo test` needs no interpreter.
//!
//! Dependency direction, top to bottom: `keys` -> `policy`/`admission` -> `slots`/`host_pool`
//! -> `index`. Later tiers (disk, replay) sit on top of these.

pub mod admission;
pub mod clock;
pub mod disk;
pub mod error;
pub mod fault;
pub mod host_pool;
pub mod index;
pub mod keys;
pub mod policy;
pub mod replay;
pub mod slots;
pub(crate) mod sync;

#[cfg(feature = "python")]
mod py;

pub use error::{KvError, KvResult};
pub use keys::BlockKey;
