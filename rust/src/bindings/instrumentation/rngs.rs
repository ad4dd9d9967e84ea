//! The four RNGs a step may draw from, read and set through torch, `random` and NumPy, for the
//! core's state saving ([`crate::step_state::Rng`], its order and labels): the estimate's saving
//! and a real step's by-value save (`gpuexp.saved_state.capture`) reach them through `PythonStep`.

use pyo3::prelude::*;

use crate::step_state::Rng;

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
