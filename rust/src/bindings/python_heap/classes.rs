//! What a class tells the walk about its instances: whether Python defined it, its slots, and
//! where an autograd function keeps what it saved.

use pyo3::prelude::*;
use pyo3::types::{PyString, PyType};

pub(super) fn is_heap_type(class: &Bound<PyType>) -> bool {
    const HEAP_TYPE: u64 = 1 << 9;
    class.getattr("__flags__").and_then(|f| f.extract::<u64>()).is_ok_and(|flags| flags & HEAP_TYPE != 0)
}

/// The names of a class's slots, across its bases (`__dict__` and `__weakref__` left out).
pub(super) fn slot_names<'py>(class: &Bound<'py, PyType>) -> PyResult<Vec<Py<PyString>>> {
    let mut names = Vec::new();
    for base in class.getattr("__mro__")?.try_iter()? {
        let Ok(slots) = base?.getattr("__dict__")?.get_item("__slots__") else { continue };
        let slots: Vec<Bound<PyAny>> = if slots.is_instance_of::<PyString>() {
            vec![slots]
        } else {
            slots.try_iter()?.collect::<PyResult<_>>()?
        };
        for slot in slots {
            let slot = slot.cast_into::<PyString>()?;
            if !matches!(slot.to_string().as_str(), "__dict__" | "__weakref__") {
                names.push(slot.unbind());
            }
        }
    }
    Ok(names)
}

/// The attributes of an autograd function's type that hold what it saved for backward, raw
/// (`_raw_saved_self`, a custom Function's `_raw_saved_tensors`): reading `_saved_self` or
/// `saved_tensors` would run the saved-tensor hooks. And AccumulateGrad's `variable`.
pub(super) fn saved_names<'py>(class: &Bound<'py, PyType>) -> PyResult<Vec<Py<PyString>>> {
    let mut names = Vec::new();
    for name in class.dir()?.iter() {
        let name = name.cast_into::<PyString>()?;
        let text = name.to_string();
        if text.starts_with("_raw_saved_") || text == "variable" {
            names.push(name.unbind());
        }
    }
    Ok(names)
}
