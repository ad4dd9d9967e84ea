//! `gpuexp.find_batch_size`: the whole search in one call. Rust drives it: it estimates the
//! step's peak under fake tensors where it can, caps torch at `limit`, asks the search for each
//! trial, runs the user's step, measures torch's exact peaks, cleans up after an out-of-memory
//! error and restores everything at the end.

use std::time::Instant;

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;

use super::estimate::seed_search;
use super::interrupts;
use super::ranks;
use super::registry::registry;
use super::snapshot::{reset_counters, take_snapshot};
use super::torch::{apply_limit, release, restore_limit, PyTorch};
use crate::finder::{Next, Outcome, Role, Search, Settings, Trial};
use crate::snapshot::{Gauge, GpuSelection};
use crate::teardown;
use crate::units;

/// The search ``gpuexp.find_batch_size`` ran: every trial, the fit, the answer. ``str()`` and
/// ``_repr_html_`` are its table.
#[pyclass(name = "BatchSizeResult", module = "gpuexp", frozen)]
pub(super) struct BatchSizeResultPy(pub(super) Search);

#[pymethods]
impl BatchSizeResultPy {
    /// The largest batch size that ran within the budget (None if none did).
    #[getter]
    fn batch_size(&self) -> Option<u64> {
        self.0.batch_size
    }
    /// How many trials the search ran.
    #[getter]
    fn trials(&self) -> usize {
        self.0.trials.len()
    }
    /// The answer in a sentence: what was found, against which budget, or why nothing was.
    #[getter]
    fn verdict(&self) -> &str {
        &self.0.verdict
    }
}

shown_as_table!(BatchSizeResultPy, |this| &this.0, this.0.grid());

/// Runs the search. The arguments are checked before anything touches the GPU. `adapter`
/// clears a failed step's frames, as the OOM rescue does, so its tensors can be freed.
/// `progress` (`gpuexp.live.Progress`) shows each trial as it ends: `update(line, html)` with
/// the trial's line and the table so far, and `finish(line, html)` once the search stops.
#[pyfunction]
#[pyo3(signature = (step, start, max, *, device=None, limit=None, margin=None, power_of_two=false, multiple_of=1,
                    verifications=2, steps=2, progress=None, estimate=true, ranks_timeout=600.0, adapter, want=None))]
#[allow(clippy::too_many_arguments)] // one per keyword of find_batch_size
pub(super) fn find_batch_size(
    py: Python,
    step: Bound<PyAny>,
    start: u64,
    max: u64,
    device: Option<u32>,
    limit: Option<u64>,
    margin: Option<f64>,
    power_of_two: bool,
    multiple_of: u64,
    verifications: u32,
    steps: u32,
    progress: Option<Bound<PyAny>>,
    estimate: bool,
    ranks_timeout: f64,
    adapter: Bound<PyAny>,
    want: Option<u64>,
) -> PyResult<BatchSizeResultPy> {
    if !step.is_callable() {
        return Err(PyTypeError::new_err(format!(
            "step must be a function of the batch size, e.g. find_batch_size(train_step); got {}",
            step.repr()?
        )));
    }
    // At a cap the allocator's rounding and fragmentation still need a little room.
    let margin = margin.unwrap_or(if limit.is_some() { 0.02 } else { 0.05 });
    if !(0.0..1.0).contains(&margin) {
        return Err(PyValueError::new_err(format!("margin must be a share below 1, e.g. margin=0.05; got {margin}")));
    }
    let settings =
        Settings { start, max, usable: 0, margin, power_of_two, multiple_of, verifications, steps_per_trial: steps };
    let mut search = Search::new(settings)?;

    let torch = PyTorch::find(py);
    let cuda_available = match torch.torch.as_ref() {
        Some(t) => t.getattr("cuda")?.call_method0("is_available")?.extract::<bool>()?,
        None => false,
    };
    if !cuda_available {
        return Err(PyRuntimeError::new_err(
            "find_batch_size measures torch's CUDA allocator: import torch on a machine with a CUDA GPU",
        ));
    }
    let cuda = torch.torch.as_ref().expect("checked above").getattr("cuda")?;
    let index: u32 = match device {
        Some(index) => index,
        None => cuda.call_method0("current_device")?.extract()?,
    };
    search.settings.usable = usable_memory(py, index, limit)?;
    if estimate {
        seed_search(py, &mut search, &step, index, progress.is_some());
    }

    let limited = match limit {
        Some(limit) => apply_limit(py, &GpuSelection::Only(vec![index]), limit)?,
        None => Vec::new(),
    };
    let searched = run_trials(py, &mut search, &step, &cuda, index, progress.as_ref(), &adapter);
    // The cap comes off and the cache empties whatever stopped the search, Ctrl-C included.
    let held = interrupts::hold(py);
    let restored = restore_limit(py, &limited);
    let released = release_between_trials(py);
    let interrupted = held.release(py);
    searched.and(restored).and(released)?;
    if interrupted {
        return Err(interrupts::interrupted());
    }
    // In a rank of a process group every rank must run one size: the largest that fits on all.
    ranks::agree_across_ranks(py, &mut search, ranks_timeout)?;
    let wanted = want.unwrap_or(max);
    if let Some(answer) = search.batch_size.filter(|answer| estimate && search.seed.is_some() && *answer < wanted) {
        // What would raise it: gpuexp.fit at the batch wanted, under fake tensors.
        let hint = py
            .import("gpuexp.fit")
            .and_then(|fit| fit.call_method1("finder_hint", (&step, wanted, limit, index, answer)));
        search.raised = match hint.and_then(|hint| hint.extract::<Option<String>>()) {
            Ok(raised) => raised,
            Err(error) => {
                Some(format!("gpuexp.fit(step, {wanted}) could not say what would raise it: {}", error.value(py)))
            }
        };
    }
    if let Some(progress) = &progress {
        let grid = search.grid();
        progress.call_method1("finish", (grid.title.as_str(), grid.to_html()))?;
    }
    Ok(BatchSizeResultPy(search))
}

