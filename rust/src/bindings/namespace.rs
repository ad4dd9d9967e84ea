//! The user's namespace as the adapter from `gpuexp.ipython` presents it (see the
//! `NamespaceAdapter` protocol in `_core.pyi`), and identity pins on what it held.

use std::collections::{HashMap, HashSet};

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyWeakrefReference};

use crate::teardown;

/// Remembers which object a name held, without keeping big objects alive: a weak reference
/// where the type allows one (tensors, arrays, modules), a strong one otherwise (ints, lists),
/// because an address alone can be reused by a new object after the old one is freed.
pub(super) enum Pin {
    Weak(Py<PyWeakrefReference>),
    Strong(Py<PyAny>),
}

impl Pin {
    pub(super) fn new(object: &Bound<PyAny>) -> Pin {
        match PyWeakrefReference::new(object) {
            Ok(weak) => Pin::Weak(weak.unbind()),
            Err(_) => Pin::Strong(object.clone().unbind()),
        }
    }

    pub(super) fn holds(&self, object: &Bound<PyAny>) -> bool {
        match self {
            Pin::Weak(weak) => weak.bind(object.py()).upgrade().is_some_and(|held| held.is(object)),
            Pin::Strong(held) => object.is(held),
        }
    }
}

pub(super) fn namespace<'py>(adapter: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyDict>>> {
    let namespace = adapter.getattr("namespace")?;
    if namespace.is_none() {
        return Ok(None);
    }
    Ok(Some(namespace.cast_into::<PyDict>()?))
}

pub(super) fn system_names(adapter: &Bound<PyAny>) -> PyResult<HashSet<String>> {
    adapter.call_method0("system_names")?.try_iter()?.map(|n| n?.extract()).collect()
}

pub(super) fn user_names<'py>(adapter: &Bound<'py, PyAny>) -> PyResult<Vec<(String, Bound<'py, PyAny>)>> {
    let Some(namespace) = namespace(adapter)? else { return Ok(Vec::new()) };
    let system = system_names(adapter)?;
    let mut names = Vec::with_capacity(namespace.len());
    for (key, value) in namespace.iter() {
        let Ok(name) = key.extract::<String>() else { continue };
        if !teardown::is_system_name(&name, &system) {
            names.push((name, value));
        }
    }
    Ok(names)
}

pub(super) fn hidden_refs<'py>(adapter: &Bound<'py, PyAny>) -> PyResult<Vec<(String, Bound<'py, PyAny>)>> {
    let refs = adapter.call_method0("hidden_refs")?.cast_into::<PyDict>()?;
    refs.iter().map(|(label, object)| Ok((label.extract()?, object))).collect()
}

pub(super) fn pin_all(refs: Vec<(String, Bound<PyAny>)>) -> HashMap<String, Pin> {
    refs.into_iter().map(|(name, object)| (name, Pin::new(&object))).collect()
}

/// The user's names (not IPython's) bound to `object` in the adapter's namespace.
#[pyfunction]
pub(super) fn bound_names(adapter: &Bound<PyAny>, object: &Bound<PyAny>) -> PyResult<Vec<String>> {
    Ok(user_names(adapter)?.into_iter().filter(|(_, value)| value.is(object)).map(|(name, _)| name).collect())
}
