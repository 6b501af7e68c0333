//! Containment of an internal failure: a writer that panics (a bug: every panic in the index is
//! a broken invariant, never bad input) may leave the index's parts disagreeing, a slot claimed
//! but still mapped, say, or a policy entry for a freed slot. parking_lot's mutex is not
//! poisoned by a panic, so without this the next writer would carry on from that state.
//!
//! Instead the index fails closed: the writer lock's guard marks it failed while the panic
//! unwinds, before the lock is released, and from then on every read answers "absent", stores
//! and pins return `KvError::Failed`, and the other writes do nothing. A cache that answers
//! misses keeps its engine serving (recomputing), and no block is served from state no
//! invariant covers. No slot is handed out again, so a load pinned before the failure still
//! reads intact bytes (stores prepared before it still write their own slots, which never
//! become readable). Occupancy (`len`, the stats' resident/pinned/writing gauges) keeps its
//! values, for diagnosis. The failure is terminal: the state cannot be trusted enough to
//! repair, so a caller that wants the tier back builds a new index (over a new host pool: a
//! pool's slots stay claimed by the index that took them) or reopens a disk tier.

use std::any::Any;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use parking_lot::{Mutex, MutexGuard};

use crate::error::{KvError, KvResult};

/// The reason while none was given: a writer's guard marks the index failed as the panic
/// unwinds, before whoever catches the panic (the Python binding, a disk I/O thread) can give
/// its message.
const WRITER_PANICKED: &str = "a writer panicked while holding the index lock";

#[derive(Debug, Default)]
pub struct Failure {
    failed: AtomicBool,
    reason: OnceLock<String>,
}

impl Failure {
    /// Whether the index has failed. Acquire: a reader that sees it set also sees the reason.
    #[inline(always)]
    pub fn is_set(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Fail the index for `reason`. The first reason given is kept; until one is, `reason()`
    /// says WRITER_PANICKED.
    pub fn set(&self, reason: impl Into<String>) {
        let _ = self.reason.set(reason.into());
        self.failed.store(true, Ordering::Release);
    }

    /// Why the index failed, if it has.
    pub fn reason(&self) -> Option<&str> {
        self.is_set().then(|| self.reason.get().map_or(WRITER_PANICKED, String::as_str))
    }

    /// `Err(KvError::Failed)` once the index has failed.
    #[inline]
    pub fn check(&self) -> KvResult<()> {
        match self.reason() {
            Some(reason) => Err(KvError::Failed(reason.to_string())),
            None => Ok(()),
        }
    }

    /// Take `mutex` for a write: refused once the index has failed (checked again after the
    /// wait, since the holder may have failed it meanwhile).
    pub fn lock<'a, T>(&'a self, mutex: &'a Mutex<T>) -> KvResult<WriteLock<'a, T>> {
        self.check()?;
        let guard = mutex.lock();
        self.check()?;
        Ok(WriteLock { guard, failure: self })
    }

    /// `lock` if the mutex is free now; None if another writer holds it.
    pub fn try_lock<'a, T>(&'a self, mutex: &'a Mutex<T>) -> Option<KvResult<WriteLock<'a, T>>> {
        if let Err(e) = self.check() {
            return Some(Err(e));
        }
        let guard = mutex.try_lock()?;
        Some(self.check().map(|()| WriteLock { guard, failure: self }))
    }
}

/// A caught panic's message, for a failure reason.
pub fn panic_message(payload: &(dyn Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

/// The writers' mutex, held: dropped by a panic, it fails the index before it unlocks.
pub struct WriteLock<'a, T> {
    guard: MutexGuard<'a, T>,
    failure: &'a Failure,
}

impl<T> Drop for WriteLock<'_, T> {
    fn drop(&mut self) {
        // Runs before the guard field unlocks, so the next writer in sees the failure.
        if std::thread::panicking() {
            self.failure.failed.store(true, Ordering::Release);
        }
    }
}

impl<T> Deref for WriteLock<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> DerefMut for WriteLock<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_under_the_lock_fails_it_and_later_writers_are_refused() {
        let failure = Failure::default();
        let mutex = Mutex::new(0u32);
        *failure.lock(&mutex).unwrap() += 1;
        assert!(failure.reason().is_none());
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut held = failure.lock(&mutex).unwrap();
            *held += 1;
            panic!("broken invariant");
        }));
        assert!(panicked.is_err());
        assert_eq!(failure.reason(), Some(WRITER_PANICKED));
        assert!(matches!(failure.lock(&mutex), Err(KvError::Failed(r)) if r == WRITER_PANICKED));
        assert!(matches!(failure.try_lock(&mutex), Some(Err(KvError::Failed(_)))));
        // The mutex itself was released (parking_lot does not poison).
        assert_eq!(*mutex.lock(), 2);
    }

    #[test]
    fn the_first_reason_given_is_kept() {
        let failure = Failure::default();
        failure.set("panic: slot 3 was not mapped");
        failure.set("later");
        assert_eq!(failure.reason(), Some("panic: slot 3 was not mapped"));
    }
}
