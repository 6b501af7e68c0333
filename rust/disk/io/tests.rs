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
    let deadline = Instant::now() + Duration::from_secs(10);
    while engine.ops_taken() == 0 {
        assert!(Instant::now() < deadline, "the kernel never took the read");
        engine.wake_ring_thread();
        std::thread::sleep(Duration::from_millis(1));
    }
    // The next io_uring_enter fails for good: the chains it was to submit fail with its errno,
    // and so does one submitted later, at once.
    engine.inject_enter_failure(libc::EIO, 1);
    engine.submit(vec![read_chain("failed", &pipe_in, &mut failed, &tx)]);
    assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(("failed", Err(IoFailure::Os(libc::EIO)))));
    assert_eq!(engine.failure(), Some(libc::EIO));
    engine.submit(vec![read_chain("later", &pipe_in, &mut later, &tx)]);
    assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(("later", Err(IoFailure::Os(libc::EIO)))));
    // The read the kernel holds is not finished (its caller would free or reuse its buffer)
    // until the kernel is done with it.
    assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "finished while the kernel held its op");
    // SAFETY: 8 bytes from a static buffer into our pipe.
    assert_eq!(unsafe { libc::write(pipe_out.as_raw_fd(), b"kvtier!!".as_ptr().cast(), 8) }, 8);
    assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(("held", Ok(()))));
    assert_eq!(&held, b"kvtier!!");
    engine.shutdown();
}
