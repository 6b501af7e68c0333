//! Time source for priority durations. Monotonic in production; manual in tests and in trace
//! replay, where "now" is the trace's own timestamp.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::error::{KvError, KvResult};

#[derive(Debug)]
pub enum Clock {
    Monotonic(Instant),
    Manual(AtomicU64),
}

impl Clock {
    pub fn monotonic() -> Self {
        Clock::Monotonic(Instant::now())
    }
    pub fn manual() -> Self {
        Clock::Manual(AtomicU64::new(0))
    }
    /// Nanoseconds since the clock was created (monotonic) or the manual value.
    pub fn now_ns(&self) -> u64 {
        match self {
            Clock::Monotonic(start) => start.elapsed().as_nanos() as u64,
            Clock::Manual(v) => v.load(Ordering::Acquire),
        }
    }
    /// Advance a manual clock by `ns`. Refused for a monotonic clock (which cannot be moved),
    /// and when the clock would pass 2^64 ns (it would wrap to the past, and durations that
    /// should have lapsed would never lapse).
    pub fn advance(&self, ns: u64) -> KvResult<()> {
        match self {
            Clock::Monotonic(_) => Err(KvError::invalid("manual_clock", "this index uses the monotonic clock")),
            Clock::Manual(v) => v
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| now.checked_add(ns))
                .map(|_| ())
                .map_err(|now| {
                    KvError::invalid(
                        "seconds",
                        format!("the manual clock, at {now} ns, would pass 2^64 ns (584 years)"),
                    )
                }),
        }
    }
}
