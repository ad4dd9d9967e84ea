//! A real step's state saved by value for `verify` (`gpuexp.saved_state.capture`), by the core's
//! one state saving ([`step_state::save_by_value`]): held across Python calls, until the step
//! has run, as the `SavedStep` that puts it back.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use std::collections::HashMap;

use crate::bindings::step_state::{PythonStep, Saved};
use crate::step_state::{self, ByValue, Unrestored, BOUNDS};

/// Everything a real step can change in the objects given to `save_step`, as it was: the
/// containers by the identity of what they hold, the tensors' values and gradients (copied to
/// host memory), the four RNGs. `restore()` puts them back.
#[pyclass(name = "SavedStep", module = "gpuexp._core", unsendable)]
pub(in crate::bindings) struct SavedStep(ByValue<Saved>);

#[pymethods]
impl SavedStep {
    /// Puts every piece back, in the order saved; returns (failed, kept): each piece that could
    /// not be put back as "name (Error: message)", and the value before of each by name.
    fn restore<'py>(&self, py: Python<'py>) -> PyResult<(Vec<String>, Bound<'py, PyDict>)> {
        let mut step = PythonStep::find(py, &[], &[])?;
        let (mut failed, kept) = (Vec::new(), PyDict::new(py));
        for (index, unrestored) in step_state::restore_by_value(&mut step, &self.0) {
            let (name, saved) = &self.0.saved[index];
            failed.push(match unrestored {
                Unrestored::Note(note) => format!("{name} ({note})"),
                Unrestored::Error(error) => {
                    let kind = error.get_type(py).name().map(|n| n.to_string()).unwrap_or_default();
                    format!("{name} ({kind}: {})", error.value(py))
                }
            });
            if let Some(before) = value_before(py, saved)? {
                kept.set_item(name, before)?;
            }
        }
        if self.0.partial {
            failed.push(format!(
                "what lies beyond the first {} objects the step reaches (not saved, so not put back)",
                BOUNDS.objects
            ));
        }
        Ok((failed, kept))
    }
}

/// What a piece held before the step, for the user to put back by hand: a container's items, a
/// tensor's host copy, an RNG's state; None where there is none (a gradient that was None).
fn value_before<'py>(py: Python<'py>, saved: &Saved) -> PyResult<Option<Bound<'py, PyAny>>> {
    Ok(match saved {
        Saved::Dict(_, before) => Some(before.bind(py).clone().into_any()),
        Saved::Mapping(_, pairs) => Some(PyDict::from_sequence(pairs.bind(py).as_any())?.into_any()),
        Saved::List(_, before) => Some(before.bind(py).clone().into_any()),
        Saved::Refilled { items, .. } => Some(items.bind(py).clone().into_any()),
        Saved::Global { before, .. } | Saved::Cell(_, before) => before.as_ref().map(|b| b.bind(py).clone()),
        Saved::Rng(_, state) => Some(state.bind(py).clone()),
        Saved::Value(value) => Some(value.bind(py).getattr("host")?).filter(|host| !host.is_none()),
    })
}

/// Saves by value all a real step can change in these objects (`gpuexp.saved_state.capture`'s
/// arguments: each a dict of name to object, or a list): every container reachable from them,
/// the value and gradient of every tensor there, every submodule's `training` flag (in its
/// attributes), and the four RNGs.
#[pyfunction]
pub(in crate::bindings) fn save_step(
    py: Python,
    modules: Bound<PyAny>,
    optimizers: Bound<PyAny>,
    scalers: Bound<PyAny>,
    objects: Bound<PyAny>,
) -> PyResult<SavedStep> {
    let mut step = PythonStep::find(py, &[], &[])?;
    let module = py.import("sys")?.getattr("modules")?.get_item("torch")?.getattr("nn")?.getattr("Module")?;
    let mut roots = Vec::new();
    for (kind, group) in [("modules", modules), ("optimizers", optimizers), ("scalers", scalers), ("objects", objects)]
    {
        for (name, object) in named(kind, &group)? {
            let type_name = object.get_type().name()?.to_string();
            if kind == "modules" && !object.is_instance(&module)? {
                return Err(PyTypeError::new_err(format!("modules: {name} is a {type_name}, not a torch.nn.Module")));
            }
            if kind != "modules" && object.getattr("__dict__").ok().filter(|d| d.is_instance_of::<PyDict>()).is_none() {
                return Err(PyTypeError::new_err(format!("{kind}: {name} ({type_name}) has no attributes to save")));
            }
            roots.push((name, object));
        }
    }
    step.values = Some(HashMap::new());
    Ok(SavedStep(step_state::save_by_value(&mut step, roots)?))
}

/// A group of objects by name: a dict's own, a list's `kind[index]`.
fn named<'py>(kind: &str, group: &Bound<'py, PyAny>) -> PyResult<Vec<(String, Bound<'py, PyAny>)>> {
    if let Ok(dict) = group.cast::<PyDict>() {
        return dict.iter().map(|(name, object)| Ok((name.str()?.to_string(), object))).collect();
    }
    if group.is_instance_of::<PyList>() || group.is_instance_of::<PyTuple>() {
        let objects = group.try_iter()?.enumerate();
        return objects.map(|(index, object)| Ok((format!("{kind}[{index}]"), object?))).collect();
    }
    Err(PyTypeError::new_err(format!(
        "{kind} must be a dict of name to object or a list, e.g. {kind}={{'name': obj}}; got {}",
        group.repr()?
    )))
}
