//! I/O engines behind one interface.
//!
//! The disk tier hands an engine *chains*: a few positioned vector reads or writes on slab files
//! that run in order, an optional `prep` step run on the engine's thread just before the first
//! op (the write checksum, so the caller's thread never spends time on it), and a `done`
//! callback run on the engine's thread when the chain finished or failed. A chain stops at its
//! first failed or short op. The tier's own chains are one op each (a slot's payload and header
//! are one contiguous range).
//!
//! Two engines: `pool` (positioned I/O on a thread pool; works everywhere) and `io_uring`
//! (one ring thread, ops of a chain linked with IOSQE_IO_LINK). `auto` takes the pool where
//! io_uring is refused (containers and gVisor commonly forbid it), and otherwise whichever
//! engine a short measurement on the tier's device found faster (`choose`).

pub mod choose;
pub mod pool;
pub mod uring;

#[cfg(test)]
mod tests;

use std::os::fd::RawFd;
use std::path::Path;
use std::sync::Arc;

use crate::error::{KvError, KvResult};

/// Memory an op reads into or writes from. Raw because it points into the host pool (or a
/// header page owned by the chain), which the chain's owner keeps alive until `done` ran.
#[derive(Clone, Copy, Debug)]
pub struct IoBuf {
    pub ptr: *mut u8,
    pub len: usize,
}
// SAFETY: an IoBuf is only an address; the disk tier guarantees exclusive use of the memory
// for the chain's lifetime (host slots are reserved/pinned, header pages are owned by the chain).
unsafe impl Send for IoBuf {}
unsafe impl Sync for IoBuf {}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    Read,
    Write,
}

/// Something that owns a file descriptor; ops keep it alive so the fd number cannot be closed
/// and reused while the kernel still works on it.
pub trait FdOwner: Send + Sync {
    fn raw_fd(&self) -> RawFd;
}

pub struct IoOp {
    pub kind: OpKind,
    pub file: Arc<dyn FdOwner>,
    pub offset: u64,
    pub bufs: Vec<IoBuf>,
}