fn run_trials(
    py: Python,
    search: &mut Search,
    step: &Bound<PyAny>,
    cuda: &Bound<PyAny>,
    index: u32,
    progress: Option<&Bound<PyAny>>,
    adapter: &Bound<PyAny>,
) -> PyResult<()> {
    let mut previous = None;
    while let Next::Try(batch, role) = search.next_trial() {
        if previous != Some(batch) {
            // Blocks cached at another size would fragment this one; repeats keep the steady state.
            release_between_trials(py)?;
        }
        previous = Some(batch);
        let trial = run_trial(py, step, cuda, batch, index, search.settings.steps_per_trial, role, adapter)?;
        let outcome = match trial.outcome {
            Outcome::Fit { peak, .. } => format!("peak {}", units::bytes(peak)),
            Outcome::OutOfMemory => "out of memory".into(),
        };
        let line = format!(
            "gpuexp: trial {} ({}) batch size {batch}: {outcome}, {:.2} s",
            search.trials.len() + 1,
            role.label(),
            trial.seconds
        );
        search.record(trial);
        if let Some(progress) = progress {
            progress.call_method1("update", (line, search.grid().to_html()))?;
        }
    }
    Ok(())
}

/// `steps` steps in a row at one batch size, in a peak window of their own: torch's exact
/// peaks, or an out-of-memory outcome after which the failed step's memory is given back.
#[allow(clippy::too_many_arguments)]
fn run_trial(
    py: Python,
    step: &Bound<PyAny>,
    cuda: &Bound<PyAny>,
    batch: u64,
    index: u32,
    steps: u32,
    role: Role,
    adapter: &Bound<PyAny>,
) -> PyResult<Trial> {
    let (start, torch) = take_snapshot(py, &GpuSelection::AllVisible);
    let window = registry().open_window(&start);
    reset_counters(&torch, &start);
    let started = Instant::now();
    let ran = (0..steps)
        .try_for_each(|_| {
            step.call1((batch,))?;
            // What grows after it counts towards an OOM that the finder does not catch.
            super::recorder::step_completed(py, crate::recorder::StepKind::FinderStep);
            Ok(())
        })
        .and_then(|()| {
            cuda.call_method1("synchronize", (index,))?;
            Ok(())
        });
    let seconds = started.elapsed().as_secs_f64();
    let (end, _) = take_snapshot(py, &GpuSelection::AllVisible);
    let peaks = {
        let mut registry = registry();
        match end.gpus.iter().find(|g| g.torch_index == index) {
            Some(gpu) => {
                let gauges = [Gauge::TorchAllocated(gpu.uuid.clone()), Gauge::TorchReserved(gpu.uuid.clone())];
                let [allocated, reserved] = registry.close_window(window, &end, gauges);
                allocated.zip(reserved)
            }
            None => {
                registry.peaks.close(window);
                None
            }
        }
    };
    let outcome = match (ran, peaks) {
        (Ok(()), Some((peak, reserved))) => Outcome::Fit { peak, reserved },
        (Ok(()), None) => return Err(PyValueError::new_err(format!("cuda:{index} is not a visible GPU"))),
        (Err(error), _) if is_oom(py, &error) => {
            // As the OOM rescue does: the failed step's frames must let go of its tensors.
            let held = interrupts::hold(py);
            let dropped = adapter.call_method1("drop_exception", (error.value(py),)).map(drop);
            drop(error);
            let released = release_between_trials(py);
            held.release_and_raise(py)?;
            dropped.and(released)?;
            Outcome::OutOfMemory
        }
        (Err(error), _) => return Err(error),
    };
    Ok(Trial { batch, outcome, seconds, role })
}

fn is_oom(py: Python, error: &PyErr) -> bool {
    super::oom::is_cuda_oom(error.value(py).as_any())
}

/// What a step's torch peak may use on a GPU: what torch holds plus what NVML has free, or `limit`.
fn usable_memory(py: Python, device: u32, limit: Option<u64>) -> PyResult<u64> {
    let (now, _) = take_snapshot(py, &GpuSelection::AllVisible);
    let gpu =
        now.gpus.iter().find(|g| g.torch_index == device).ok_or_else(|| {
            PyValueError::new_err(format!("cuda:{device} is not a visible GPU (or NVML cannot read it)"))
        })?;
    let torch = gpu.torch.unwrap_or_default();
    Ok(limit.unwrap_or(torch.reserved + gpu.free))
}

/// gc and torch's cache, between trials and after a failed one (cuBLAS's workspaces stay).
fn release_between_trials(py: Python) -> PyResult<()> {
    teardown::BETWEEN_TRIALS.iter().try_for_each(|step| release(py, *step))
}
