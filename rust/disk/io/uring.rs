//! io_uring engine: one ring thread owns the ring. Chains arrive through a queue; an eventfd
//! read kept armed in the ring wakes the thread when new chains are queued, so it only ever
//! sleeps in `io_uring_enter`; a helper wakes it only for a chain queued into an empty queue,
//! since the thread takes the whole queue when it wakes. The ops of one chain are linked
//! (IOSQE_IO_LINK): the kernel starts an op only after the one before it completed in full,
//! and a failed or short op cancels the rest of its chain.
//!
//! The ring thread only moves I/O. Checksums (a chain's `prep` for writes, its `done` for
//! read verification) run on two helper threads, so the ring keeps the device busy while a
//! 2 MiB block is being checksummed.
//!
//! An op that moved part of its bytes goes on from there, as in the pool engine
//! (`after_transfer`): once the completions of the chain's ops are all in, what is left of that
//! op, and the ops after it (which the kernel cancelled), are submitted again.
//!
//! At most `queue_depth` chains are in the ring at once. No fixed buffers: registering the host
//! pool would count against RLIMIT_MEMLOCK and tie the ring to one pool.
//!
//! `io_uring_enter` errors never panic the ring thread (every chain would then hang): the
//! transient ones (EAGAIN, ENOMEM: the kernel is short of memory for requests; EBUSY: its
//! completion backlog is full; EINTR) are retried after a short pause; any other, or transient
//! ones that go on for 5 s, stop the engine for good. Then every chain fails with that errno
//! (misses, failed writes), except that ops the kernel already took keep their buffers until
//! their completions arrive, and chains submitted later fail at once.

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use io_uring::{opcode, squeue, types, IoUring, Probe};
use parking_lot::{Condvar, Mutex};

use super::{after_transfer, iovecs_after, Chain, ChainResult, DoneFn, IoEngine, IoFailure, IoOp, OpKind, StartError};
use crate::disk::spawn;
use crate::fault::FaultPoint;

const WAKE: u64 = u64::MAX;
const MAX_OPS_PER_CHAIN: usize = 4;

/// Whether io_uring works here: the ring can be set up, the opcodes we use are supported, and
/// a no-op round trip through `io_uring_enter` completes. The error names the failing step
/// (seccomp filters and gVisor fail at setup with EPERM / ENOSYS).
pub fn probe() -> Result<(), String> {
    let mut ring = IoUring::new(4).map_err(|e| format!("io_uring_setup failed: {e}"))?;
    let mut p = Probe::new();
    ring.submitter().register_probe(&mut p).map_err(|e| format!("io_uring_register(PROBE) failed: {e}"))?;
    for (name, code) in [("READV", opcode::Readv::CODE), ("WRITEV", opcode::Writev::CODE), ("READ", opcode::Read::CODE)]
    {
        if !p.is_supported(code) {
            return Err(format!("the kernel's io_uring lacks the {name} opcode"));
        }
    }
    let nop = opcode::Nop::new().build().user_data(7);
    // SAFETY: a NOP references no memory.
    unsafe { ring.submission().push(&nop) }.map_err(|_| "submission queue full".to_string())?;
    ring.submit_and_wait(1).map_err(|e| format!("io_uring_enter failed: {e}"))?;
    let cqe = ring.completion().next().ok_or("no completion for a NOP")?;
    if cqe.result() < 0 {
        return Err(format!("NOP failed: {}", std::io::Error::from_raw_os_error(-cqe.result())));
    }
    Ok(())
}

struct Prepared {
    ops: Vec<IoOp>,
    done: DoneFn,
}

struct Queue {
    chains: VecDeque<Prepared>,
    stopping: bool,
    /// The errno of the `io_uring_enter` failure that stopped the ring for good.
    failed: Option<i32>,
}

enum Task {
    Prep(Chain),
    Done(DoneFn, ChainResult),
}

struct Helpers {
    tasks: VecDeque<Task>,
    /// Chains submitted whose prep has not been handed to the ring yet.
    preps_outstanding: usize,
    stopping: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    /// The eventfd that wakes the ring thread; -1 once `shutdown` closed it.
    efd: AtomicI32,
    helpers: Mutex<Helpers>,
    helper_cv: Condvar,
    /// Test hook: the next `io_uring_enter` calls fail with this errno.
    enter_fault: FaultPoint<i32>,
    /// Chain ops the kernel has taken from the submission queue (tests wait on it).
    ops_taken: AtomicU64,
}

