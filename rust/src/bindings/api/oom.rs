//! The rescue after a CUDA out-of-memory error, and its diagnosis.

use std::collections::HashSet;

use pyo3::exceptions::{PyKeyboardInterrupt, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::bindings::registry::registry;
use crate::bindings::report::OomPy;
use crate::bindings::snapshot::take_snapshot;
use crate::bindings::torch::{release, PyTorch};
use crate::bindings::trace::{self, PyNamer};
use crate::bindings::trace_recording;
use crate::fork::PerProcess;
use crate::holders_walk::LEAK_MIN_BYTES;
use crate::oom_rescue::observed::{self, Observed, PoolBytes};
use crate::oom_rescue::{self, RecorderState, RescueWorld};
use crate::recorder::{LiveBlocks, OomRecord, StepEnd};
use crate::report::{FailedLine, Holders};
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

    fn recorder(&self) -> RecorderState {
        let registry = registry();
        match (registry.flight_recorder, registry.gpuexp_active()) {
            (false, _) => RecorderState::Off,
            (true, false) => RecorderState::Idle,
            (true, true) => RecorderState::Wanted,
        }
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

    fn holders(&self, torch_index: u32) -> PyResult<Result<Holders, String>> {
        let Some(adapter) = self.adapter else { return Ok(Err("no notebook namespace to search from".into())) };
        let memory = crate::bindings::holders::Memory::Cuda(torch_index);
        let roots = crate::bindings::holders::hunt_roots(adapter)?;
        match crate::bindings::holders::hunt(self.py, memory, roots, LEAK_MIN_BYTES, &HashSet::new()) {
            Ok((holders, _, _)) => Ok(Ok(holders)),
            // A KeyboardInterrupt leaves as itself.
            Err(e) if e.is_instance_of::<PyKeyboardInterrupt>(self.py) => Err(e),
            Err(e) => Ok(Err(e.to_string())),
        }
    }
}

/// `gpuexp.oom_frames.failed_frames`'s answer: the frames (file, line, function) innermost
/// first, the failing module's path and the layers one pass runs through its numbered containers.
type FailedFrames = (Vec<(String, u32, String)>, Option<String>, Option<u64>);

/// The failed line and module from the exception's traceback (python/gpuexp/oom_frames.py).
fn failed_line(py: Python, error: &Bound<PyAny>) -> Option<FailedLine> {
    let found = py.import("gpuexp.oom_frames").and_then(|m| m.call_method1("failed_frames", (error,))).ok()?;
    let (frames, module, pass_layers): FailedFrames = found.extract().ok()?;
    FailedLine::from_frames(&frames, module, pass_layers, &SiteRule::default(), &PyNamer::new(py))
}

/// Attaches gpuexp's out-of-memory observer to torch's allocator, once per process (torch keeps
/// every observer it is given, calls each at an OOM, and has no way to detach one). Called where
/// the flight recorder arms, so CUDA is initialised. An allocator that takes no observers
/// (`backend:cudaMallocAsync`) refuses it: the rescue then reads torch's message.
pub(in crate::bindings) fn attach_oom_observer(py: Python) {
    static ATTACHED: PerProcess<bool> = PerProcess::new(|| false);
    let mut attached = ATTACHED.lock();
    if *attached {
        return;
    }
    let torch = PyTorch::find(py);
    let (Some(torch), true) = (torch.torch.as_ref(), torch.cuda().is_some()) else { return };
    // Tried once: a refusal would only repeat.
    *attached = true;
    let _ = wrap_pyfunction!(oom_observed, py)
        .and_then(|observer| torch.getattr("_C")?.call_method1("_cuda_attach_out_of_memory_observer", (observer,)));
}

/// Torch's allocator calls this at an out-of-memory error, before it raises, with the device,
/// the size it asked for, its limit (the memory fraction's cap, else the device's total) and the
/// device's free bytes. It returns at once where gpuexp is not active, reads the allocator's
/// figures with one stats call, and never raises: an error here would replace torch's.
#[pyfunction]
#[pyo3(signature = (*args))]
fn oom_observed(py: Python, args: &Bound<PyTuple>) {
    if !crate::bindings::recorder::wanted() {
        return;
    }
    let Ok((torch_index, requested, limit, free)) = args.extract::<(u32, u64, u64, u64)>() else { return };
    if let Some((allocated, reserved)) = pool_stats(py, torch_index) {
        observed::record(Observed { torch_index, requested, limit, free, allocated, reserved });
    }
}

/// Torch's allocated and reserved bytes on `torch_index`, by pool: one `_cuda_memoryStats` call.
fn pool_stats(py: Python, torch_index: u32) -> Option<(PoolBytes, PoolBytes)> {
    let torch = PyTorch::find(py);
    let stats = torch.torch.as_ref()?.getattr("_C").ok()?.call_method1("_cuda_memoryStats", (torch_index,)).ok()?;
    let pools = |group: &str| -> Option<PoolBytes> {
        let group = stats.get_item(group).ok()?;
        let current =
            |pool: &str| -> Option<u64> { group.get_item(pool).ok()?.get_item("current").ok()?.extract().ok() };
        Some(PoolBytes { all: current("all")?, large_pool: current("large_pool")?, small_pool: current("small_pool")? })
    };
    Some((pools("allocated_bytes")?, pools("reserved_bytes")?))
}
