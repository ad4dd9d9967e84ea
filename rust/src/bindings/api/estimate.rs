//! `gpuexp.estimate`, and the estimates the batch-size finder starts from: the user's step run
//! under torch's `FakeTensorMode`, with the real model's parameters, gradients, buffers and
//! optimizer state swapped for fake copies (`fakes`), and every storage the step makes or frees
//! entered in the core's [`Ledger`] by a dispatch mode. Nothing is allocated on the device; the
//! real tensors are never touched, and everything swapped is put back.

use std::time::Instant;

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::bindings::error::NoEstimate;
use crate::bindings::fakes::Fakes;
use crate::bindings::holders::Memory;
use crate::bindings::ledger_mode;
use crate::bindings::snapshot::take_snapshot;
use crate::bindings::step_state::{AssignedGlobal, Place, Roots, StepState};
use crate::bindings::torch::PyTorch;
use crate::estimate::{Estimate, Room};
use crate::estimate_run::{self, call_step, Estimating, Ran, Run, Swapped, Unready};
use crate::finder::Search;
use crate::snapshot::GpuSelection;

/// What a step reaches: its roots (the step, its closure, the globals it loads), the globals it
/// assigns and where each root is held. The one walk from them is the state's save
/// ([`StepState::save`]), which also finds the modules and optimizers whose tensors are swapped
/// for fakes: only those, so the categories are the step's own; a parameter it uses that is not
/// found stops the estimate (`ledger_mode`), never a real tensor's gradient set.
pub(in crate::bindings) struct StepReach<'py> {
    roots: Roots<'py>,
    assigned: Vec<AssignedGlobal<'py>>,
    places: Vec<Place<'py>>,
}

impl<'py> StepReach<'py> {
    pub(in crate::bindings) fn of(py: Python<'py>, step: &Bound<'py, PyAny>) -> PyResult<StepReach<'py>> {
        let (roots, assigned, places) = step_roots(py, step)?;
        Ok(StepReach { roots, assigned, places })
    }
}

/// Runs `step(batch)` under fake tensors on `memory` ([`estimate_run::run`]), a second time (up
/// to `calls`) when the first call created optimizer state, since later steps hold it through
/// their forward pass. Whatever happens, everything the step reaches is put back as it was.
pub(in crate::bindings) fn run_estimate<'py>(
    py: Python<'py>,
    step: &Bound<'py, PyAny>,
    batch: u64,
    memory: &Memory,
    reach: &StepReach<'py>,
    calls: u32,
) -> PyResult<Run> {
    let torch_device = py.import("sys")?.getattr("modules")?.get_item("torch")?.getattr("device")?;
    let target = match memory {
        Memory::Cuda(index) => torch_device.call1(("cuda", *index))?,
        _ => torch_device.call1(("cpu",))?,
    };
    let mut world = PythonEstimate { py, step, batch, memory, reach, calls, target, state: None, fakes: None };
    estimate_run::run(&mut world, &memory.label())
}

/// An estimate's world: the step and what it reaches, its saved state and its fakes while they are swapped in.
struct PythonEstimate<'a, 'py> {
    py: Python<'py>,
    step: &'a Bound<'py, PyAny>,
    batch: u64,
    memory: &'a Memory,
    reach: &'a StepReach<'py>,
    calls: u32,
    target: Bound<'py, PyAny>,
    state: Option<StepState<'py>>,
    fakes: Option<Fakes<'py>>,
}