const HELPERS: usize = 2;
/// How long the ring thread pauses before it retries a transiently failed `io_uring_enter`.
const RETRY_PAUSE: Duration = Duration::from_millis(1);
/// How long transient `io_uring_enter` failures may go on before the engine stops for good:
/// one that never ends (a seccomp filter answering EAGAIN, say) would hang every job.
const GIVE_UP_AFTER: Duration = Duration::from_secs(5);

fn helper(shared: &Shared) {
    loop {
        let task = {
            let mut h = shared.helpers.lock();
            loop {
                if let Some(t) = h.tasks.pop_front() {
                    break t;
                }
                if h.stopping {
                    return;
                }
                shared.helper_cv.wait(&mut h);
            }
        };
        match task {
            Task::Done(done, res) => done(res),
            Task::Prep(chain) => {
                if let Some((ops, done)) = chain.run_prep() {
                    let mut q = shared.queue.lock();
                    match q.failed {
                        _ if ops.is_empty() => {
                            drop(q);
                            done(Ok(()));
                        }
                        // The ring stopped for good: nothing would ever run this chain.
                        Some(errno) => {
                            drop((q, ops));
                            done(Err(IoFailure::Os(errno)));
                        }
                        // One wake per batch: the ring thread takes the whole queue when it
                        // wakes, so a chain queued behind others rides on their wake.
                        None => {
                            let was_empty = q.chains.is_empty();
                            q.chains.push_back(Prepared { ops, done });
                            drop(q);
                            if was_empty {
                                shared.wake();
                            }
                        }
                    }
                }
                let mut h = shared.helpers.lock();
                h.preps_outstanding -= 1;
                if h.preps_outstanding == 0 {
                    shared.helper_cv.notify_all();
                }
            }
        }
    }
}

impl Shared {
    fn efd(&self) -> RawFd {
        self.efd.load(Ordering::Acquire)
    }

    fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writing 8 bytes to our own eventfd. EAGAIN (counter saturated) still wakes.
        unsafe { libc::write(self.efd(), (&one as *const u64).cast(), 8) };
    }

    /// Hand a finished chain's `done` to the helpers.
    fn finish(&self, done: DoneFn, result: ChainResult) {
        self.helpers.lock().tasks.push_back(Task::Done(done, result));
        self.helper_cv.notify_all(); // all: shutdown() waits on the same condvar
    }

    /// The errno of an injected `io_uring_enter` failure, using up one count of it.
    fn take_enter_fault(&self) -> Option<i32> {
        self.enter_fault.take_as(Some)
    }
}

pub struct UringEngine {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    helpers: Mutex<Vec<JoinHandle<()>>>,
    depth: usize,
}

impl UringEngine {
    pub fn new(depth: usize) -> Result<Self, StartError> {
        probe().map_err(StartError::Unavailable)?;
        let entries = ((depth * MAX_OPS_PER_CHAIN + 2).next_power_of_two()).min(32768) as u32;
        let ring = IoUring::new(entries)
            .map_err(|e| StartError::Unavailable(format!("io_uring_setup({entries}) failed: {e}")))?;
        // SAFETY: plain syscall.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            return Err(StartError::Unavailable(format!("eventfd failed: {}", std::io::Error::last_os_error())));
        }
        let engine = UringEngine {
            shared: Arc::new(Shared {
                queue: Mutex::new(Queue { chains: VecDeque::new(), stopping: false, failed: None }),
                efd: AtomicI32::new(efd),
                helpers: Mutex::new(Helpers { tasks: VecDeque::new(), preps_outstanding: 0, stopping: false }),
                helper_cv: Condvar::new(),
                enter_fault: FaultPoint::default(),
                ops_taken: AtomicU64::new(0),
            }),
            thread: Mutex::new(None),
            helpers: Mutex::new(Vec::with_capacity(HELPERS)),
            depth,
        };
        // From here on a refused thread returns early and drops `engine`, whose Drop stops and
        // joins the threads started so far and closes the eventfd. The ring thread comes last:
        // it owns the ring, which a refused spawn closes with the closure that held it.
        for i in 0..HELPERS {
            let shared = engine.shared.clone();
            let thread =
                spawn::spawn(format!("kvtier-uring-helper-{i}"), move || helper(&shared)).map_err(StartError::Spawn)?;
            engine.helpers.lock().push(thread);
        }
        let shared = engine.shared.clone();
        let thread = spawn::spawn("kvtier-uring".into(), move || RingThread::new(ring, depth).run(&shared))
            .map_err(StartError::Spawn)?;
        *engine.thread.lock() = Some(thread);
        Ok(engine)
    }

    /// Chain ops the kernel has taken so far, as of the ring thread's last return from
    /// `io_uring_enter`.
    pub fn ops_taken(&self) -> u64 {
        self.shared.ops_taken.load(Ordering::Acquire)
    }

    /// Make the ring thread return from `io_uring_enter` (and update `ops_taken`).
    #[cfg(test)]
    pub(crate) fn wake_ring_thread(&self) {
        self.shared.wake();
    }
}

