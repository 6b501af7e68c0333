//! The host pool: one page-aligned region split into fixed-size slots. The memory is exposed to
//! Python as a writable buffer (zero-copy numpy/torch views) and its address is handed to CUDA
//! for pinning (cudaHostRegister) by the transfer layer; page alignment also satisfies O_DIRECT.
//!
//! A region can also *borrow* memory someone else owns (`HostRegion::borrowed`): an engine's
//! own host buffer (vLLM's shared CPU region) is then read and written in place by the disk
//! tier, with no staging copy. The owner must keep that memory alive and mapped for the
//! region's whole life (the Python layer holds the exporting object's buffer for that).

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use crate::error::{KvError, KvResult};

pub const PAGE: usize = 4096;

/// Bytes a slot of `slot_bytes` takes in a pool: rounded up to whole pages, so that every slot
/// starts page-aligned (O_DIRECT, and the disk tier moves whole pages). The one place this rule
/// lives; Python sizes its tiers with it through `HostPool.stride_for`.
pub fn slot_stride(slot_bytes: usize) -> usize {
    slot_bytes.div_ceil(PAGE) * PAGE
}

#[derive(Debug)]
pub struct HostRegion {
    ptr: NonNull<u8>,
    layout: Layout,
    slot_bytes: usize,
    num_slots: usize,
    /// False for borrowed memory: dropping the region must not free it.
    owned: bool,
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
        let stride = slot_stride(slot_bytes);
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
        let ptr = NonNull::new(raw)
            .ok_or_else(|| KvError::invalid("total_bytes", format!("could not allocate {} bytes", layout.size())))?;
        Ok(HostRegion { ptr, layout, slot_bytes: stride, num_slots, owned: true })
    }

    /// A region over `len` bytes at `ptr` that this region does not own, in slots of
    /// `slot_bytes` (which must be a multiple of 4 KiB, so that each slot stays page-aligned for
    /// O_DIRECT). `ptr` must be 4 KiB aligned too; trailing bytes short of a slot are not used.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid, writable memory that outlives the region, and nobody may
    /// free or remap it meanwhile. Concurrent access discipline is the caller's, as for `new`.
    pub unsafe fn borrowed(ptr: *mut u8, len: usize, slot_bytes: usize) -> KvResult<Self> {
        if slot_bytes == 0 || slot_bytes % PAGE != 0 {
            return Err(KvError::invalid(
                "slot_bytes",
                format!(
                    "{slot_bytes} is not a positive multiple of {PAGE}: slots of wrapped memory must stay page-aligned"
                ),
            ));
        }
        let ptr = NonNull::new(ptr).ok_or_else(|| KvError::invalid("buffer", "null pointer"))?;
        if ptr.as_ptr() as usize % PAGE != 0 {
            return Err(KvError::invalid(
                "buffer",
                format!(
                    "address {:#x} is not {PAGE}-byte aligned; O_DIRECT disk I/O needs page-aligned host memory \
                     (map it with mmap, or copy through a HostPool)",
                    ptr.as_ptr() as usize
                ),
            ));
        }
        let num_slots = len / slot_bytes;
        if num_slots == 0 {
            return Err(KvError::invalid("buffer", format!("{len} bytes cannot hold one slot of {slot_bytes} bytes")));
        }
        if num_slots > u32::MAX as usize {
            return Err(KvError::invalid("buffer", "more than 2^32 slots"));
        }
        let layout = Layout::from_size_align(num_slots * slot_bytes, PAGE)
            .map_err(|e| KvError::invalid("buffer", e.to_string()))?;
        Ok(HostRegion { ptr, layout, slot_bytes, num_slots, owned: false })
    }

    /// True when the region allocated its memory, false when it borrows it.
    pub fn is_owned(&self) -> bool {
        self.owned
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

/// One run of bytes of a copy between a region and another buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub region_offset: usize,
    pub other_offset: usize,
    pub len: usize,
}

