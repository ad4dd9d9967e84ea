//! The flight recorder, on by default (`gpuexp.config(flight_recorder=False)` turns it off):
//! while gpuexp is active (an experiment open, or the cell log on), an out-of-memory error that
//! nobody traced still shows what grew since the last completed step and what was live
//! (`crate::recorder`). It arms at a cell's start or an experiment's opening once torch is
//! imported with CUDA initialised (it never imports torch or creates a context): torch's
//! allocation history then runs without stacks, as one client of the recording's lease, for the
//! first steps the core's schedule names, and each later step's end reads one level. Torch's
//! global optimizer step hook marks each completed step (python/gpuexp/steps.py); the recorder
//! leaves as soon as gpuexp is no longer active.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::bindings::registry::registry;
use crate::bindings::torch::PyTorch;
use crate::bindings::trace_recording;
use crate::recorder::{self, HistoryChange, Level, StepKind};

pub(in crate::bindings) fn wanted() -> bool {
    let registry = registry();
    registry.flight_recorder && registry.gpuexp_active()
}

/// Installs or removes the optimizer step hook (a failure only loses the step marks).
fn step_hook(py: Python, method: &str) {
    let _ = py.import("gpuexp.steps").and_then(|steps| steps.call_method0(method));
}

/// Carries out the schedule's change to the recorder's share of torch's history.
fn change_history(py: Python, change: HistoryChange) {
    if let Some(note) = recorder::change_history(&trace_recording::PyMemory::new(py), change) {
        let _ = py.import("gpuexp.ipython").and_then(|m| m.call_method1("warn", (note,)));
    }
}

/// At a cell's start and an experiment's opening: arms the recorder where gpuexp is active, the
/// recorder is on and torch has CUDA initialised (its first steps then run with the history).
#[pyfunction]
pub(in crate::bindings) fn arm_recorder(py: Python) {
    crate::bindings::trace_sampling::arm(py);
    if !wanted() || PyTorch::find(py).cuda().is_none() {
        return;
    }
    crate::bindings::oom::attach_oom_observer(py);
    change_history(py, recorder::arm());
    step_hook(py, "install");
}

/// Where gpuexp may have stopped being active (an experiment finished, the log turned off) or
/// the recorder was turned off: its share is given back, and the recording stops where gpuexp
/// started it and no traced experiment or cell log still needs it.
pub(in crate::bindings) fn settle(py: Python) {
    if wanted() {
        return;
    }
    change_history(py, recorder::disarm());
    if !crate::bindings::trace_sampling::active() {
        step_hook(py, "uninstall");
    }
}

/// Torch's allocated bytes on the current device: one allocator stats call, no context made.
fn level(py: Python) -> Option<Level> {
    let torch = PyTorch::find(py);
    let torch_index = torch.cuda()?.call_method0("current_device").ok()?.extract().ok()?;
    let allocated = torch.read_stats(torch_index).ok()?.allocated;
    Some(Level { torch_index, allocated })
}

/// A step completed ("optimizer step", "trainer step", "finder step" or "cell"): the OOM
/// diagnosis counts what grew from the latest one, the recorder's schedule moves on, and a
/// traced experiment's sampled stacks may switch on or off for the next.
#[pyfunction]
pub(in crate::bindings) fn mark_step(py: Python, kind: &str) -> PyResult<()> {
    let kind = StepKind::parse(kind).ok_or_else(|| {
        PyValueError::new_err(format!(
            "mark_step: {kind:?} is not \"optimizer step\", \"trainer step\", \"finder step\" or \"cell\""
        ))
    })?;
    step_completed(py, kind);
    Ok(())
}

/// A step of `kind` completed (the optimizer hook's, a trainer's, the finder's or a cell's): its
/// end, with a level where the schedule wants one, and the schedule's change to the history.
pub(in crate::bindings) fn step_completed(py: Python, kind: StepKind) {
    let now_us = trace_recording::now_us();
    let level = if recorder::wants_level(kind, now_us) { level(py) } else { None };
    change_history(py, recorder::step_ended(kind, now_us, level));
    crate::bindings::trace_sampling::step_ended(py, kind);
}
