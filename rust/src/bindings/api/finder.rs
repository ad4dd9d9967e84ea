//! `gpuexp.find_batch_size`: the whole search in one call. Rust drives it: it estimates the
//! step's peak under fake tensors where it can, caps torch at `limit`, asks the search for each
//! trial, runs the user's step, measures torch's exact peaks, cleans up after an out-of-memory
//! error and restores everything at the end.

use std::time::Instant;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use crate::bindings::estimate::{check_step, seed_search};
use crate::bindings::interrupts;
use crate::bindings::ranks;
use crate::bindings::registry::registry;
use crate::bindings::snapshot::{reset_counters, take_snapshot};
use crate::bindings::torch::{apply_limit, release, restore_limit, PyTorch};
use crate::finder::{self, Lab, Outcome, Role, Search, Settings, Trial, TrialEnd};
use crate::snapshot::GpuSelection;
use crate::teardown;

/// The search ``gpuexp.find_batch_size`` ran: every trial, the fit, the answer. ``str()`` and
/// ``_repr_html_`` are its table.
#[pyclass(name = "BatchSizeResult", module = "gpuexp", frozen)]
pub(in crate::bindings) struct BatchSizeResultPy(pub(in crate::bindings) Search);

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
pub(in crate::bindings) fn find_batch_size<'py>(
    py: Python<'py>,
    step: Bound<'py, PyAny>,
    start: u64,
    max: u64,
    device: Option<u32>,
    limit: Option<u64>,
    margin: Option<f64>,
    power_of_two: bool,
    multiple_of: u64,
    verifications: u32,
    steps: u32,
    progress: Option<Bound<'py, PyAny>>,
    estimate: bool,
    ranks_timeout: f64,
    adapter: Bound<'py, PyAny>,
    want: Option<u64>,
) -> PyResult<BatchSizeResultPy> {
    check_step(&step, "find_batch_size(train_step)")?;
    let margin = Settings::margin_or_default(margin, limit)?;
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
    let mut lab =
        PyLab { py, step, cuda, index, progress, adapter, ranks_timeout, limited: Vec::new(), interrupts: None };
    finder::find(&mut search, &mut lab, limit, estimate)?;
    let wanted = want.unwrap_or(max);
    if let Some(answer) = search.batch_size.filter(|answer| estimate && search.seed.is_some() && *answer < wanted) {
        // What would raise it: gpuexp.fit at the batch wanted, under fake tensors.
        let hint = py
            .import("gpuexp.fit")
            .and_then(|fit| fit.call_method1("finder_hint", (&lab.step, wanted, limit, index, answer)));
        search.raised = match hint.and_then(|hint| hint.extract::<Option<String>>()) {
            Ok(raised) => raised,
            Err(error) => {
                Some(format!("gpuexp.fit(step, {wanted}) could not say what would raise it: {}", error.value(py)))
            }
        };
    }
    Ok(BatchSizeResultPy(search))
}

/// The user's step on one GPU under torch, for the core's search.
struct PyLab<'py> {
    py: Python<'py>,
    step: Bound<'py, PyAny>,
    cuda: Bound<'py, PyAny>,
    index: u32,
    progress: Option<Bound<'py, PyAny>>,
    adapter: Bound<'py, PyAny>,
    ranks_timeout: f64,
    /// Torch's memory fraction before the cap, restored after.
    limited: Vec<(u32, f64)>,
    interrupts: Option<interrupts::HeldInterrupts<'py>>,
}

impl Lab for PyLab<'_> {
    type Error = PyErr;

    fn seed(&mut self, search: &mut Search) -> PyResult<()> {
        seed_search(self.py, search, &self.step, self.index, self.progress.is_some())
    }
    fn apply_limit(&mut self, limit: u64) -> PyResult<()> {
        self.limited = apply_limit(self.py, &GpuSelection::Only(vec![self.index]), limit)?;
        Ok(())
    }
    fn restore_limit(&mut self) -> PyResult<()> {
        restore_limit(self.py, &std::mem::take(&mut self.limited))
    }
    fn release_between_trials(&mut self) -> PyResult<()> {
        release_between_trials(self.py)
    }
    fn trial(&mut self, batch: u64, role: Role, steps: u32) -> PyResult<Trial> {
        run_trial(self.py, &self.step, &self.cuda, batch, self.index, steps, role, &self.adapter)
    }
    fn progress(&mut self, line: &str, search: &Search) -> PyResult<()> {
        if let Some(progress) = &self.progress {
            progress.call_method1("update", (line, search.grid().to_html()))?;
        }
        Ok(())
    }
    fn finished(&mut self, search: &Search) -> PyResult<()> {
        if let Some(progress) = &self.progress {
            let grid = search.grid();
            progress.call_method1("finish", (grid.title.as_str(), grid.to_html()))?;
        }
        Ok(())
    }
    fn hold_interrupts(&mut self) {
        self.interrupts = Some(interrupts::hold(self.py));
    }
    fn release_interrupts(&mut self) -> bool {
        self.interrupts.take().is_some_and(|held| held.release(self.py))
    }
    fn interrupted(&self) -> PyErr {
        interrupts::interrupted()
    }
    fn agree_across_ranks(&mut self, search: &mut Search) -> PyResult<()> {
        ranks::agree_across_ranks(self.py, search, self.ranks_timeout).map(drop)
    }
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
            crate::bindings::recorder::step_completed(py, crate::recorder::StepKind::FinderStep);
            Ok(())
        })
        .and_then(|()| {
            cuda.call_method1("synchronize", (index,))?;
            Ok(())
        });
    let seconds = started.elapsed().as_secs_f64();
    let (end, _) = take_snapshot(py, &GpuSelection::AllVisible);
    let peaks = registry().close_torch_window(window, &end, index);
    let outcome = match TrialEnd::of(ran, |error| is_oom(py, error), peaks, index) {
        TrialEnd::Fit(outcome) => outcome,
        TrialEnd::OutOfMemory(error) => {
            // As the OOM rescue does: the failed step's frames must let go of its tensors.
            let held = interrupts::hold(py);
            let dropped = adapter.call_method1("drop_exception", (error.value(py),)).map(drop);
            drop(error);
            let released = release_between_trials(py);
            held.release_and_raise(py)?;
            dropped.and(released)?;
            Outcome::OutOfMemory
        }
        TrialEnd::Failed(error) => return Err(error),
    };
    Ok(Trial { batch, outcome, seconds, role })
}

fn is_oom(py: Python, error: &PyErr) -> bool {
    crate::bindings::oom::is_cuda_oom(error.value(py).as_any())
}

/// What a step's torch peak may use on a GPU (see [`Settings::usable`]).
fn usable_memory(py: Python, device: u32, limit: Option<u64>) -> PyResult<u64> {
    Ok(Settings::usable_on(&take_snapshot(py, &GpuSelection::AllVisible).0, device, limit)?)
}

/// gc and torch's cache, between trials and after a failed one (cuBLAS's workspaces stay).
fn release_between_trials(py: Python) -> PyResult<()> {
    teardown::BETWEEN_TRIALS.iter().try_for_each(|step| release(py, *step))
}
