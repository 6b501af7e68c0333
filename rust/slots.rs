//! Fixed set of slot numbers handed out and returned without a global lock
//! (crossbeam's bounded lock-free MPMC queue as the free list).

use crossbeam_queue::ArrayQueue;

pub struct SlotAllocator {
    free: ArrayQueue<u32>,
    capacity: usize,
}

impl SlotAllocator {
    /// All `capacity` slots start free, handed out lowest number first.
    pub fn new(capacity: usize) -> Self {
        assert!(capacity > 0 && capacity <= u32::MAX as usize, "slot capacity out of range");
        let free = ArrayQueue::new(capacity);
        for i in 0..capacity as u32 {
            free.push(i).expect("queue sized to capacity");
        }
        SlotAllocator { free, capacity }
    }

    /// An allocator with no free slots (the disk tier fills it from recovered state).
    pub fn empty(capacity: usize) -> Self {
        assert!(capacity > 0 && capacity <= u32::MAX as usize, "slot capacity out of range");
        SlotAllocator { free: ArrayQueue::new(capacity), capacity }
    }

    pub fn alloc(&self) -> Option<u32> {
        self.free.pop()
    }

    /// Return a slot. Returning more slots than exist is a bug and panics.
    pub fn release(&self, slot: u32) {
        assert!((slot as usize) < self.capacity, "slot {slot} out of range");
        self.free.push(slot).expect("a slot was released twice");
    }

    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::sync::Arc;

    #[test]
    fn concurrent_alloc_release_never_duplicates() {
        let a = Arc::new(SlotAllocator::new(64));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let a = a.clone();
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        let mut held = Vec::new();
                        while let Some(s) = a.alloc() {
                            held.push(s);
                            if held.len() == 8 {
                                break;
                            }
                        }
                        let uniq: HashSet<_> = held.iter().collect();
                        assert_eq!(uniq.len(), held.len());
                        for s in held {
                            a.release(s);
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(a.free_count(), 64);
        let mut all = HashSet::new();
        while let Some(s) = a.alloc() {
            assert!(all.insert(s));
        }
        assert_eq!(all.len(), 64);
    }
}
