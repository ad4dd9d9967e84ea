//! The rescue after a CUDA out-of-memory error, and its diagnosis.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use super::registry::registry;
use super::report::OomPy;
use super::snapshot::take_snapshot;
use super::torch::{release, PyTorch};
use super::trace::{self, PyNamer};
use super::trace_recording;
use crate::recorder::SinceStep;
use crate::report::{self, FailedLine};
use crate::snapshot::{nvml, own_pids, GpuReading, GpuSelection, Snapshot};
use crate::teardown;
use crate::trace::SiteRule;

/// torch's own OutOfMemoryError, or the RuntimeError older torch raised with CUDA's message
/// while CUDA is in use. Never a look-alike: an error that merely mentions CUDA and "out of
/// memory" where torch has no CUDA is the user's, and its frames stay for `%debug`.
pub(super) fn is_cuda_oom(error: &Bound<PyAny>) -> bool {
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
pub(super) fn rescue_oom(py: Python, error: Bound<PyAny>, adapter: Option<Bound<PyAny>>) -> PyResult<Option<OomPy>> {
    // Taken for every error, so that a run's failure never outlives the exception it names.
    let training = registry().runs.position_at(error.as_ptr() as usize);
    if !is_cuda_oom(&error) || !registry().oom_rescue {
        return Ok(None);
    }
    let message = error.str()?.to_string();
    let (requested, device) = report::parse_oom_message(&message);
    let (before, _) = take_snapshot(py, &GpuSelection::AllVisible);
    // The traceback is read before the adapter clears its frames.
    let failed_line = failed_line(py, &error);
    let step = crate::recorder::last_step();
    let recorded = (before.gpus.iter())
        .find(|g| device.is_none_or(|index| g.torch_index == index))
        .and_then(|g| trace::last_oom(py, g.torch_index, requested, step));
    let failing_gpu = before.gpus.iter().find(|g| device.is_none_or(|index| g.torch_index == index));
    let (since_step, sites, live_blocks) = match (recorded, step) {
        (Some(recorded), _) => (recorded.since_step, recorded.sites, recorded.live),
        (None, None) => (SinceStep::NoStep, None, None),
        // The history was given back after the cell's first steps: levels and the allocator's state.
        (None, Some(step)) if step.level.is_some() => match failing_gpu.and_then(|g| Some((g.torch_index, g.torch?))) {
            Some((index, torch)) => (
                crate::recorder::since_level(Some(step), index, trace_recording::now_us(), torch.allocated),
                None,
                trace::live_in_state(py, index),
            ),
            None => (SinceStep::Unknown { step, why: no_record_why(py) }, None, None),
        },
        (None, Some(step)) => (SinceStep::Unknown { step, why: no_record_why(py) }, None, None),
    };
    let cleared = match &adapter {
        Some(adapter) => adapter.call_method1("drop_exception", (&error,))?.extract()?,
        None => Vec::new(),
    };
    let mut hints = Vec::new();
    for step in teardown::RELEASE {
        if let Err(e) = release(py, step) {
            hints.push(format!("rescue step {step:?} failed: {e}"));
        }
    }
    let (after, _) = take_snapshot(py, &GpuSelection::AllVisible);
    // The device torch's message names; another GPU's figures would only mislead.
    let pick = |s: &Snapshot| -> Option<GpuReading> {
        match device {
            Some(index) => s.gpus.iter().find(|g| g.torch_index == index).cloned(),
            None => s.gpus.first().cloned(),
        }
    };
    let (gpu_before, gpu_after) = (pick(&before), pick(&after));
    let others = gpu_before
        .as_ref()
        .map(|g| nvml::other_processes(&g.uuid, &own_pids()))
        .unwrap_or_default()
        .into_iter()
        .map(|(pid, used)| report::OtherProcess { pid, name: process_name(pid), used })
        .collect();
    let mut diagnosis = report::OomDiagnosis {
        message,
        torch_index: gpu_before.as_ref().map(|g| g.torch_index).or(device),
        requested,
        total: gpu_before.as_ref().map(|g| g.total),
        free_before: gpu_before.as_ref().map(|g| g.free),
        free_after: gpu_after.as_ref().map(|g| g.free),
        torch_allocated_before: gpu_before.as_ref().and_then(|g| g.torch).map(|t| t.allocated),
        torch_allocated_after: gpu_after.as_ref().and_then(|g| g.torch).map(|t| t.allocated),
        torch_reserved_before: gpu_before.as_ref().and_then(|g| g.torch).map(|t| t.reserved),
        process_used_before: gpu_before.as_ref().and_then(|g| g.process_used),
        others,
        hints: Vec::new(),
        cleared,
        training,
        sites,
        failed_line,
        since_step,
        live_blocks,
    };
    diagnosis.hints = diagnosis.hints();
    diagnosis.hints.extend(hints);
    Ok(Some(OomPy(diagnosis)))
}

/// The failed line and module from the exception's traceback (python/gpuexp/oom_frames.py).
fn failed_line(py: Python, error: &Bound<PyAny>) -> Option<FailedLine> {
    let found = py.import("gpuexp.oom_frames").and_then(|m| m.call_method1("failed_frames", (error,))).ok()?;
    let (frames, module): (Vec<(String, u32, String)>, Option<String>) = found.extract().ok()?;
    FailedLine::from_frames(&frames, module, &SiteRule::default(), &PyNamer::new(py))
}

/// Why no allocation record holds the OOM, for the diagnosis.
fn no_record_why(py: Python) -> String {
    if !registry().flight_recorder {
        return "the flight recorder is off: gpuexp.config(flight_recorder=True)".into();
    }
    if trace_recording::history_enabled(&PyTorch::find(py)) {
        "the allocation record holds no OOM of the size torch's message names".into()
    } else {
        "no allocation record ran: the recorder starts at the first cell or experiment after CUDA is initialised".into()
    }
}

fn process_name(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).map(|n| n.trim().to_string()).unwrap_or_else(|_| "?".into())
}
