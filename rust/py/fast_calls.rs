//! Direct CPython entry points for `BlockIndex`'s per-request hot calls: `lookup_one`,
//! `lookup_result` (vLLM's `lookup(key, context)`) and `lookup_prefix`.
//!
//! Why not plain `#[pymethods]`: an engine's scheduler makes one of these calls per block per
//! request, and pyo3's generic method trampoline costs more than the lookup itself (measured on
//! the dev VM with callgrind and timers: ~165 of a lookup's ~420 instructions and ~45 of its
//! ~110 ns; it counts the attachment in a thread-local, locks the mutex of its deferred-decref
//! pool on every call once any call has released the GIL, and parses arguments through a
//! generic descriptor). Installed as CPython method descriptors (`METH_O`, `METH_FASTCALL`),
//! these calls get the interpreter's own fast call paths.
//!
//! Each entry point handles only the common case: keys that are exactly `bytes` (every engine's
//! digests) and plain positional arguments. Anything else (int keys, subclasses, keywords,
//! invalid keys, long batches) is handed to the ordinary pyo3 implementation in
//! `index.rs`, through a normal attached `Python` token, so results, counters and error
//! messages are the same whichever path ran. The fast path runs no Python code, creates no
//! Python object and cannot fail except by panicking, which is caught (never unwound into the
//! interpreter), disables the index and is raised as `IndexFailedError`.
//!
//! The lookups here and in `index.rs`'s one-key forms count through the index's `*_serial`
//! methods: they always run with the GIL held, which serializes them, so they need no
//! thread-local (the module is built for the stable ABI, abi3, which free-threaded Pythons do
//! not load: there is always a GIL here).

use std::ffi::CStr;
use std::ptr;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyType;
use pyo3::Borrowed;

use super::convert::exact_bytes_key;
use super::errors::failed_error;
use super::index::{BlockIndex, LONG_WALK_KEYS};
use crate::index::BlockState;

/// The index behind the method's `self`.
///
/// # Safety
/// Attached; `slf` is a `BlockIndex` (method descriptors check `self`'s type before calling,
/// and `BlockIndex` cannot be subclassed). The reference lives as long as the call.
#[inline]
unsafe fn index<'a>(slf: *mut ffi::PyObject) -> &'a BlockIndex {
    let py = unsafe { Python::assume_attached() };
    let obj = unsafe { Borrowed::from_ptr(py, slf).cast_unchecked::<BlockIndex>() };
    // The borrow is of the object `self` points at, which the caller keeps alive for the call.
    unsafe { &*(obj.get() as *const BlockIndex) }
}

/// A new reference to `obj`, as a return value.
#[inline]
unsafe fn new_ref(obj: *mut ffi::PyObject) -> *mut ffi::PyObject {
    unsafe { ffi::Py_IncRef(obj) };
    obj
}

unsafe fn py_bool(v: bool) -> *mut ffi::PyObject {
    unsafe { new_ref(if v { ffi::Py_True() } else { ffi::Py_False() }) }
}

