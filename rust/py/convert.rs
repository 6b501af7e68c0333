//! Key conversion at the boundary: Python `int` and `bytes` only (bytearray/memoryview are
//! refused so a mutable buffer can never change a key after it was indexed).

use std::ffi::c_char;
use std::ptr;
use std::time::Duration;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyInt, PyList, PyMemoryView, PyString, PyTuple};

use super::errors::invalid;
use crate::keys::{BlockKey, KeyProbe, KeyRef, KeyValue};
use crate::policy::{InsertHint, MAX_PRIORITY};

pub fn key_from_py(obj: &Bound<'_, PyAny>) -> PyResult<BlockKey> {
    probe_from_py(obj).map(|p| p.to_key())
}

/// `obj` as a key if it is exactly a `bytes` object (not a subclass) of valid key length,
/// borrowing its bytes, unhashed: the common case (every engine's digests), in one type compare
/// and one C-API call instead of pyo3's checked cast (a flags lookup through a function in the
/// stable ABI) and two calls for data and length.
///
/// # Safety
/// Attached to the interpreter; `obj` a live object that outlives the key.
// Always inlined, like `KeyRef::try_bytes` (a key returned through memory stalls).
#[inline(always)]
pub unsafe fn exact_bytes_key<'a>(obj: *mut ffi::PyObject) -> Option<KeyRef<'a>> {
    unsafe {
        if ffi::Py_TYPE(obj) != ptr::addr_of_mut!(ffi::PyBytes_Type) {
            return None;
        }
        let mut data: *mut c_char = ptr::null_mut();
        let mut len: ffi::Py_ssize_t = 0;
        // Cannot fail for an exact bytes object.
        if ffi::PyBytes_AsStringAndSize(obj, &mut data, &mut len) != 0 {
            ffi::PyErr_Clear();
            return None;
        }
        KeyRef::try_bytes(std::slice::from_raw_parts(data.cast::<u8>(), len as usize))
    }
}

/// `exact_bytes_key`, hashed for the map.
///
/// # Safety
/// As `exact_bytes_key`.
#[inline(always)]
pub unsafe fn exact_bytes_probe<'a>(obj: *mut ffi::PyObject) -> Option<KeyProbe<'a>> {
    unsafe { exact_bytes_key(obj) }.map(|k| k.hashed())
}

/// The keys of `obj` if it is an exact `list` of exact `bytes` keys (the common case), borrowed
/// from the list's items and not hashed (the index hashes a key only when a chained compare
/// misses); None for anything else, which the caller then converts the general way (that way
/// also makes the errors).
///
/// # Safety
/// Attached for as long as the keys are used, without running Python code meanwhile (so the
/// list and its items cannot change).
pub unsafe fn exact_bytes_keys<'a>(obj: &'a Bound<'_, PyAny>) -> Option<Vec<KeyRef<'a>>> {
    let list = obj.as_ptr();
    unsafe {
        if ffi::Py_TYPE(list) != ptr::addr_of_mut!(ffi::PyList_Type) {
            return None;
        }
        let len = ffi::PyList_Size(list).max(0);
        let mut keys = Vec::with_capacity(len as usize);
        for i in 0..len {
            // PyList_GetItem is in range (the list cannot change: no Python code runs here).
            keys.push(exact_bytes_key(ffi::PyList_GetItem(list, i))?);
        }
        Some(keys)
    }
}

/// `obj` as a key probe, without building a key: a `bytes` key is borrowed in place (the
/// common case: vLLM's block hashes), an int is held inline.
#[inline]
pub fn probe_from_py<'a>(obj: &'a Bound<'_, PyAny>) -> PyResult<KeyProbe<'a>> {
    // SAFETY: attached (we hold a Bound), and `obj` outlives 'a.
    if let Some(probe) = unsafe { exact_bytes_probe(obj.as_ptr()) } {
        return Ok(probe);
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        let bytes = b.as_bytes();
        return match KeyProbe::try_bytes(bytes) {
            Some(probe) => Ok(probe),
            None => Err(KeyProbe::bytes(bytes).err().expect("try_bytes refused it").into()),
        };
    }
    if obj.is_instance_of::<PyInt>() {
        return obj
            .extract::<i128>()
            .map(KeyProbe::int)
            .map_err(|_| invalid("key", "integer key does not fit in 128 bits"));
    }
    Err(invalid(
        "key",
        format!("keys must be int or bytes, got {}", obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()),
    ))
}

