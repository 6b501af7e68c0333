//! `HostPool`: the page-aligned host region exported through the buffer protocol, so that
//! `memoryview(pool)`, `numpy.frombuffer(pool, ...)` and `torch.frombuffer(pool, ...)` are
//! zero-copy views. `ptr` and `nbytes` let the transfer layer pin it with cudaHostRegister.
//! `HostPool.wrap(buffer, slot_bytes)` makes a pool over memory another object exports (an
//! engine's own host region), so the disk tier and the transfer engines use it in place.

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use pyo3::buffer::{PyBuffer, PyUntypedBuffer};
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

use super::errors::invalid;
use super::index::positive;
use crate::host_pool::{HostRegion, Span};
use crate::slots::SlotAllocator;

#[pyclass(frozen, module = "kvtier_rs._core")]
pub struct HostPool {
    region: HostRegion,
    slots: Arc<SlotAllocator>,
    claimed: AtomicBool,
    /// For a wrapped pool: the exporter's buffer, held (so the exporting object stays alive and
    /// its memory cannot be resized or freed) for as long as the pool lives. Declared after
    /// `region`, so the region is dropped first.
    borrowed: Option<PyUntypedBuffer>,
}

impl HostPool {
    pub(crate) fn region(&self) -> &HostRegion {
        &self.region
    }
    /// The pool's free list, handed to exactly one index.
    pub(crate) fn claim_slots(&self) -> PyResult<Arc<SlotAllocator>> {
        if self.claimed.swap(true, Ordering::AcqRel) {
            return Err(invalid("pool", "this pool already backs another BlockIndex"));
        }
        Ok(self.slots.clone())
    }
}

#[pymethods]
impl HostPool {
    /// `total_bytes` of page-aligned memory in slots of `slot_bytes` (rounded up to 4 KiB).
    #[new]
    fn new(total_bytes: i64, slot_bytes: i64) -> PyResult<Self> {
        let total = positive("total_bytes", total_bytes)?;
        let slot = positive("slot_bytes", slot_bytes)?;
        let region = HostRegion::new(total, slot)?;
        let slots = Arc::new(SlotAllocator::new(region.num_slots()));
        Ok(HostPool { region, slots, claimed: AtomicBool::new(false), borrowed: None })
    }

    /// Bytes one slot of `slot_bytes` takes in a pool (rounded up to whole 4 KiB pages): how many
    /// blocks a pool of a given size holds is `total_bytes // HostPool.stride_for(block_bytes)`.
    #[staticmethod]
    fn stride_for(slot_bytes: i64) -> PyResult<usize> {
        // At most i64::MAX, so rounding up to a page cannot overflow a 64-bit usize.
        Ok(crate::host_pool::slot_stride(positive("slot_bytes", slot_bytes)?))
    }

    /// A pool over the memory of `buffer` (any object exporting a writable, C-contiguous buffer:
    /// an `mmap`, a `memoryview`, a numpy array), in slots of `slot_bytes` (a multiple of 4096;
    /// the buffer must start page-aligned, as mmap'ed memory does). Nothing is copied: reads and
    /// writes through the pool are reads and writes of the buffer. The pool holds the buffer,
    /// which keeps the exporting object alive (an mmap cannot be closed or resized meanwhile).
    #[staticmethod]
    fn wrap(buffer: &Bound<'_, PyAny>, slot_bytes: i64) -> PyResult<Self> {
        let slot = positive("slot_bytes", slot_bytes)?;
        let buf =
            PyUntypedBuffer::get(buffer).map_err(|e| invalid("buffer", format!("does not export a buffer: {e}")))?;
        if buf.readonly() {
            return Err(invalid("buffer", "is read-only; the pool's slots must be writable"));
        }
        if !buf.is_c_contiguous() {
            return Err(invalid("buffer", "is not C-contiguous; wrap the whole underlying buffer"));
        }
        // SAFETY: the memory stays exported (alive, not resized) while `buf` is held, and `buf`
        // lives in the pool next to the region for the region's whole life.
        let region = unsafe { HostRegion::borrowed(buf.buf_ptr().cast(), buf.len_bytes(), slot)? };
        let slots = Arc::new(SlotAllocator::new(region.num_slots()));
        Ok(HostPool { region, slots, claimed: AtomicBool::new(false), borrowed: Some(buf) })
    }

