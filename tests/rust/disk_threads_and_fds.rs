//! The disk tier's threads and file descriptors: none outlive an engine start the OS refused
//! halfway, nor a tier's close().
//!
//! These checks count the whole process's threads and fds, so they run here, in a test binary
//! of their own with a single test (the library's tests run in parallel and open tiers all the
//! time; running them in child processes instead would fork while those tiers hold flocks).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier::admission::AdmissionRule;
use kvtier::disk::io::{pool::PoolEngine, uring, EngineChoice, StartError};
use kvtier::disk::{layout, spawn, DiskConfig, DiskTier};
use kvtier::host_pool::HostRegion;
use kvtier::policy::InsertHint;
use kvtier::{BlockKey, KvError};

const BLOCK: usize = 12_000;

/// A fresh directory path under the system temp dir, removed on drop.
struct TempDir(PathBuf);
impl TempDir {
    fn new(name: &str) -> Self {
        TempDir(std::env::temp_dir().join(format!("kvtier-fds-{}-{name}", std::process::id())))
    }
}
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A tier of `slots` slots in one file (with one slot, the recovery scan starts no thread).
fn config(dir: &TempDir, engine: EngineChoice, slots: u64) -> DiskConfig {
    let stride = (layout::round_up_page(BLOCK) + layout::HEADER_BYTES) as u64;
    let mut c = DiskConfig::new(&dir.0, slots * stride, BLOCK);
    c.num_files = 1;
    c.engine = engine;
    c.admission = AdmissionRule::Always;
    c.queue_depth = 4;
    c
}

/// (threads, open fds) of this process.
fn threads_and_fds() -> (usize, usize) {
    let count = |dir: &str| std::fs::read_dir(dir).unwrap().count();
    (count("/proc/self/task"), count("/proc/self/fd"))
}

/// Waits (at most 60 s) for the process's threads and fds to be back at `before`: a joined
/// thread may still be listed for a moment after `join` returned.
fn assert_back_to(before: (usize, usize), what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while threads_and_fds() != before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(threads_and_fds(), before, "{what}: (threads, fds) leaked");
}

fn engines() -> Vec<EngineChoice> {
    match uring::probe() {
        Ok(()) => vec![EngineChoice::Pool, EngineChoice::IoUring],
        Err(why) => {
            eprintln!("SKIPPING the io_uring engine in these checks: io_uring unavailable here: {why}");
            vec![EngineChoice::Pool]
        }
    }
}

#[test]
fn no_thread_or_fd_outlives_a_refused_start_or_a_close() {
    pool_start_refused_halfway();
    if engines().contains(&EngineChoice::IoUring) {
        io_uring_start_refused_halfway();
    }
    for engine in engines() {
        close_releases_everything(engine);
    }
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

/// The io_uring engine starts three threads (two helpers, the ring thread) and holds a ring and
/// an eventfd: a start refused at any of them stops what it started and closes both fds, also
/// through open(engine=auto), which fails rather than fall back to the pool with them leaked.
fn io_uring_start_refused_halfway() {
    for after in 0..3 {
        let before = threads_and_fds();
        spawn::inject_spawn_failure(Some(after));
        match uring::UringEngine::new(4) {
            Err(StartError::Spawn(e)) => assert_eq!(e.raw_os_error(), Some(libc::EAGAIN)),
            Err(e) => panic!("spawn {after} refused: {e:?}"),
            Ok(_) => panic!("spawn {after} refused: the engine started anyway"),
        }
        assert_back_to(before, &format!("io_uring engine, spawn {after} refused"));
        let dir = TempDir::new("auto");
        spawn::inject_spawn_failure(Some(after));
        let opened = DiskTier::open(config(&dir, EngineChoice::Auto, 1));
        assert!(matches!(opened, Err(KvError::Io { .. })), "spawn {after} refused: {:?}", opened.err());
        assert_back_to(before, &format!("open(engine=auto), spawn {after} refused"));
    }
}

/// close() closes the slabs, the lock, the engine's eventfd and ring, and stops its threads,
/// while the tier object lives on (in Python, until it is garbage-collected).
fn close_releases_everything(engine: EngineChoice) {
    let dir = TempDir::new("close");
    let host = Arc::new(HostRegion::new(2 * layout::round_up_page(BLOCK), BLOCK).unwrap());
    let before = threads_and_fds();
    let t = DiskTier::open(config(&dir, engine, 4)).unwrap();
    let ticket = t.submit_write(&[BlockKey::from_int(1)], &[0], host.clone(), InsertHint::default()).unwrap();
    assert!(t.wait(ticket.job_id, None).unwrap().unwrap().success());
    t.close().unwrap();
    assert_back_to(before, &format!("{engine:?}: a closed tier, still alive"));
    drop(t);
}
