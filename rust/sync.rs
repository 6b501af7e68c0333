//! Atomics shim: the real std atomics normally, loom's under `--cfg loom` so the lock-free entry
//! state machine and slot key records can be model-checked exhaustively (see
//! tests/rust/loom_entry_state.rs).

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicU64, Ordering};
