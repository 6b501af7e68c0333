//! Fault injection for tests: places in the code where a test arms a fault that the next
//! operations through them take (an errno, a panic). Armed faults exist only with the
//! `fault-injection` feature (the development build turns it on) and in the crate's own unit
//! tests; in every other build a `FaultPoint` is zero-sized, `take_as` returns None and the
//! compiler drops the check, so a release build carries no hook and exports none.

/// Whether this build can arm faults.
pub const ENABLED: bool = cfg!(any(test, feature = "fault-injection"));

#[cfg(any(test, feature = "fault-injection"))]
mod point {
    use parking_lot::Mutex;

    /// A fault and how many more operations take it.
    pub struct FaultPoint<T: Copy>(Mutex<Option<(T, u32)>>);

    impl<T: Copy> Default for FaultPoint<T> {
        fn default() -> Self {
            FaultPoint(Mutex::new(None))
        }
    }

    impl<T: Copy> FaultPoint<T> {
        /// Arm `fault` for the next `count` operations that take it (at least one); None
        /// disarms.
        pub fn arm(&self, fault: Option<T>, count: u32) {
            *self.0.lock() = fault.map(|f| (f, count));
        }

        /// `pick`'s view of the armed fault, using up one count of it if `pick` takes it.
        pub fn take_as<R>(&self, pick: impl Fn(T) -> Option<R>) -> Option<R> {
            let mut armed = self.0.lock();
            let (fault, count) = (*armed)?;
            let taken = pick(fault)?;
            *armed = (count > 1).then_some((fault, count - 1));
            Some(taken)
        }

        /// Hold every operation that checks this point until the guard drops: a test keeps a
        /// job in flight this way.
        pub fn hold(&self) -> impl Drop + '_ {
            self.0.lock()
        }
    }
}

#[cfg(not(any(test, feature = "fault-injection")))]
mod point {
    use std::marker::PhantomData;

    /// Without fault injection: nothing to arm, nothing ever taken.
    pub struct FaultPoint<T: Copy>(PhantomData<T>);

    impl<T: Copy> Default for FaultPoint<T> {
        fn default() -> Self {
            FaultPoint(PhantomData)
        }
    }

    impl<T: Copy> FaultPoint<T> {
        #[inline(always)]
        pub fn take_as<R>(&self, _pick: impl Fn(T) -> Option<R>) -> Option<R> {
            None
        }
    }
}

pub use point::FaultPoint;