    /// Copy byte runs between the pool and `buffer` (any C-contiguous buffer: numpy over a
    /// tensor's storage, a memoryview), with the GIL released. `spans` is an int64 buffer (e.g.
    /// a numpy array of shape (n, 3)) of (pool_offset, buffer_offset, nbytes) rows. Every span
    /// is checked against both extents before any byte moves. Returns the bytes copied.
    /// The caller must own the pool bytes it writes (slots being written, or pinned).
    #[pyo3(signature = (buffer, spans, *, into_pool))]
    fn copy_spans(
        &self,
        py: Python<'_>,
        buffer: &Bound<'_, PyAny>,
        spans: &Bound<'_, PyAny>,
        into_pool: bool,
    ) -> PyResult<usize> {
        let buf =
            PyUntypedBuffer::get(buffer).map_err(|e| invalid("buffer", format!("does not export a buffer: {e}")))?;
        if !buf.is_c_contiguous() {
            return Err(invalid("buffer", "is not C-contiguous; pass the whole underlying storage"));
        }
        if !into_pool && buf.readonly() {
            return Err(invalid("buffer", "is read-only; it cannot receive a copy out of the pool"));
        }
        let rows = PyBuffer::<i64>::get(spans)
            .and_then(|b| b.to_vec(py))
            .map_err(|_| invalid("spans", "expected an int64 buffer of (pool_offset, buffer_offset, nbytes) rows"))?;
        if rows.len() % 3 != 0 {
            return Err(invalid("spans", format!("{} values do not make rows of 3", rows.len())));
        }
        let spans = rows
            .chunks_exact(3)
            .map(|r| match (usize::try_from(r[0]), usize::try_from(r[1]), usize::try_from(r[2])) {
                (Ok(region_offset), Ok(other_offset), Ok(len)) => Ok(Span { region_offset, other_offset, len }),
                _ => Err(invalid("spans", format!("negative value in span {r:?}"))),
            })
            .collect::<PyResult<Vec<_>>>()?;
        let (ptr, len) = (buf.buf_ptr() as usize, buf.len_bytes());
        let region = &self.region;
        // SAFETY: `buf` keeps the exporter's memory alive and in place for the whole call, and
        // copy_spans checks every span against its length before copying.
        py.detach(|| unsafe { region.copy_spans(ptr as *mut u8, len, &spans, into_pool) })?;
        Ok(spans.iter().map(|s| s.len).sum())
    }

    /// True when the pool wraps memory exported by another object (`HostPool.wrap`).
    #[getter]
    fn wrapped(&self) -> bool {
        self.borrowed.is_some()
    }

    /// Address of the region (for cudaHostRegister and O_DIRECT I/O).
    #[getter]
    fn ptr(&self) -> usize {
        self.region.as_ptr() as usize
    }
    #[getter]
    fn nbytes(&self) -> usize {
        self.region.len()
    }
    /// Bytes per slot, a multiple of 4096.
    #[getter]
    fn slot_bytes(&self) -> usize {
        self.region.slot_bytes()
    }
    #[getter]
    fn num_slots(&self) -> usize {
        self.region.num_slots()
    }
    /// Byte offset of `slot` in the region.
    fn slot_offset(&self, slot: u32) -> PyResult<usize> {
        Ok(self.region.slot_offset(slot)?)
    }
    fn __len__(&self) -> usize {
        self.region.len()
    }
    fn __repr__(&self) -> String {
        format!("HostPool(num_slots={}, slot_bytes={}, nbytes={})", self.num_slots(), self.slot_bytes(), self.nbytes())
    }

    /// # Safety
    /// Called by the interpreter with a valid `view`; exports the whole region, writable.
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("view is null"));
        }
        let (ptr, len) = {
            let me = slf.get();
            (me.region.as_ptr(), me.region.len())
        };
        let rc = ffi::PyBuffer_FillInfo(view, slf.as_ptr(), ptr.cast(), len as ffi::Py_ssize_t, 0, flags);
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}
