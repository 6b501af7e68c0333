//! `HostPool`: the page-aligned host region exported through the buffer protocol, so that
//! `memoryview(pool)`, `numpy.frombuffer(pool, ...)` and `torch.frombuffer(pool, ...)` are
//! zero-copy views. `ptr` and `nbytes` let the transfer layer pin it with cudaHostRegister.

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

use super::errors::invalid;
use super::index::positive;
use crate::host_pool::HostRegion;
use crate::slots::SlotAllocator;

#[pyclass(frozen, module = "kvtier_rs._core")]
pub struct HostPool {
    region: HostRegion,
    slots: Arc<SlotAllocator>,
    claimed: AtomicBool,
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
        Ok(HostPool { region, slots, claimed: AtomicBool::new(false) })
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
