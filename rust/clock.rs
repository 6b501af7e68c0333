//! Time source for priority durations. Monotonic in production; manual in tests and in trace
//! replay, where "now" is the trace's own timestamp.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

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
    /// Advance a manual clock; returns false for a monotonic clock (which cannot be moved).
    pub fn advance(&self, ns: u64) -> bool {
        match self {
            Clock::Monotonic(_) => false,
            Clock::Manual(v) => {
                v.fetch_add(ns, Ordering::AcqRel);
                true
            }
        }
    }
}
