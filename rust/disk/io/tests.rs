//! Engine-level tests, for what a disk tier cannot set up: an op the kernel holds for as long as
//! the test wants (a read of an empty pipe).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::uring::{self, UringEngine};
use super::*;

struct Fd(OwnedFd);
impl FdOwner for Fd {
    fn raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// (read end, write end) of a new pipe.
fn pipe() -> (Arc<Fd>, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two fds that we then own.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    unsafe { (Arc::new(Fd(OwnedFd::from_raw_fd(fds[0]))), OwnedFd::from_raw_fd(fds[1])) }
}

type Report = mpsc::Sender<(&'static str, ChainResult)>;

/// A chain of one read from `file` into `buf`, whose result is reported on `tx` as `name`.
fn read_chain(name: &'static str, file: &Arc<Fd>, buf: &mut [u8], tx: &Report) -> Chain {
    let tx = tx.clone();
    Chain {
        prep: None,
        // Offset -1: the pipe's own position (a pipe has no other).
        ops: vec![IoOp {
            kind: OpKind::Read,
            file: file.clone(),
            offset: u64::MAX,
            bufs: vec![IoBuf { ptr: buf.as_mut_ptr(), len: buf.len() }],
        }],
        done: Box::new(move |res| {
            let _ = tx.send((name, res));
        }),
    }
}

#[test]
fn after_a_failed_enter_an_op_the_kernel_took_keeps_its_buffer_until_it_completes() {
    if let Err(why) = uring::probe() {
        eprintln!("SKIPPING this io_uring test: io_uring unavailable here: {why}");
        return;
    }
    let engine = UringEngine::new(4).unwrap();
    let (pipe_in, pipe_out) = pipe();
    let (tx, rx) = mpsc::channel();
    let (mut held, mut failed, mut later) = ([0u8; 8], [0u8; 8], [0u8; 8]);
    // A read of the empty pipe: the kernel takes it and holds it until the pipe has data.
    engine.submit(vec![read_chain("held", &pipe_in, &mut held, &tx)]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while engine.ops_taken() == 0 {
        assert!(Instant::now() < deadline, "the kernel never took the read");
        engine.wake_ring_thread();
        std::thread::sleep(Duration::from_millis(1));
    }
    // The next io_uring_enter fails for good: the chains it was to submit fail with its errno,
    // and so does one submitted later, at once.
    engine.inject_enter_failure(libc::EIO, 1);
    engine.submit(vec![read_chain("failed", &pipe_in, &mut failed, &tx)]);
    assert_eq!(rx.recv_timeout(Duration::from_secs(60)), Ok(("failed", Err(IoFailure::Os(libc::EIO)))));
    assert_eq!(engine.failure(), Some(libc::EIO));
    engine.submit(vec![read_chain("later", &pipe_in, &mut later, &tx)]);
    assert_eq!(rx.recv_timeout(Duration::from_secs(60)), Ok(("later", Err(IoFailure::Os(libc::EIO)))));
    // The read the kernel holds is not finished (its caller would free or reuse its buffer)
    // until the kernel is done with it. (However busy the machine, a correct engine cannot
    // finish it in this spell: the read needs the pipe's data.)
    assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "finished while the kernel held its op");
    // SAFETY: 8 bytes from a static buffer into our pipe.
    assert_eq!(unsafe { libc::write(pipe_out.as_raw_fd(), b"kvtier!!".as_ptr().cast(), 8) }, 8);
    assert_eq!(rx.recv_timeout(Duration::from_secs(60)), Ok(("held", Ok(()))));
    assert_eq!(&held, b"kvtier!!");
    engine.shutdown();
}

// ---- short transfers: the io_uring engine goes on as the pool engine does --------------------

const PAGE: usize = crate::disk::layout::PAGE;

#[test]
fn a_partial_transfer_goes_on_only_from_a_page_boundary() {
    assert_eq!(after_transfer(0, 8192, 8192, 8192), Ok(true));
    assert_eq!(after_transfer(0, 4096, 4096, 8192), Ok(false));
    assert_eq!(after_transfer(1, 0, 4096, 8192), Err(IoFailure::Short { op: 1, done: 4096, wanted: 8192 }));
    assert_eq!(after_transfer(0, 100, 100, 8192), Err(IoFailure::Short { op: 0, done: 100, wanted: 8192 }));
}

#[test]
fn iovecs_after_skip_what_was_moved() {
    let (mut a, mut b) = ([0u8; 8192], [0u8; 4096]);
    let bufs = [IoBuf { ptr: a.as_mut_ptr(), len: 8192 }, IoBuf { ptr: b.as_mut_ptr(), len: 4096 }];
    let view = |iov: Vec<libc::iovec>| iov.iter().map(|v| (v.iov_base as usize, v.iov_len)).collect::<Vec<_>>();
    let (a0, b0) = (a.as_ptr() as usize, b.as_ptr() as usize);
    assert_eq!(view(iovecs_after(&bufs, 0)), vec![(a0, 8192), (b0, 4096)]);
    assert_eq!(view(iovecs_after(&bufs, 4096)), vec![(a0 + 4096, 4096), (b0, 4096)]);
    assert_eq!(view(iovecs_after(&bufs, 8192)), vec![(b0, 4096)]);
}

#[test]
fn a_chain_settles_like_the_pool_engine_runs_it() {
    use uring::{settle, Settled};
    let wanted = [8 * PAGE, 2 * PAGE];
    let settled = |first: usize, results: [i32; 2], moved: &mut [usize; 2]| settle(first, &results, moved, &wanted);
    let (page, cancelled) = (PAGE as i32, -libc::ECANCELED);
    // Both ops complete.
    assert_eq!(settled(0, [8 * page, 2 * page], &mut [0, 0]), Settled::Done(Ok(())));
    // The first op stops at a page boundary (the kernel cancels the op linked after it): it
    // goes on from there, then the second follows.
    let mut moved = [0, 0];
    assert_eq!(settled(0, [3 * page, cancelled], &mut moved), Settled::GoOnFrom(0));
    assert_eq!(moved, [3 * PAGE, 0]);
    assert_eq!(settled(0, [5 * page, 2 * page], &mut moved), Settled::Done(Ok(())));
    assert_eq!(moved, [8 * PAGE, 2 * PAGE]);
    // The first op complete and the second stopped at a page boundary: the second goes on
    // alone, and the first's result is not looked at again.
    let mut moved = [0, 0];
    assert_eq!(settled(0, [8 * page, page], &mut moved), Settled::GoOnFrom(1));
    assert_eq!(settled(1, [-1, page], &mut moved), Settled::Done(Ok(())));
    assert_eq!(moved, [8 * PAGE, 2 * PAGE]);
    // Nothing moved, or a transfer ending mid-page: short (a full device, a truncated file).
    assert_eq!(settled(0, [0, cancelled], &mut [0, 0]), Settled::Done(Err(short(0, 0, 8 * PAGE))));
    assert_eq!(settled(0, [100, cancelled], &mut [0, 0]), Settled::Done(Err(short(0, 100, 8 * PAGE))));
    assert_eq!(settled(0, [8 * page, 0], &mut [0, 0]), Settled::Done(Err(short(1, 0, 2 * PAGE))));
    let mut moved = [3 * PAGE, 0];
    assert_eq!(settled(0, [0, cancelled], &mut moved), Settled::Done(Err(short(0, 3 * PAGE, 8 * PAGE))));
    // An error is the chain's first failure in op order, not the cancellations it caused.
    assert_eq!(settled(0, [-libc::EIO, cancelled], &mut [0, 0]), Settled::Done(Err(IoFailure::Os(libc::EIO))));
}

fn short(op: usize, done: usize, wanted: usize) -> IoFailure {
    IoFailure::Short { op, done, wanted }
}

#[test]
fn the_io_uring_engine_goes_on_after_a_partial_read() {
    if let Err(why) = uring::probe() {
        eprintln!("SKIPPING this io_uring test: io_uring unavailable here: {why}");
        return;
    }
    // A pipe hands a read what it holds: a page now, the rest later. The chain's first read
    // stops after one page (the kernel cancels the second, linked read); the engine must go on
    // from there, then run the second read, and not report a short read.
    let engine = UringEngine::new(4).unwrap();
    let (pipe_in, pipe_out) = pipe();
    let put = |byte: u8, len: usize| {
        let data = vec![byte; len];
        // SAFETY: `len` bytes from our own buffer into our pipe.
        assert_eq!(unsafe { libc::write(pipe_out.as_raw_fd(), data.as_ptr().cast(), len) }, len as isize);
    };
    put(b'a', PAGE);
    let (mut first, mut second) = (vec![0u8; 2 * PAGE], vec![0u8; PAGE]);
    let (tx, rx) = mpsc::channel();
    let op = |buf: &mut [u8]| IoOp {
        kind: OpKind::Read,
        file: pipe_in.clone(),
        offset: 0,
        bufs: vec![IoBuf { ptr: buf.as_mut_ptr(), len: buf.len() }],
    };
    engine.submit(vec![Chain {
        prep: None,
        ops: vec![op(&mut first), op(&mut second)],
        done: Box::new(move |res| {
            let _ = tx.send(res);
        }),
    }]);
    // Wait until the rest of the first read is submitted (a third op taken), then feed it.
    let deadline = Instant::now() + Duration::from_secs(60);
    while engine.ops_taken() < 3 {
        assert!(Instant::now() < deadline, "the partial read was not submitted again");
        engine.wake_ring_thread();
        std::thread::sleep(Duration::from_millis(1));
    }
    put(b'b', PAGE);
    put(b'c', PAGE);
    assert_eq!(rx.recv_timeout(Duration::from_secs(60)), Ok(Ok(())));
    assert!(first[..PAGE].iter().all(|&b| b == b'a') && first[PAGE..].iter().all(|&b| b == b'b'));
    assert!(second.iter().all(|&b| b == b'c'));
    engine.shutdown();
}