struct InFlight {
    /// Kept alive until every op's completion arrived: the kernel reads the iovecs and buffers.
    ops: Vec<IoOp>,
    /// What is left of each op submitted last, from `first` on.
    iovs: Vec<Vec<libc::iovec>>,
    /// The first op submitted last (the ones before it are complete).
    first: usize,
    /// Per op: bytes wanted, bytes moved so far, and its last submission's result (bytes, or
    /// -errno).
    wanted: Vec<usize>,
    moved: Vec<usize>,
    results: Vec<i32>,
    /// Completions still to come for the last submission.
    remaining: usize,
    done: Option<DoneFn>,
}

/// Where a chain stands once the completions of its last submission (its ops from `first` on)
/// are all in.
#[derive(Debug, PartialEq)]
pub(super) enum Settled {
    /// Finished: every op complete, or the first failure.
    Done(ChainResult),
    /// Op `.0` moved part of its bytes and goes on (`after_transfer`); the kernel cancelled
    /// the ops linked after it, so they are submitted again too.
    GoOnFrom(usize),
}

/// Settle a chain: add each op's `results` (bytes, or -errno) to what it `moved`, in op order,
/// up to the first op that is not complete (later ops were cancelled; their results do not
/// count).
pub(super) fn settle(first: usize, results: &[i32], moved: &mut [usize], wanted: &[usize]) -> Settled {
    for op in first..wanted.len() {
        let Ok(n) = usize::try_from(results[op]) else {
            return Settled::Done(Err(IoFailure::Os(-results[op])));
        };
        moved[op] += n;
        match after_transfer(op, n, moved[op], wanted[op]) {
            Ok(true) => {}
            Ok(false) => return Settled::GoOnFrom(op),
            Err(short) => return Settled::Done(Err(short)),
        }
    }
    Settled::Done(Ok(()))
}

struct RingThread {
    ring: IoUring,
    depth: usize,
    slots: Vec<Option<InFlight>>,
    free: Vec<usize>,
    in_flight: usize,
    wake_buf: Box<u64>,
    wake_armed: bool,
    /// user_data of the SQEs queued that the kernel has not taken yet, oldest first: after a
    /// failed `io_uring_enter` these are the ops that will never complete.
    queued: VecDeque<u64>,
    /// Set by `fail_all`: no op is submitted any more.
    failed: Option<i32>,
}

impl RingThread {
    fn new(ring: IoUring, depth: usize) -> Self {
        RingThread {
            ring,
            depth,
            slots: Vec::new(),
            free: Vec::new(),
            in_flight: 0,
            wake_buf: Box::new(0),
            wake_armed: false,
            queued: VecDeque::new(),
            failed: None,
        }
    }

    /// Queue one SQE (and remember it until the kernel takes it).
    ///
    /// # Safety
    /// What the entry points to must stay alive until its completion arrives.
    unsafe fn push(&mut self, entry: &squeue::Entry) {
        // SAFETY: passed on to the caller.
        unsafe { self.ring.submission().push(entry) }.expect("ring sized for queue_depth chains and the wake read");
        self.queued.push_back(entry.get_user_data());
    }

    /// `io_uring_enter`: submit what is queued and wait for a completion; the errno on failure.
    /// Afterwards `queued` lists only the SQEs the kernel has not taken.
    fn enter(&mut self, shared: &Shared) -> Result<(), i32> {
        let res = match shared.take_enter_fault() {
            Some(errno) => Err(errno),
            None => self.ring.submit_and_wait(1).map(drop).map_err(|e| e.raw_os_error().unwrap_or(libc::EIO)),
        };
        let taken = self.queued.len().saturating_sub(self.ring.submission().len());
        let ops = self.queued.drain(..taken).filter(|&ud| ud != WAKE).count();
        shared.ops_taken.fetch_add(ops as u64, Ordering::Release);
        res
    }

    /// Handle the completions the kernel has posted; true if the wake read was one of them.
    fn reap(&mut self, shared: &Shared) -> bool {
        let cqes: Vec<(u64, i32)> = self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
        cqes.into_iter().fold(false, |woke, (ud, res)| self.complete(ud, res, shared) | woke)
    }

