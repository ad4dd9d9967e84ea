//! The flight recorder, on by default (`gpuexp.config(flight_recorder=False)` turns it off):
//! while gpuexp is active (an experiment open, or the cell log on), torch's allocation history
//! runs without stacks, so that an out-of-memory error that nobody traced still shows what grew
//! since the last completed step and what was live (`crate::recorder`). It joins at a cell's
//! start or an experiment's opening once torch is imported with CUDA initialised (it never
//! imports torch or creates a context), as one client of the recording's lease, and leaves as
//! soon as gpuexp is no longer active. While it holds its share, torch's global optimizer step
//! hook marks each completed step (python/gpuexp/steps.py).

use std::sync::Mutex;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::registry::registry;
use super::torch::PyTorch;
use super::trace_recording;
use crate::recorder::{self, StepKind};
use crate::recording_lease::HistoryMode;

/// The process that holds the recorder's share (a forked child holds none of its parent's).
static HELD: Mutex<Option<u32>> = Mutex::new(None);

pub(super) fn held() -> bool {
    let held = HELD.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    *held == Some(crate::fork::pid())
}

fn set_held(on: bool) {
    *HELD.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = on.then(crate::fork::pid);
}

fn wanted() -> bool {
    let registry = registry();
    registry.flight_recorder && registry.gpuexp_active()
}

/// At a cell's start and an experiment's opening: joins the recording where gpuexp is active,
/// the recorder is on and torch has CUDA initialised. Cheap when held or not wanted.
#[pyfunction]
pub(super) fn arm_recorder(py: Python) {
    super::trace_sampling::arm(py);
    if held() || !wanted() || PyTorch::find(py).cuda().is_none() {
        return;
    }
    if trace_recording::join(py, HistoryMode::Events).is_ok() {
        set_held(true);
        super::trace_sampling::step_hook(py);
    }
}

/// Where gpuexp may have stopped being active (an experiment finished, the log turned off) or
/// the recorder was turned off: its share is given back, and the recording stops where gpuexp
/// started it and no traced experiment or cell log still needs it.
pub(super) fn settle(py: Python) {
    if !held() || wanted() {
        return;
    }
    set_held(false);
    super::trace_sampling::step_hook(py);
    if let Some(note) = trace_recording::leave(py, HistoryMode::Events) {
        let _ = py.import("gpuexp.ipython").and_then(|m| m.call_method1("warn", (note,)));
    }
}

/// A step completed ("optimizer step", "trainer step", "finder step" or "cell"): the OOM
/// diagnosis counts what grew from the latest one, and a traced experiment's sampled stacks
/// may switch on or off for the next.
#[pyfunction]
pub(super) fn mark_step(py: Python, kind: &str) -> PyResult<()> {
    let kind = StepKind::parse(kind).ok_or_else(|| {
        PyValueError::new_err(format!(
            "mark_step: {kind:?} is not \"optimizer step\", \"trainer step\", \"finder step\" or \"cell\""
        ))
    })?;
    step_completed(py, kind);
    Ok(())
}

/// A step of `kind` completed: marked for the OOM diagnosis and the sampled stacks.
pub(super) fn step_completed(py: Python, kind: StepKind) {
    recorder::mark_step(kind, trace_recording::now_us());
    super::trace_sampling::step_ended(py, kind);
}
