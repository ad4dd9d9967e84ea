//! The four RNGs a step may draw from, read and set through torch, `random` and NumPy, for the
//! core's state saving ([`crate::step_state::Rng`], its order and labels): the estimate's saving
//! reaches them through `PythonStep`, a real step's by-value save (`gpuexp.saved_state.capture`)
//! through `save_rngs`.

use pyo3::prelude::*;

use crate::bindings::step_state::{PythonStep, Saved};
use crate::step_state::{self, Rng};

/// The state of `rng`, read through torch, `random` or NumPy; None where it is not there (CUDA
/// not initialised, NumPy not imported).
pub(in crate::bindings) fn read_rng<'py>(torch: &Bound<'py, PyAny>, rng: Rng) -> PyResult<Option<Bound<'py, PyAny>>> {
    let py = torch.py();
    let state = match rng {
        Rng::TorchCpu => torch.call_method0("get_rng_state")?,
        Rng::TorchCuda => {
            let cuda = torch.getattr("cuda")?;
            if !cuda.call_method0("is_initialized")?.is_truthy()? {
                return Ok(None);
            }
            cuda.call_method0("get_rng_state_all")?
        }
        Rng::Python => py.import("random")?.call_method0("getstate")?,
        Rng::NumPy => match py.import("sys")?.getattr("modules")?.get_item("numpy") {
            Ok(numpy) => numpy.getattr("random")?.call_method0("get_state")?,
            Err(_) => return Ok(None),
        },
    };
    Ok(Some(state))
}

/// Sets `rng` back to `state`.
pub(in crate::bindings) fn put_back_rng<'py>(
    torch: &Bound<'py, PyAny>,
    rng: Rng,
    state: &Bound<'py, PyAny>,
) -> PyResult<()> {
    let py = torch.py();
    match rng {
        Rng::TorchCpu => torch.call_method1("set_rng_state", (state,)),
        Rng::TorchCuda => torch.getattr("cuda")?.call_method1("set_rng_state_all", (state,)),
        Rng::Python => py.import("random")?.call_method1("setstate", (state,)),
        Rng::NumPy => py.import("numpy")?.getattr("random")?.call_method1("set_state", (state,)),
    }
    .map(drop)
}

/// The four RNGs saved by the core's state saving ([`step_state::save_rngs`]), for a real
/// step's by-value save (`gpuexp.saved_state.capture`): `restore()` puts them back.
#[pyclass(name = "SavedRngs", module = "gpuexp._core", unsendable)]
pub(in crate::bindings) struct SavedRngs(Vec<(Rng, Py<PyAny>)>);

#[pymethods]
impl SavedRngs {
    /// Puts every RNG back; each one that could not be, as "name (Error: message)".
    fn restore(&self, py: Python) -> PyResult<Vec<String>> {
        let torch = py.import("sys")?.getattr("modules")?.get_item("torch")?;
        let mut failed = Vec::new();
        for (rng, state) in &self.0 {
            if let Err(error) = put_back_rng(&torch, *rng, state.bind(py)) {
                let kind = error.get_type(py).name().map(|n| n.to_string()).unwrap_or_default();
                failed.push(format!("{} ({kind}: {})", rng.label(), error.value(py)));
            }
        }
        Ok(failed)
    }
}

/// Saves the CPU RNG, every initialised CUDA device's, Python's `random` and NumPy's global RNG.
#[pyfunction]
pub(in crate::bindings) fn save_rngs(py: Python) -> PyResult<SavedRngs> {
    let mut step = PythonStep::find(py, &[], &[])?;
    let saved = step_state::save_rngs(&mut step)?;
    let states = saved.into_iter().filter_map(|(rng, saved)| match saved {
        Saved::Rng(_, state) => Some((rng, state.unbind())),
        _ => None,
    });
    Ok(SavedRngs(states.collect()))
}