impl IoOp {
    pub fn len(&self) -> usize {
        self.bufs.iter().map(|b| b.len).sum()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoFailure {
    /// The OS reported an error (errno).
    Os(i32),
    /// Fewer bytes than asked (end of a truncated file, or a full device).
    Short { op: usize, done: usize, wanted: usize },
    /// The prep step refused (e.g. an injected fault).
    Prep(i32),
}

impl IoFailure {
    pub fn errno(&self) -> Option<i32> {
        match self {
            IoFailure::Os(e) | IoFailure::Prep(e) => Some(*e),
            IoFailure::Short { .. } => None,
        }
    }
}

pub type ChainResult = Result<(), IoFailure>;
/// Runs on the engine thread before the chain's first op; an errno aborts the chain.
pub type PrepFn = Box<dyn FnOnce() -> Result<(), i32> + Send>;
/// Runs on the engine thread once the chain finished or failed.
pub type DoneFn = Box<dyn FnOnce(ChainResult) + Send>;

pub struct Chain {
    pub prep: Option<PrepFn>,
    pub ops: Vec<IoOp>,
    pub done: DoneFn,
}

impl Chain {
    /// Run `prep`; on failure, finish the chain with that failure and return None.
    pub(crate) fn run_prep(mut self) -> Option<(Vec<IoOp>, DoneFn)> {
        if let Some(prep) = self.prep.take() {
            if let Err(e) = prep() {
                (self.done)(Err(IoFailure::Prep(e)));
                return None;
            }
        }
        Some((self.ops, self.done))
    }
}

pub trait IoEngine: Send + Sync {
    fn name(&self) -> &'static str;
    fn queue_depth(&self) -> usize;
    /// Queue chains; never waits for I/O. Each chain's `done` runs exactly once.
    fn submit(&self, chains: Vec<Chain>);
    /// Finish everything queued, then stop the engine's threads. Idempotent.
    fn shutdown(&self);
    /// The errno that stopped the engine for good (an `io_uring_enter` failure); None while it
    /// works.
    fn failure(&self) -> Option<i32> {
        None
    }
    /// Test hook: the engine's next `count` submissions to the kernel (`io_uring_enter`) fail
    /// with `errno`. False for an engine without that step (the pool).
    #[cfg(any(test, feature = "fault-injection"))]
    fn inject_enter_failure(&self, _errno: i32, _count: u32) -> bool {
        false
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineChoice {
    Auto,
    IoUring,
    Pool,
}

impl EngineChoice {
    pub fn parse(name: &str) -> KvResult<Self> {
        match name.trim().to_ascii_lowercase().replace('-', "_").as_str() {
            "auto" => Ok(EngineChoice::Auto),
            "io_uring" | "uring" => Ok(EngineChoice::IoUring),
            "pool" | "threads" | "psync" => Ok(EngineChoice::Pool),
            other => Err(KvError::invalid(
                "engine",
                format!("unknown I/O engine {other:?}; expected \"auto\", \"io_uring\" or \"pool\""),
            )),
        }
    }
}

/// Why an engine did not start.
#[derive(Debug)]
pub enum StartError {
    /// io_uring is refused here (kernel, seccomp, sandbox), in words; `auto` falls back to the
    /// pool on it.
    Unavailable(String),
    /// The OS refused a thread (a pids limit, RLIMIT_NPROC, memory). Not a reason to fall back:
    /// the pool needs more threads than io_uring.
    Spawn(std::io::Error),
}

/// Build the engine asked for. `io_uring` fails with the probe's reason when the kernel or
/// sandbox forbids it; `auto` falls back to the pool and keeps the reason for stats. A thread
/// the OS refuses is an I/O error naming the tier's directory `dir`.
pub fn build_engine(
    choice: EngineChoice,
    queue_depth: usize,
    dir: &Path,
) -> KvResult<(Arc<dyn IoEngine>, Option<String>)> {
    if queue_depth == 0 || queue_depth > 4096 {
        return Err(KvError::invalid("queue_depth", format!("must be in 1..=4096, got {queue_depth}")));
    }
    // A refused thread names the tier and how many threads its engine needs.
    let spawn_failed = |e: std::io::Error| KvError::Io {
        op: "start an I/O thread for",
        path: dir.display().to_string(),
        detail: format!("{e}; the pool engine runs one thread per queue_depth ({queue_depth}), io_uring three"),
    };
    let pool =
        || -> KvResult<Arc<dyn IoEngine>> { Ok(Arc::new(pool::PoolEngine::new(queue_depth).map_err(spawn_failed)?)) };
    let engine: Arc<dyn IoEngine> = match choice {
        EngineChoice::Pool => pool()?,
        EngineChoice::IoUring | EngineChoice::Auto => match uring::UringEngine::new(queue_depth) {
            Ok(e) => Arc::new(e),
            Err(StartError::Spawn(e)) => return Err(spawn_failed(e)),
            Err(StartError::Unavailable(why)) if choice == EngineChoice::Auto => return Ok((pool()?, Some(why))),
            Err(StartError::Unavailable(why)) => {
                return Err(KvError::invalid("engine", format!("io_uring is not usable here: {why}")))
            }
        },
    };
    Ok((engine, None))
}

/// The iovecs of `bufs` less their first `skip` bytes: what is left of an op after a partial
/// transfer.
pub(crate) fn iovecs_after(bufs: &[IoBuf], mut skip: usize) -> Vec<libc::iovec> {
    let mut iov = Vec::with_capacity(bufs.len());
    for b in bufs {
        if skip >= b.len {
            skip -= b.len;
            continue;
        }
        // SAFETY: stays inside the buffer.
        iov.push(libc::iovec { iov_base: unsafe { b.ptr.add(skip) }.cast(), iov_len: b.len - skip });
        skip = 0;
    }
    iov
}

/// Where op `index` stands after a transfer of `n` bytes brought it to `done` of `wanted`:
/// complete (true), to go on from `done` (false), or stopped short. O_DIRECT continues only at
/// page-aligned offsets; a transfer of nothing, or one that ends elsewhere, means a short file or
/// a full device, so it is reported rather than retried at an unaligned offset.
pub(crate) fn after_transfer(index: usize, n: usize, done: usize, wanted: usize) -> Result<bool, IoFailure> {
    if done >= wanted {
        return Ok(true);
    }
    if n == 0 || done % crate::disk::layout::PAGE != 0 {
        return Err(IoFailure::Short { op: index, done, wanted });
    }
    Ok(false)
}

/// Run one op with positioned vector I/O, going on after partial transfers (`after_transfer`,
/// as the io_uring engine does too); used by the pool engine. Returns the failure, or Ok when
/// every byte moved.
pub fn run_op_blocking(op: &IoOp, index: usize) -> ChainResult {
    let wanted = op.len();
    let mut done = 0usize;
    let fd = op.file.raw_fd();
    while done < wanted {
        let iov = iovecs_after(&op.bufs, done);
        let off = (op.offset + done as u64) as libc::off_t;
        // SAFETY: iovecs point at memory the chain owner keeps valid; fd is kept open by op.file.
        let n = unsafe {
            match op.kind {
                OpKind::Read => libc::preadv(fd, iov.as_ptr(), iov.len() as libc::c_int, off),
                OpKind::Write => libc::pwritev(fd, iov.as_ptr(), iov.len() as libc::c_int, off),
            }
        };
        if n < 0 {
            let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
            if e == libc::EINTR {
                continue;
            }
            return Err(IoFailure::Os(e));
        }
        done += n as usize;
        if after_transfer(index, n as usize, done, wanted)? {
            break;
        }
    }
    Ok(())
}
