//! Sampled stacks for traced experiments (`crate::stack_sampling` decides): while one is open,
//! each step end (torch's optimizer step hook, a trainer's step, the finder's) may switch torch's
//! history between stacks and none, through the recording lease's ceiling, and put the module
//! hooks on or take them off with it. The step marks go into every snapshot of the recording
//! (the `gpuexp` key's `steps`), so the replay knows which steps recorded stacks.
//! `gpuexp.config(trace_sampling=False)` keeps stacks on every step.

use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::prelude::*;

use crate::bindings::trace_recording;
use crate::fork::{Guard, PerProcess};
use crate::recorder::StepKind;
use crate::stack_sampling::StackSampler;
use crate::trace::StepMark;

/// A forked child's recording is its own: its sampler starts afresh.
static SAMPLER: PerProcess<StackSampler> = PerProcess::new(StackSampler::new);

/// `gpuexp.config(trace_sampling=)`, a setting (a forked child keeps it).
static ENABLED: AtomicBool = AtomicBool::new(true);

fn sampler() -> Guard<'static, StackSampler> {
    SAMPLER.lock()
}

/// `gpuexp.config(trace_sampling=)`: from the next traced experiment's opening on.
pub(in crate::bindings) fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

pub(in crate::bindings) fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

pub(in crate::bindings) fn active() -> bool {
    sampler().active()
}

/// A traced experiment opened at `opened_us` with its share of the recording (stacks on).
pub(in crate::bindings) fn begin(py: Python, opened_us: i64) {
    sampler().begin(opened_us, enabled());
    step_hook(py);
}

/// A traced experiment finished (its snapshot read): the last one gives the clients left their
/// stacks back.
pub(in crate::bindings) fn end(py: Python) {
    let restore = sampler().end(trace_recording::now_us());
    if restore {
        trace_recording::set_stacks(py, true);
    }
    step_hook(py);
}

/// A step of `kind` ended: the sampler's decision carried out.
pub(in crate::bindings) fn step_ended(py: Python, kind: StepKind) {
    let now_us = trace_recording::now_us();
    let wanted = sampler().step_ended(kind, now_us);
    if let Some(stacks) = wanted {
        let recorded = trace_recording::set_stacks(py, stacks);
        sampler().switched(now_us, recorded);
    }
}

/// At a cell's start while a traced experiment samples: torch's optimizer step hook, where the
/// opening found `torch.optim` not imported yet.
pub(in crate::bindings) fn arm(py: Python) {
    if active() {
        step_hook(py);
    }
}

/// Torch's optimizer step hook runs while the flight recorder is wanted or a traced experiment
/// samples; it is removed when neither is.
fn step_hook(py: Python) {
    let wanted = crate::bindings::recorder::wanted() || active();
    let _ =
        py.import("gpuexp.steps").and_then(|steps| steps.call_method0(if wanted { "install" } else { "uninstall" }));
}

/// The step marks, for the snapshot's `gpuexp` key (none: no traced experiment yet).
pub(in crate::bindings) fn marks() -> Vec<StepMark> {
    sampler().marks()
}