    fn arm_wake(&mut self, efd: RawFd) {
        let e = opcode::Read::new(types::Fd(efd), (&mut *self.wake_buf as *mut u64).cast(), 8).build().user_data(WAKE);
        // SAFETY: wake_buf lives as long as the ring thread, which waits for this read to
        // complete before it returns.
        unsafe { self.push(&e) };
        self.wake_armed = true;
    }

    fn start_chain(&mut self, chain: Prepared) {
        let Prepared { ops, done } = chain;
        assert!(ops.len() <= MAX_OPS_PER_CHAIN, "chain longer than the ring was sized for");
        let id = self.free.pop().unwrap_or_else(|| {
            self.slots.push(None);
            self.slots.len() - 1
        });
        let n = ops.len();
        self.slots[id] = Some(InFlight {
            wanted: ops.iter().map(IoOp::len).collect(),
            ops,
            iovs: Vec::new(),
            first: 0,
            moved: vec![0; n],
            results: vec![0; n],
            remaining: 0,
            done: Some(done),
        });
        self.in_flight += 1;
        self.submit_ops(id);
    }

    /// Queue chain `id`'s ops from its `first` on, each from where it stands, linked.
    fn submit_ops(&mut self, id: usize) {
        let slot = self.slots[id].as_mut().expect("live chain");
        let first = slot.first;
        slot.iovs =
            slot.ops[first..].iter().zip(&slot.moved[first..]).map(|(op, &m)| iovecs_after(&op.bufs, m)).collect();
        slot.remaining = slot.ops.len() - first;
        let last = slot.ops.len() - 1;
        let entries: Vec<squeue::Entry> = (first..=last)
            .zip(&slot.iovs)
            .map(|(i, iov)| {
                let (op, fd) = (&slot.ops[i], types::Fd(slot.ops[i].file.raw_fd()));
                let offset = op.offset + slot.moved[i] as u64;
                let entry = match op.kind {
                    OpKind::Read => opcode::Readv::new(fd, iov.as_ptr(), iov.len() as u32).offset(offset).build(),
                    OpKind::Write => opcode::Writev::new(fd, iov.as_ptr(), iov.len() as u32).offset(offset).build(),
                };
                let entry = entry.user_data(((id as u64) << 8) | i as u64);
                if i < last {
                    entry.flags(squeue::Flags::IO_LINK)
                } else {
                    entry
                }
            })
            .collect();
        for entry in &entries {
            // SAFETY: iovecs and buffers are kept alive in `slots[id]` until every op of the
            // chain has completed.
            unsafe { self.push(entry) };
        }
    }

    /// Op `ud` finished with `res` (bytes moved, or -errno); once its chain's completions are
    /// all in, the chain finishes or goes on. True for the wake read.
    fn complete(&mut self, ud: u64, res: i32, shared: &Shared) -> bool {
        if ud == WAKE {
            self.wake_armed = false;
            return true;
        }
        let (id, op) = ((ud >> 8) as usize, (ud & 0xff) as usize);
        let slot = self.slots[id].as_mut().expect("completion for a live chain");
        slot.results[op] = res;
        slot.remaining -= 1;
        if slot.remaining > 0 {
            return false;
        }
        let result = match settle(slot.first, &slot.results, &mut slot.moved, &slot.wanted) {
            Settled::GoOnFrom(op) if self.failed.is_none() => {
                slot.first = op;
                self.submit_ops(id);
                return false;
            }
            Settled::GoOnFrom(_) => Err(IoFailure::Os(self.failed.expect("checked"))),
            Settled::Done(result) => result,
        };
        let mut fin = self.slots[id].take().expect("live");
        self.free.push(id);
        self.in_flight -= 1;
        let done = fin.done.take().expect("done once");
        drop(fin);
        shared.finish(done, result);
        false
    }