impl<'py> Estimating for PythonEstimate<'_, 'py> {
    type Error = PyErr;

    fn save_state(&mut self) -> PyResult<()> {
        let reach = self.reach;
        self.state = Some(StepState::save(self.py, &reach.roots, &reach.assigned, &reach.places)?);
        Ok(())
    }

    fn swap_in_fakes(&mut self) -> PyResult<Swapped> {
        let (py, state) = (self.py, self.state.as_mut().expect("the state is saved first"));
        let fakes = Fakes::swap_in(py, state.owners(), self.target.clone())
            .map_err(|error| no_estimate(py, estimate_run::not_swapped(&error.value(py).to_string()), error))?;
        // On an error `fakes` is dropped here, which puts the real tensors back.
        state.fake_reached_tensors(&fakes.mode)?;
        let swapped =
            Swapped { fastpath_skipped: fakes.fastpath_skipped, loaded: fakes.loaded, scalers: state.scalers };
        self.fakes = Some(fakes);
        Ok(swapped)
    }

    fn run_ledger(&mut self) -> PyResult<Ran> {
        let (py, step, batch) = (self.py, self.step, self.batch);
        let fakes = self.fakes.as_ref().expect("the fakes are swapped in first");
        let state = self.state.as_ref().expect("the state is saved first");
        // What the step returns is kept until the ledger is read: an output outlives the step.
        let returned = PyList::empty(py);
        let ran = ledger_mode::run(fakes, state, self.memory, &self.target, |ledgered| {
            call_step(self.calls, || ledgered.call_method1("call_step", (step, batch, &returned))?.extract())
        });
        drop(returned);
        let (peak, (calls, mut notes), read_notes) = ran?;
        notes.extend(read_notes);
        Ok((peak, (calls, notes)))
    }

    /// Puts torch's own settings back; the real tensors come back with the saved state.
    fn swap_out_fakes(&mut self) -> PyResult<()> {
        self.fakes.take().map_or(Ok(()), |mut fakes| fakes.restore())
    }

    fn restore_state(&mut self) -> PyResult<Vec<String>> {
        self.state.take().expect("the state is saved first").restore()
    }

    fn not_restored(&self, error: PyErr, left: Vec<String>) -> PyErr {
        if stops(self.py, &error) {
            return error;
        }
        no_estimate(self.py, format!("{}; {}", error.value(self.py), left.join("; ")), error)
    }
}

/// A `NoEstimate` saying `message`, caused by `error`.
fn no_estimate(py: Python, message: String, error: PyErr) -> PyErr {
    let wrapped = NoEstimate::new_err(message);
    wrapped.set_cause(py, Some(error));
    wrapped
}

/// Where the step's modules and optimizers can be found from, the globals its code assigns to
/// (`global` names) with the namespace they are in, and where each root is held: `gpuexp.step_roots`
/// reads them from the step's code objects, which is only driving Python objects.
fn step_roots<'py>(py: Python<'py>, step: &Bound<'py, PyAny>) -> PyResult<StepRoots<'py>> {
    py.import("gpuexp.step_roots")?.call_method1("step_roots", (step,))?.extract()
}

/// A step's roots, the globals it assigns, and where each root is held.
type StepRoots<'py> = (Roots<'py>, Vec<AssignedGlobal<'py>>, Vec<Place<'py>>);

/// What the step is checked against on `memory`, read now. Without NVML the GPU's free memory
/// is unknown, and the estimate says so rather than failing.
fn room(py: Python, memory: &Memory, limit: Option<u64>) -> PyResult<Room> {
    match memory {
        Memory::Cuda(index) => {
            let (snapshot, torch) = take_snapshot(py, &GpuSelection::Only(vec![*index]));
            let stats = torch.read_stats(*index)?;
            let free = snapshot.gpus.iter().find(|g| g.torch_index == *index).map(|g| g.free);
            Ok(estimate_run::gpu_room(memory.label(), stats.allocated, stats.reserved, free, limit))
        }
        _ => Ok(estimate_run::host_room(limit)),
    }
}

/// Which memory an estimate counts ([`estimate_run::memory`]).
fn estimated_memory(py: Python, device: Option<u32>) -> PyResult<Memory> {
    let torch = PyTorch::find(py);
    estimate_run::memory(torch.torch.is_some(), torch.cuda().is_some(), device).map_err(|unready| match unready {
        Unready::NoTorch(why) => PyRuntimeError::new_err(why),
        Unready::NoCuda(why) => PyValueError::new_err(why),
    })
}

/// The one check that `step` is what `estimate`, `find_batch_size`, `fit` and `verify` take;
/// `call` shows it called, e.g. `estimate(train_step, 64)`. Raises TypeError naming both.
#[pyfunction]
pub(in crate::bindings) fn check_step(step: &Bound<PyAny>, call: &str) -> PyResult<()> {
    let got = if step.is_instance_of::<pyo3::types::PyType>() {
        format!(
            "the class {}, which calling would only build: pass a function that builds or uses it and runs \
             one training step, e.g. def train_step(batch_size): ...",
            step.getattr("__name__")?
        )
    } else if step.is_callable() {
        return Ok(());
    } else {
        step.repr()?.to_string()
    };
    Err(PyTypeError::new_err(format!("step must be a function of the batch size, e.g. {call}; got {got}")))
}

/// The prediction of ``gpuexp.estimate``: the peak a step will reach, and whether it fits.
/// ``str()`` and ``_repr_html_`` are its table.
#[pyclass(name = "Estimate", module = "gpuexp", frozen)]
pub(in crate::bindings) struct EstimatePy(Estimate);

