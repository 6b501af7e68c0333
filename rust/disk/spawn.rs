//! Every thread the disk tier starts (I/O engines, the recovery scan) is spawned here, so that a
//! thread the OS refuses (EAGAIN under a pids limit or RLIMIT_NPROC, ENOMEM) is an error its
//! caller handles, never a panic, and so that tests can make the OS refuse one on demand (with
//! the `fault-injection` feature).

use std::io;
use std::thread::{Builder, JoinHandle, Scope, ScopedJoinHandle};

#[cfg(any(test, feature = "fault-injection"))]
thread_local! {
    /// Test hook: how many more spawns from this thread succeed before one is refused.
    static FAIL_AFTER: std::cell::Cell<Option<u32>> = const { std::cell::Cell::new(None) };
}

/// Test hook: let the next `after` spawns made from the calling thread succeed and refuse the
/// one after them with EAGAIN, as the OS does under a pids limit; None disarms it. Per thread,
/// so that tests running in parallel do not refuse each other's threads (a tier's threads are
/// all spawned by the thread that opens it).
#[cfg(any(test, feature = "fault-injection"))]
pub fn inject_spawn_failure(after: Option<u32>) {
    FAIL_AFTER.set(after);
}

#[cfg(not(any(test, feature = "fault-injection")))]
#[inline(always)]
fn injected_failure() -> io::Result<()> {
    Ok(())
}

#[cfg(any(test, feature = "fault-injection"))]
fn injected_failure() -> io::Result<()> {
    match FAIL_AFTER.get() {
        Some(0) => {
            FAIL_AFTER.set(None);
            Err(io::Error::from_raw_os_error(libc::EAGAIN))
        }
        Some(n) => {
            FAIL_AFTER.set(Some(n - 1));
            Ok(())
        }
        None => Ok(()),
    }
}

/// `std::thread::Builder::spawn`, named.
pub fn spawn<T, F>(name: String, f: F) -> io::Result<JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    injected_failure()?;
    Builder::new().name(name).spawn(f)
}

/// `std::thread::Builder::spawn_scoped`, named.
pub fn spawn_scoped<'scope, 'env, T, F>(
    scope: &'scope Scope<'scope, 'env>,
    name: String,
    f: F,
) -> io::Result<ScopedJoinHandle<'scope, T>>
where
    F: FnOnce() -> T + Send + 'scope,
    T: Send + 'scope,
{
    injected_failure()?;
    Builder::new().name(name).spawn_scoped(scope, f)
}