    fn run(mut self, shared: &Shared) {
        let mut pending: VecDeque<Prepared> = VecDeque::new();
        let mut stopping = false;
        // Since when io_uring_enter has failed transiently without a success in between.
        let mut failing_since: Option<Instant> = None;
        self.arm_wake(shared.efd());
        loop {
            {
                let mut q = shared.queue.lock();
                pending.extend(q.chains.drain(..));
                stopping |= q.stopping;
            }
            while self.in_flight < self.depth {
                let Some(c) = pending.pop_front() else { break };
                self.start_chain(c);
            }
            if stopping && self.in_flight == 0 && pending.is_empty() {
                if !self.wake_armed {
                    break;
                }
                // Complete our own wake read so its buffer is no longer in the kernel's hands.
                shared.wake();
            }
            match self.enter(shared) {
                Ok(()) => failing_since = None,
                Err(libc::EINTR) => {}
                // Short of memory for requests, or the completion backlog is full: the SQEs
                // stay queued for the next call; completions are still reaped meanwhile.
                Err(libc::EAGAIN | libc::ENOMEM | libc::EBUSY)
                    if failing_since.get_or_insert_with(Instant::now).elapsed() < GIVE_UP_AFTER =>
                {
                    std::thread::sleep(RETRY_PAUSE)
                }
                Err(errno) => return self.fail_all(errno, pending, shared),
            }
            let rearm = self.reap(shared);
            if rearm && !(stopping && self.in_flight == 0 && pending.is_empty()) {
                // Drain the counter so the next write wakes us again.
                let mut sink = 0u64;
                // SAFETY: non-blocking read of our own eventfd.
                unsafe { libc::read(shared.efd(), (&mut sink as *mut u64).cast(), 8) };
                self.arm_wake(shared.efd());
            }
        }
    }

    /// `io_uring_enter` failed for good with `errno`: fail every chain with it rather than let
    /// them hang. Ops the kernel never took fail now; the ones it took stay its own until their
    /// completions arrive (which needs no `io_uring_enter`: the kernel posts them whenever this
    /// thread returns from a syscall, its sleeps included), so their buffers stay alive until
    /// then. Chains queued later fail at once (see `helper`).
    fn fail_all(mut self, errno: i32, mut pending: VecDeque<Prepared>, shared: &Shared) {
        self.failed = Some(errno);
        {
            let mut q = shared.queue.lock();
            q.failed = Some(errno);
            pending.extend(q.chains.drain(..));
        }
        for Prepared { ops, done } in pending {
            drop(ops);
            shared.finish(done, Err(IoFailure::Os(errno)));
        }
        for ud in std::mem::take(&mut self.queued) {
            self.complete(ud, -errno, shared);
        }
        if self.wake_armed {
            shared.wake(); // completes the wake read the kernel holds
        }
        while self.in_flight > 0 || self.wake_armed {
            std::thread::sleep(RETRY_PAUSE);
            self.reap(shared);
        }
    }
}

impl Drop for RingThread {
    fn drop(&mut self) {
        // Only a panic can leave ops with the kernel here (`run` waits for them otherwise):
        // leak their buffers rather than free memory the kernel may still read or write.
        if self.in_flight > 0 || self.wake_armed {
            std::mem::forget(std::mem::take(&mut self.slots));
            std::mem::forget(std::mem::replace(&mut self.wake_buf, Box::new(0)));
        }
    }
}

impl IoEngine for UringEngine {
    fn name(&self) -> &'static str {
        "io_uring"
    }
    fn queue_depth(&self) -> usize {
        self.depth
    }
    fn submit(&self, chains: Vec<Chain>) {
        if chains.is_empty() {
            return;
        }
        let mut h = self.shared.helpers.lock();
        h.preps_outstanding += chains.len();
        h.tasks.extend(chains.into_iter().map(Task::Prep));
        drop(h);
        self.shared.helper_cv.notify_all();
    }
    fn failure(&self) -> Option<i32> {
        self.shared.queue.lock().failed
    }
    #[cfg(any(test, feature = "fault-injection"))]
    fn inject_enter_failure(&self, errno: i32, count: u32) -> bool {
        self.shared.enter_fault.arm((count > 0).then_some(errno), count);
        true
    }
    fn shutdown(&self) {
        // Order matters: every prep must reach the ring before the ring is told to stop, and
        // the helpers must outlive the ring so that its last completions still get run.
        {
            let mut h = self.shared.helpers.lock();
            while h.preps_outstanding > 0 {
                self.shared.helper_cv.wait(&mut h);
            }
        }
        self.shared.queue.lock().stopping = true;
        self.shared.wake();
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
        self.shared.helpers.lock().stopping = true;
        self.shared.helper_cv.notify_all();
        for t in self.helpers.lock().drain(..) {
            let _ = t.join();
        }
        // Every thread that used the eventfd has exited: close it now, not when the engine is
        // dropped (a closed tier may live on). The swap makes a second shutdown a no-op.
        let efd = self.shared.efd.swap(-1, Ordering::AcqRel);
        if efd >= 0 {
            // SAFETY: our own eventfd, closed once.
            unsafe { libc::close(efd) };
        }
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}
