//! One error type for the whole core; the pyo3 layer maps each variant onto a Python exception
//! under `KvTierError`.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum KvError {
    /// A caller passed a value that can never work (zero sizes, unknown names, bad keys).
    #[error("invalid argument `{arg}`: {reason}")]
    InvalidArgument { arg: &'static str, reason: String },
    /// A store cannot be placed: not enough evictable blocks. Nothing was changed.
    #[error("no space: {needed} slot(s) needed, only {available} free or evictable")]
    NoSpace { needed: usize, available: usize },
    /// A load asked for blocks that are not all ready; nothing was pinned.
    #[error("block not ready: {0}")]
    NotReady(String),
    /// unpin() on a block that holds no pin: a caller bug that would corrupt pin counts.
    #[error("block not pinned: {0}")]
    NotPinned(String),
    /// A filesystem operation failed (open, create, lock, allocate): names the path and the
    /// operating system's reason, e.g. permission denied.
    #[error("{op} {path}: {detail}")]
    Io { op: &'static str, path: String, detail: String },
    /// The disk tier's directory is held by another open tier (this or another process).
    #[error("directory locked: {0}")]
    Locked(String),
    /// A tier was used after close().
    #[error("closed: {0}")]
    Closed(String),
    /// The index failed on an internal error (a bug) and answers misses from then on; the
    /// reason says what failed (see `index::failure`).
    #[error("index disabled after an internal error: {0}")]
    Failed(String),
}

impl KvError {
    pub fn invalid(arg: &'static str, reason: impl Into<String>) -> Self {
        KvError::InvalidArgument { arg, reason: reason.into() }
    }
}

impl KvError {
    pub fn io(op: &'static str, path: &std::path::Path, err: &std::io::Error) -> Self {
        KvError::Io { op, path: path.display().to_string(), detail: err.to_string() }
    }
}

pub type KvResult<T> = Result<T, KvError>;