impl HostRegion {
    /// Check that every span lies inside both the region and a buffer of `other_len` bytes,
    /// naming the first one that does not.
    pub fn check_spans(&self, spans: &[Span], other_len: usize) -> KvResult<()> {
        for (i, s) in spans.iter().enumerate() {
            let fits = |off: usize, len: usize| off.checked_add(s.len).is_some_and(|end| end <= len);
            if !fits(s.region_offset, self.len()) || !fits(s.other_offset, other_len) {
                return Err(KvError::invalid(
                    "spans",
                    format!(
                        "span {i} ({} bytes at pool offset {}, buffer offset {}) does not fit a {}-byte pool and a \
                         {other_len}-byte buffer",
                        s.len,
                        s.region_offset,
                        s.other_offset,
                        self.len()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Copy every span between the region and `other` (into the region when `into_region`),
    /// after checking them all: nothing moves if any span is out of bounds. Overlap-safe
    /// (memmove), since `other` may itself be memory the region borrows.
    ///
    /// # Safety
    /// `other` must be valid for reads and writes of `other_len` bytes for the whole call, and
    /// the caller must own the region bytes it writes (slots in the Writing state or pinned).
    pub unsafe fn copy_spans(
        &self,
        other: *mut u8,
        other_len: usize,
        spans: &[Span],
        into_region: bool,
    ) -> KvResult<()> {
        self.check_spans(spans, other_len)?;
        for s in spans {
            let (r, o) = (self.as_ptr().add(s.region_offset), other.add(s.other_offset));
            if into_region {
                std::ptr::copy(o, r, s.len);
            } else {
                std::ptr::copy(r, o, s.len);
            }
        }
        Ok(())
    }
}

impl Drop for HostRegion {
    fn drop(&mut self) {
        if self.owned {
            // SAFETY: allocated in `new` with this layout.
            unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
        }
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
    fn borrowed_region_uses_the_callers_memory_in_place() {
        let owner = HostRegion::new(3 * PAGE * 2, PAGE * 2).unwrap();
        // SAFETY: `owner` outlives `view` and is not touched through another path meanwhile.
        let view = unsafe { HostRegion::borrowed(owner.as_ptr(), owner.len() - 1, PAGE) }.unwrap();
        assert!(!view.is_owned() && owner.is_owned());
        // len - 1 bytes: the last, partial page-slot is not used.
        assert_eq!((view.num_slots(), view.slot_bytes()), (5, PAGE));
        assert_eq!(view.as_ptr(), owner.as_ptr());
        unsafe {
            view.slot_mut(3).unwrap().fill(9);
            // Slot 3 of the borrowed view is the second half of the owner's slot 1.
            let o = owner.slot(1).unwrap();
            assert!(o[..PAGE].iter().all(|&b| b == 0) && o[PAGE..].iter().all(|&b| b == 9));
        }
        drop(view); // must not free the owner's memory
        unsafe { assert_eq!(owner.slot(1).unwrap()[PAGE], 9) };
    }

    #[test]
    fn borrowed_region_checks_alignment_and_sizes() {
        let owner = HostRegion::new(4 * PAGE, PAGE).unwrap();
        let p = owner.as_ptr();
        let e = unsafe { HostRegion::borrowed(p, 4 * PAGE, 5000) }.unwrap_err().to_string();
        assert!(e.contains("slot_bytes") && e.contains("multiple of 4096"), "{e}");
        let e = unsafe { HostRegion::borrowed(p.add(64), 2 * PAGE, PAGE) }.unwrap_err().to_string();
        assert!(e.contains("buffer") && e.contains("aligned"), "{e}");
        let e = unsafe { HostRegion::borrowed(p, PAGE - 1, PAGE) }.unwrap_err().to_string();
        assert!(e.contains("cannot hold one slot"), "{e}");
        assert!(unsafe { HostRegion::borrowed(std::ptr::null_mut(), PAGE, PAGE) }.is_err());
    }

    #[test]
    fn spans_copy_both_ways_and_out_of_bounds_moves_nothing() {
        let r = HostRegion::new(2 * PAGE, PAGE).unwrap();
        let mut other = vec![7u8; 100];
        let spans = [
            Span { region_offset: 10, other_offset: 0, len: 4 },
            Span { region_offset: PAGE, other_offset: 50, len: 50 },
        ];
        unsafe { r.copy_spans(other.as_mut_ptr(), other.len(), &spans, true).unwrap() };
        let slot0 = unsafe { r.slot(0).unwrap() };
        assert_eq!(&slot0[8..16], &[0, 0, 7, 7, 7, 7, 0, 0]);
        assert!(unsafe { r.slot(1).unwrap() }[..50].iter().all(|&b| b == 7));
        let mut back = vec![1u8; 100];
        unsafe { r.copy_spans(back.as_mut_ptr(), back.len(), &spans[..1], false).unwrap() };
        assert_eq!(&back[..6], &[7, 7, 7, 7, 1, 1]);
        // One bad span: an error naming it, and not even the good spans before it are copied.
        let bad = [spans[0], Span { region_offset: 0, other_offset: 90, len: 11 }];
        let mut fresh = vec![3u8; 100];
        let err = unsafe { r.copy_spans(fresh.as_mut_ptr(), fresh.len(), &bad, false) }.unwrap_err();
        assert!(err.to_string().contains("span 1"), "{err}");
        assert!(fresh.iter().all(|&b| b == 3));
        let past_region = [Span { region_offset: 2 * PAGE - 1, other_offset: 0, len: 2 }];
        assert!(r.check_spans(&past_region, 100).is_err());
        let overflow = [Span { region_offset: usize::MAX, other_offset: 0, len: 2 }];
        assert!(r.check_spans(&overflow, 100).is_err());
    }

    #[test]
    fn rejects_bad_sizes() {
        assert!(HostRegion::new(0, 4096).is_err());
        assert!(HostRegion::new(4096, 0).is_err());
        let e = HostRegion::new(4095, 4096).unwrap_err().to_string();
        assert!(e.contains("total_bytes"), "{e}");
    }
}
