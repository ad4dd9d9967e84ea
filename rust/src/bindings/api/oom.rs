//! The rescue after a CUDA out-of-memory error, and its diagnosis.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use crate::bindings::registry::registry;
use crate::bindings::report::OomPy;
use crate::bindings::snapshot::take_snapshot;
use crate::bindings::torch::{release, PyTorch};
use crate::bindings::trace::{self, PyNamer};
use crate::bindings::trace_recording;
use crate::oom_rescue::{self, RescueWorld};
use crate::recorder::{LiveBlocks, OomRecord, StepEnd};
use crate::report::FailedLine;
use crate::snapshot::{GpuSelection, Snapshot};
use crate::teardown::Step;
use crate::trace::SiteRule;

/// torch's own OutOfMemoryError, or the RuntimeError older torch raised with CUDA's message
/// while CUDA is in use. Never a look-alike: an error that merely mentions CUDA and "out of
/// memory" where torch has no CUDA is the user's, and its frames stay for `%debug`.
pub(in crate::bindings) fn is_cuda_oom(error: &Bound<PyAny>) -> bool {
    let torch = PyTorch::find(error.py());
    let Some(module) = torch.torch.as_ref() else { return false };
    if let Ok(oom) = module.getattr("OutOfMemoryError") {
        if error.is_instance(&oom).unwrap_or(false) {
            return true;
        }
    }
    let message = error.str().map(|m| m.to_string()).unwrap_or_default();
    torch.cuda().is_some()
        && error.get_type().is(error.py().get_type::<PyRuntimeError>())
        && message.contains("CUDA out of memory")
}

/// The rescue after a cell's error, when it is a CUDA out-of-memory error and the rescue is on
/// (`config(oom_rescue=)`): the adapter clears the failed cell's frames and the references to
/// its exception, then memory is released as at a teardown. Returns the diagnosis (what was
/// asked for, what the device had, what came back), or None when there was nothing to rescue.
#[pyfunction]
#[pyo3(signature = (error, adapter=None))]
pub(in crate::bindings) fn rescue_oom(
    py: Python,
    error: Bound<PyAny>,
    adapter: Option<Bound<PyAny>>,
) -> PyResult<Option<OomPy>> {
    // Taken for every error, so that a run's failure never outlives the exception it names.
    let training = registry().runs.position_at(error.as_ptr() as usize);
    if !is_cuda_oom(&error) || !registry().oom_rescue {
        return Ok(None);
    }
    let message = error.str()?.to_string();
    let world = PyRescue { py, error: &error, adapter: adapter.as_ref() };
    Ok(Some(OomPy(oom_rescue::rescue(&world, message, training)?)))
}

/// The rescue's world: the exception, the kernel's adapter, torch.
struct PyRescue<'a, 'py> {
    py: Python<'py>,
    error: &'a Bound<'py, PyAny>,
    adapter: Option<&'a Bound<'py, PyAny>>,
}

impl RescueWorld for PyRescue<'_, '_> {
    type Error = PyErr;

    fn snapshot(&self) -> Snapshot {
        take_snapshot(self.py, &GpuSelection::AllVisible).0
    }

    fn failed_line(&self) -> Option<FailedLine> {
        failed_line(self.py, self.error)
    }

    fn last_oom(&self, torch_index: u32, requested: Option<u64>, step: Option<StepEnd>) -> Option<OomRecord> {
        trace::last_oom(self.py, torch_index, requested, step)
    }

    fn live_in_state(&self, torch_index: u32) -> Option<LiveBlocks> {
        trace::live_in_state(self.py, torch_index)
    }

    fn flight_recorder_on(&self) -> bool {
        registry().flight_recorder
    }

    fn history_enabled(&self) -> bool {
        trace_recording::history_enabled(&PyTorch::find(self.py))
    }

    fn clear_frames(&self) -> PyResult<Vec<String>> {
        match self.adapter {
            Some(adapter) => adapter.call_method1("drop_exception", (self.error,))?.extract(),
            None => Ok(Vec::new()),
        }
    }

    fn release(&self, step: Step) -> Result<(), String> {
        release(self.py, step).map_err(|e| e.to_string())
    }
}

/// The failed line and module from the exception's traceback (python/gpuexp/oom_frames.py).
fn failed_line(py: Python, error: &Bound<PyAny>) -> Option<FailedLine> {
    let found = py.import("gpuexp.oom_frames").and_then(|m| m.call_method1("failed_frames", (error,))).ok()?;
    let (frames, module): (Vec<(String, u32, String)>, Option<String>) = found.extract().ok()?;
    FailedLine::from_frames(&frames, module, &SiteRule::default(), &PyNamer::new(py))
}