/// Convert a list, tuple or any iterable of keys.
pub fn keys_from_py(obj: &Bound<'_, PyAny>) -> PyResult<Vec<BlockKey>> {
    refuse_non_sequence(obj)?;
    // SAFETY: attached; the probes are used at once, running no Python code.
    if let Some(keys) = unsafe { exact_bytes_keys(obj) } {
        return Ok(keys.iter().map(|k| k.hashed().to_key()).collect());
    }
    if let Ok(list) = obj.cast::<PyList>() {
        return collect_keys(list.len(), list.iter().map(Ok));
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        return collect_keys(t.len(), t.iter().map(Ok));
    }
    let iter = obj.try_iter().map_err(|_| invalid("keys", "expected a sequence of int or bytes keys"))?;
    collect_keys(0, iter)
}

/// Keys pushed one by one into a vector sized up front: collecting `PyResult<BlockKey>`s
/// through an iterator adapter moved every 80-byte key through temporaries (measured: a
/// quarter of a batch store's time).
fn collect_keys<'py>(size: usize, items: impl Iterator<Item = PyResult<Bound<'py, PyAny>>>) -> PyResult<Vec<BlockKey>> {
    let mut keys = Vec::with_capacity(size);
    for item in items {
        keys.push(probe_from_py(&item?)?.to_key());
    }
    Ok(keys)
}

pub fn key_to_py<'py>(py: Python<'py>, key: &BlockKey) -> PyResult<Bound<'py, PyAny>> {
    Ok(match key.value() {
        KeyValue::Int(v) => v.into_pyobject(py)?.into_any(),
        KeyValue::Bytes(b) => PyBytes::new(py, b).into_any(),
    })
}

pub fn keys_to_py<'py>(py: Python<'py>, keys: impl IntoIterator<Item = BlockKey>) -> PyResult<Bound<'py, PyList>> {
    let items: Vec<Bound<'py, PyAny>> = keys.into_iter().map(|k| key_to_py(py, &k)).collect::<PyResult<_>>()?;
    PyList::new(py, items)
}

/// The keys as a Python list: the list itself when it is one, else a new list of the items.
pub fn as_list<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
    if let Ok(list) = obj.cast::<PyList>() {
        return Ok(list.clone());
    }
    refuse_non_sequence(obj)?;
    let iter = obj.try_iter().map_err(|_| invalid("keys", "expected a sequence of int or bytes keys"))?;
    PyList::new(obj.py(), iter.collect::<PyResult<Vec<_>>>()?)
}

/// Refuse, where a sequence of keys is expected, a single key, and the iterables whose items
/// are not keys: iterating a bytearray or memoryview yields its bytes as ints, which would be
/// taken for int keys 0..=255 (and a str yields characters).
fn refuse_non_sequence(obj: &Bound<'_, PyAny>) -> PyResult<()> {
    if obj.is_instance_of::<PyBytes>() || obj.is_instance_of::<PyInt>() {
        return Err(invalid("keys", "expected a sequence of keys, got a single key"));
    }
    if obj.is_instance_of::<PyByteArray>() || obj.is_instance_of::<PyMemoryView>() || obj.is_instance_of::<PyString>() {
        let ty = obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
        return Err(invalid("keys", format!("expected a sequence of keys, got a {ty} (pass a list of keys)")));
    }
    Ok(())
}

/// `value` seconds as a Duration. Timeouts, durations and the index clock count nanoseconds in a
/// u64, so values from 0 up to 2^64 ns (about 584 years) are accepted; anything else (negative,
/// NaN, infinite, larger) is refused naming `arg`, never a panic.
pub fn seconds(arg: &'static str, value: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value)
        .ok()
        .filter(|d| d.as_nanos() <= u128::from(u64::MAX))
        .ok_or_else(|| invalid(arg, format!("must be a number of seconds from 0 to 584 years, got {value}")))
}

/// A store's priority (0..=100) and optional duration (seconds) as the policies take them.
pub fn insert_hint(priority: i64, duration_s: Option<f64>) -> PyResult<InsertHint> {
    if !(0..=i64::from(MAX_PRIORITY)).contains(&priority) {
        return Err(invalid("priority", format!("{priority} is outside 0..=100")));
    }
    let duration_ns = duration_s.map(|d| seconds("duration_s", d).map(|d| d.as_nanos() as u64)).transpose()?;
    Ok(InsertHint { priority: priority as u8, duration_ns })
}
