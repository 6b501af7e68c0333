//! Key conversion at the boundary: Python `int` and `bytes` only (bytearray/memoryview are
//! refused so a mutable buffer can never change a key after it was indexed).

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList, PyTuple};

use super::errors::invalid;
use crate::keys::{BlockKey, KeyProbe, KeyValue};

pub fn key_from_py(obj: &Bound<'_, PyAny>) -> PyResult<BlockKey> {
    probe_from_py(obj).map(|p| p.to_key())
}

/// `obj` as a key probe, without building a key: a `bytes` key is borrowed in place (the
/// common case: vLLM's block hashes), an int is held inline.
#[inline]
pub fn probe_from_py<'a>(obj: &'a Bound<'_, PyAny>) -> PyResult<KeyProbe<'a>> {
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
    if obj.is_instance_of::<PyBytes>() || obj.is_instance_of::<PyInt>() {
        return Err(invalid("keys", "expected a sequence of keys, got a single key"));
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
    if obj.is_instance_of::<PyBytes>() || obj.is_instance_of::<PyInt>() {
        return Err(invalid("keys", "expected a sequence of keys, got a single key"));
    }
    let iter = obj.try_iter().map_err(|_| invalid("keys", "expected a sequence of int or bytes keys"))?;
    PyList::new(obj.py(), iter.collect::<PyResult<Vec<_>>>()?)
}
