//! The disk tier's threads and file descriptors: none outlive an engine start the OS refused
//! halfway.
//!
//! These checks count the whole process's threads and fds, so they run here, in a test binary
//! of their own with a single test (the library's tests run in parallel and open tiers all the
//! time; running them in child processes instead would fork while those tiers hold flocks).

use std::time::{Duration, Instant};

use kvtier::disk::io::pool::PoolEngine;
use kvtier::disk::spawn;

/// (threads, open fds) of this process.
fn threads_and_fds() -> (usize, usize) {
    let count = |dir: &str| std::fs::read_dir(dir).unwrap().count();
    (count("/proc/self/task"), count("/proc/self/fd"))
}

/// Waits (at most 5 s) for the process's threads and fds to be back at `before`: a joined
/// thread may still be listed for a moment after `join` returned.
fn assert_back_to(before: (usize, usize), what: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while threads_and_fds() != before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(threads_and_fds(), before, "{what}: (threads, fds) leaked");
}

#[test]
fn no_thread_or_fd_outlives_a_refused_start() {
    pool_start_refused_halfway();
}

/// A pool engine whose k-th thread the OS refuses stops and joins the threads it started.
fn pool_start_refused_halfway() {
    for after in [0, 3, 7] {
        let before = threads_and_fds();
        spawn::inject_spawn_failure(Some(after));
        let err = PoolEngine::new(8).err().expect("the engine started without its 8th thread");
        assert_eq!(err.raw_os_error(), Some(libc::EAGAIN));
        assert_back_to(before, &format!("pool engine, spawn {after} refused"));
    }
}