/// Run the fast path; `None` from it goes to `slow`, which runs attached through pyo3 (so
/// errors become Python exceptions exactly as for any pyo3 method). A panic in either fails the
/// index and raises IndexFailedError, as in the pyo3 methods (`errors::contain`).
///
/// # Safety
/// Called by the interpreter with the GIL held.
unsafe fn dispatch(
    ix: &BlockIndex,
    fast: impl FnOnce() -> Option<*mut ffi::PyObject>,
    slow: impl FnOnce(Python<'_>) -> PyResult<Py<PyAny>>,
) -> *mut ffi::PyObject {
    let fast = ix.inner().contain(fast);
    if let Some(Some(result)) = fast {
        return result;
    }
    Python::attach(|py| {
        let result = match fast {
            None => Err(failed_error(ix.inner())),
            Some(_) => ix.contain(|| slow(py)),
        };
        match result {
            Ok(obj) => obj.into_ptr(),
            Err(err) => {
                err.restore(py);
                ptr::null_mut()
            }
        }
    })
}

/// Borrow the arguments of a slow-path call as pyo3 objects.
///
/// # Safety
/// Attached; `obj` live for `'a`.
unsafe fn arg<'a, 'py>(py: Python<'py>, obj: *mut ffi::PyObject) -> Borrowed<'a, 'py, PyAny> {
    unsafe { Borrowed::from_ptr(py, obj) }
}

/// `lookup_one(key, /)`: METH_O.
unsafe extern "C" fn lookup_one(slf: *mut ffi::PyObject, key: *mut ffi::PyObject) -> *mut ffi::PyObject {
    unsafe {
        let ix = index(slf);
        dispatch(
            ix,
            || {
                exact_bytes_key(key)
                    .map(|probe| py_bool(ix.inner().lookup_state_serial(&probe) == Some(BlockState::Ready)))
            },
            |py| Ok(ix.lookup_one_impl(&arg(py, key))?.into_pyobject(py)?.to_owned().into_any().unbind()),
        )
    }
}

/// `lookup_result(key, context=None, /)`: METH_FASTCALL; `context` is ignored (it lets the
/// method stand in for an engine's `lookup(key, context)`). Keywords are refused by CPython.
unsafe extern "C" fn lookup_result(
    slf: *mut ffi::PyObject,
    args: *mut *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
) -> *mut ffi::PyObject {
    unsafe {
        let ix = index(slf);
        let key = if (1..=2).contains(&nargs) { Some(*args) } else { None };
        dispatch(
            ix,
            || {
                let probe = exact_bytes_key(key?)?;
                let results = ix.lookup_results()?;
                Some(new_ref(results[ix.result_index(&probe)].as_ptr()))
            },
            |py| match key {
                Some(key) => ix.lookup_result_impl(py, &arg(py, key)),
                None => Err(pyo3::exceptions::PyTypeError::new_err(format!(
                    "lookup_result() takes a key and an optional context ({nargs} arguments given)"
                ))),
            },
        )
    }
}

/// `lookup_prefix(keys, /)`: METH_O. The fast path walks a list of exact `bytes` keys shorter
/// than LONG_WALK_KEYS; it counts nothing until it has decided to answer, so handing a list
/// back to the slow path midway (an int key, say) counts the lookup once.
unsafe extern "C" fn lookup_prefix(slf: *mut ffi::PyObject, keys: *mut ffi::PyObject) -> *mut ffi::PyObject {
    unsafe {
        let ix = index(slf);
        dispatch(
            ix,
            || {
                if ffi::Py_TYPE(keys) != ptr::addr_of_mut!(ffi::PyList_Type) {
                    return None;
                }
                let len = ffi::PyList_Size(keys);
                if len < 0 || len as usize >= LONG_WALK_KEYS {
                    ffi::PyErr_Clear();
                    return None;
                }
                // The list cannot change during the walk: no Python code runs in it. A key that
                // is not exact bytes ends the walk (Err) and the slow path starts over.
                let walk = (0..len).map(|i| exact_bytes_key(ffi::PyList_GetItem(keys, i)).ok_or(()));
                let hits = ix.inner().reader().ready_prefix(walk).ok()?;
                ix.inner().record_lookup_serial((hits + 1).min(len as usize), hits);
                Some(ffi::PyLong_FromSize_t(hits))
            },
            |py| Ok(ix.lookup_prefix_impl(py, &arg(py, keys))?.into_pyobject(py)?.into_any().unbind()),
        )
    }
}

/// One method: name, C function, calling convention and docstring (its first line is the
/// signature CPython shows, as `__text_signature__`).
struct FastMethod {
    name: &'static CStr,
    meth: ffi::PyMethodDefPointer,
    flags: std::ffi::c_int,
    doc: &'static CStr,
}

/// Put the fast entry points on `BlockIndex`'s type, as the methods of those names.
pub(crate) fn install(ty: &Bound<'_, PyType>) -> PyResult<()> {
    let methods = [
        FastMethod {
            name: c"lookup_one",
            meth: ffi::PyMethodDefPointer { PyCFunction: lookup_one },
            flags: ffi::METH_O,
            doc: c"lookup_one($self, key, /)\n--\n\nWhether the key's block is ready (one key, counted as a lookup).",
        },
        FastMethod {
            name: c"lookup_result",
            meth: ffi::PyMethodDefPointer { PyCFunctionFast: lookup_result },
            flags: ffi::METH_FASTCALL,
            doc: c"lookup_result($self, key, context=None, /)\n--\n\nOne key's state as the object chosen with \
set_lookup_results (ready, being written, absent). `context` is ignored.",
        },
        FastMethod {
            name: c"lookup_prefix",
            meth: ffi::PyMethodDefPointer { PyCFunction: lookup_prefix },
            flags: ffi::METH_O,
            doc: c"lookup_prefix($self, keys, /)\n--\n\nLength of the longest prefix of `keys` whose blocks are ready.",
        },
    ];
    let py = ty.py();
    for m in methods {
        // The interpreter keeps a pointer to the definition for the type's lifetime (the
        // process, for an extension type): leak it on purpose, three small structs per import.
        let def = Box::leak(Box::new(ffi::PyMethodDef {
            ml_name: m.name.as_ptr(),
            ml_meth: m.meth,
            ml_flags: m.flags,
            ml_doc: m.doc.as_ptr(),
        }));
        // SAFETY: attached; `ty` is a live type object and `def` lives forever.
        let descr = unsafe {
            Bound::from_owned_ptr_or_err(py, ffi::PyDescr_NewMethod(ty.as_ptr().cast::<ffi::PyTypeObject>(), def))?
        };
        ty.setattr(m.name.to_str().expect("ASCII names"), descr)?;
    }
    Ok(())
}
