//! The host pool: one page-aligned region split into fixed-size slots. The memory is exposed to
//! Python as a writable buffer (zero-copy numpy/torch views) and its address is handed to CUDA
//! for pinning (cudaHostRegister) by the transfer layer; page alignment also satisfies O_DIRECT.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use crate::error::{KvError, KvResult};

pub const PAGE: usize = 4096;

#[derive(Debug)]
pub struct HostRegion {
    ptr: NonNull<u8>,
    layout: Layout,
    slot_bytes: usize,
    num_slots: usize,
}

// SAFETY: the region is plain memory; concurrent access discipline (one writer per slot, enforced
// by the index's Writing state and pins) is the caller's, exactly as for a CUDA pinned buffer.
unsafe impl Send for HostRegion {}
unsafe impl Sync for HostRegion {}

impl HostRegion {
    /// `total_bytes` of memory in slots of `slot_bytes`. The slot size is rounded up to a whole
    /// number of 4 KiB pages so every slot is page-aligned; leftover bytes are not used.
    pub fn new(total_bytes: usize, slot_bytes: usize) -> KvResult<Self> {
        if slot_bytes == 0 {
            return Err(KvError::invalid("slot_bytes", "must be positive"));
        }
        if total_bytes == 0 {
            return Err(KvError::invalid("total_bytes", "must be positive"));
        }
        let stride = slot_bytes.div_ceil(PAGE) * PAGE;
        let num_slots = total_bytes / stride;
        if num_slots == 0 {
            return Err(KvError::invalid(
                "total_bytes",
                format!("{total_bytes} bytes cannot hold one slot of {slot_bytes} bytes ({stride} bytes page-aligned)"),
            ));
        }
        if num_slots > u32::MAX as usize {
            return Err(KvError::invalid("total_bytes", "more than 2^32 slots"));
        }
        let layout = Layout::from_size_align(num_slots * stride, PAGE)
            .map_err(|e| KvError::invalid("total_bytes", e.to_string()))?;
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            KvError::invalid("total_bytes", format!("could not allocate {} bytes", layout.size()))
        })?;
        Ok(HostRegion { ptr, layout, slot_bytes: stride, num_slots })
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    pub fn len(&self) -> usize {
        self.layout.size()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Bytes per slot (page-aligned stride).
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }
    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    pub fn slot_offset(&self, slot: u32) -> KvResult<usize> {
        if slot as usize >= self.num_slots {
            return Err(KvError::invalid("slot", format!("slot {slot} out of range 0..{}", self.num_slots)));
        }
        Ok(slot as usize * self.slot_bytes)
    }

    /// # Safety
    /// The caller must ensure no one writes this slot while the slice lives.
    pub unsafe fn slot(&self, slot: u32) -> KvResult<&[u8]> {
        let off = self.slot_offset(slot)?;
        Ok(std::slice::from_raw_parts(self.ptr.as_ptr().add(off), self.slot_bytes))
    }

    /// # Safety
    /// The caller must hold the slot exclusively (e.g. it is in the Writing state).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slot_mut(&self, slot: u32) -> KvResult<&mut [u8]> {
        let off = self.slot_offset(slot)?;
        Ok(std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), self.slot_bytes))
    }
}

impl Drop for HostRegion {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_page_aligned_and_disjoint() {
        let r = HostRegion::new(10 * 5000, 5000).unwrap();
        assert_eq!(r.slot_bytes(), 8192);
        assert_eq!(r.num_slots(), 6);
        assert_eq!(r.as_ptr() as usize % PAGE, 0);
        unsafe {
            r.slot_mut(1).unwrap().fill(7);
            assert!(r.slot(0).unwrap().iter().all(|&b| b == 0));
            assert!(r.slot(1).unwrap().iter().all(|&b| b == 7));
        }
        assert!(r.slot_offset(6).is_err());
    }

    #[test]
    fn rejects_bad_sizes() {
        assert!(HostRegion::new(0, 4096).is_err());
        assert!(HostRegion::new(4096, 0).is_err());
        let e = HostRegion::new(4095, 4096).unwrap_err().to_string();
        assert!(e.contains("total_bytes"), "{e}");
    }
}