#[pymethods]
impl EstimatePy {
    /// The predicted peak of torch allocated above what is allocated now, in bytes.
    #[getter]
    fn peak(&self) -> u64 {
        self.0.peak
    }
    /// The batch size the step was run at.
    #[getter]
    fn batch_size(&self) -> u64 {
        self.0.batch_size
    }
    /// Where the step would run: ``cuda:N`` or ``cpu``.
    #[getter]
    fn device(&self) -> &str {
        &self.0.device
    }
    /// What was live at the peak, in bytes by category.
    #[getter]
    fn categories<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        crate::bindings::report::json_to_python(
            py,
            &serde_json::to_string(&self.0.categories).expect("categories serialise"),
        )
    }
    /// Whether the peak fits the device's free memory (NVML's free plus torch's cache; for the
    /// host, its available memory).
    #[getter]
    fn fits_free_memory(&self) -> bool {
        self.0.fits.iter().any(|f| f.against == "free memory" && f.fits)
    }
    /// Whether what is allocated now plus the peak fits ``limit=``; None without a limit.
    #[getter]
    fn fits_limit(&self) -> Option<bool> {
        self.0.fits.iter().find(|f| f.against == "limit").map(|f| f.fits)
    }
    /// How long the estimate took, in seconds.
    #[getter]
    fn seconds(&self) -> f64 {
        self.0.seconds
    }
}

shown_as_table!(EstimatePy, |this| &this.0, this.0.grid());

/// `gpuexp.estimate`: the step's peak at one batch size, predicted without running it.
#[pyfunction]
#[pyo3(signature = (step, batch_size, *, memory=None, limit=None, steps=1))]
pub(in crate::bindings) fn estimate(
    py: Python,
    step: Bound<PyAny>,
    batch_size: u64,
    memory: Option<u32>,
    limit: Option<u64>,
    steps: u32,
) -> PyResult<EstimatePy> {
    check_step(&step, "estimate(train_step, 64)")?;
    let memory = estimated_memory(py, memory)?;
    let started = Instant::now();
    let reach = StepReach::of(py, &step)?;
    let run = run_estimate(py, &step, batch_size, &memory, &reach, steps)?;
    let room = room(py, &memory, limit)?;
    let seconds = started.elapsed().as_secs_f64();
    Ok(EstimatePy(Estimate::new(batch_size, run.calls, run.peak, &room, seconds, run.notes)))
}

/// Starts `search` from estimates of `step` on cuda:`index` ([`Search::seed_by`]). A step that
/// can't run under fake tensors leaves the search to its trials, and the search's table says why;
/// a Ctrl-C or an exit during an estimate stops the search, raised as itself.
pub(in crate::bindings) fn seed_search(
    py: Python,
    search: &mut Search,
    step: &Bound<PyAny>,
    index: u32,
    progress: bool,
) -> PyResult<()> {
    let (started, memory, steps) = (Instant::now(), Memory::Cuda(index), search.settings.steps_per_trial);
    let mut ready = None;
    let mut estimate = |batch| -> PyResult<(u64, u32)> {
        if ready.is_none() {
            ready = Some((StepReach::of(py, step)?, room(py, &memory, None)?.now));
        }
        let (reach, now) = ready.as_ref().expect("made above");
        let run = run_estimate(py, step, batch, &memory, reach, steps)?;
        Ok((now + run.peak.above_start, run.calls))
    };
    let shown = |line: String| -> PyResult<()> {
        if progress {
            py.import("builtins")?.call_method1("print", (line,))?;
        }
        Ok(())
    };
    let stopped = std::cell::RefCell::new(None);
    let said = |error: PyErr| {
        let text = error.value(py).to_string();
        if stops(py, &error) {
            *stopped.borrow_mut() = Some(error);
        }
        text
    };
    search.seed_by(started, |batch| estimate(batch).map_err(said), |line| shown(line).map_err(said));
    stopped.into_inner().map_or(Ok(()), Err)
}

/// `gpuexp.estimating()`: whether gpuexp is running a step on fake tensors on this thread now
/// (an estimate, `fit`'s options, the finder's seed), so that a step can skip what needs its
/// tensors' values then (a print of `loss.item()`, a branch on it).
#[pyfunction]
pub(in crate::bindings) fn estimating() -> bool {
    crate::scalar_reads::estimating()
}

/// Whether `error` is a Ctrl-C or an exit, which leaves an estimate as itself, never as `NoEstimate`.
pub(in crate::bindings) fn stops(py: Python, error: &PyErr) -> bool {
    error.is_instance_of::<pyo3::exceptions::PyKeyboardInterrupt>(py)
        || error.is_instance_of::<pyo3::exceptions::PySystemExit>(py)
}
