//! Training runs measured by a framework's callback (`gpuexp.integrations`): a scope becomes a
//! run, learns where the run stands (the batch's shapes read here, from the batch itself), logs
//! its intervals' peaks, and says how it ended.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyMapping, PyString, PyTuple};

use crate::bindings::registry::{registry, unknown};
use crate::bindings::snapshot::{reset_counters, take_snapshot};
use crate::scope::ScopeId;
use crate::snapshot::GpuSelection;
use crate::training::{interval_metrics, BatchPart, Interval};

/// The parts of a batch shown: a batch with more is a dataset, not a step's input.
const MAX_PARTS: usize = 16;
/// How deep a batch's containers are read (a dict of tuples of tensors is 2).
const MAX_DEPTH: usize = 4;

fn selection_of(id: ScopeId) -> PyResult<GpuSelection> {
    registry().scope(id).map(|s| s.selection.clone()).ok_or_else(|| unknown(id))
}

/// The open scope `id` measures a training run from now on: its first interval starts here.
#[pyfunction]
pub(in crate::bindings) fn begin_run(py: Python, id: ScopeId) -> PyResult<()> {
    let (start, torch) = take_snapshot(py, &selection_of(id)?);
    {
        let mut registry = registry();
        let windows = [registry.open_window(&start), registry.open_window(&start)];
        registry.runs.begin(id, windows);
    }
    reset_counters(&torch, &start);
    Ok(())
}

/// The run is at `step` (the optimizer steps completed) of `epoch`.
#[pyfunction]
pub(in crate::bindings) fn run_step(py: Python, id: ScopeId, epoch: u64, step: u64) {
    registry().runs.step(id, epoch, step);
    crate::bindings::recorder::step_completed(py, crate::recorder::StepKind::TrainerStep);
}

/// The batch the run is about to take: its shapes are read now, and no reference is kept.
#[pyfunction]
pub(in crate::bindings) fn run_batch(id: ScopeId, batch: &Bound<PyAny>) {
    let mut walk = Walk::default();
    walk.visit(batch, String::new(), 0);
    registry().runs.batch(id, walk.parts, walk.skipped);
}

/// The peaks of the run's epoch (`every="epoch"`) or of its steps since the last step-level
/// log (`every="steps"`), as a trainer logs them: `{"gpuexp/torch_allocated_peak_mib": 812.5, ...}`.
/// The next interval of that kind starts here.
#[pyfunction]
#[pyo3(signature = (id, every="epoch"))]
pub(in crate::bindings) fn run_peaks<'py>(py: Python<'py>, id: ScopeId, every: &str) -> PyResult<Bound<'py, PyDict>> {
    let interval = match every {
        "epoch" => Interval::Epoch,
        "steps" => Interval::Steps,
        _ => return Err(PyValueError::new_err(format!("every={every:?}: write every=\"epoch\" or every=\"steps\""))),
    };
    let (end, torch) = take_snapshot(py, &selection_of(id)?);
    let metrics = {
        let mut registry = registry();
        if !registry.runs.is_run(id) {
            return Err(PyValueError::new_err(format!(
                "experiment {id} is not a training run: a framework's callback begins one"
            )));
        }
        registry.peaks.observe(&end);
        let next = registry.open_window(&end);
        let ended = registry.runs.next_interval(id, interval, next).expect("a run has its intervals");
        let metrics = interval_metrics(&end, |gauge| registry.peaks.peak(ended, gauge));
        registry.peaks.close(ended);
        metrics
    };
    reset_counters(&torch, &end);
    let logged = PyDict::new(py);
    for (name, value) in metrics {
        logged.set_item(name, value)?;
    }
    Ok(logged)
}

/// The runs still training, oldest first: when an error reaches the cell, they have ended.
#[pyfunction]
pub(in crate::bindings) fn runs_in_flight() -> Vec<ScopeId> {
    registry().runs.open_ids()
}

/// The run ended with `error`: its report says so and where it stood, and an OOM diagnosis of
/// the same exception names that position.
#[pyfunction]
pub(in crate::bindings) fn note_run_error(id: ScopeId, error: &Bound<PyAny>) -> PyResult<()> {
    let kind = error.get_type().name()?.to_string();
    let message = error.str()?.to_string();
    let first_line: String = message.lines().next().unwrap_or("").chars().take(300).collect();
    let mut registry = registry();
    let at = registry.runs.position(id).map(|p| format!(" at {}", p.describe())).unwrap_or_default();
    registry.runs.failed(id, error.as_ptr() as usize);
    let scope = registry.scope_mut(id).ok_or_else(|| unknown(id))?;
    scope.notes.push(format!("the run raised {kind}: {first_line}{at}"));
    Ok(())
}

/// A batch read for its shapes: tensors and arrays, in dicts, lists and tuples.
#[derive(Default)]
struct Walk {
    parts: Vec<BatchPart>,
    skipped: u64,
}

impl Walk {
    fn visit(&mut self, item: &Bound<PyAny>, path: String, depth: usize) {
        // A user object that raises when read is skipped and counted, never re-raised.
        if self.read(item, &path, depth).is_err() {
            self.skipped += 1;
        }
    }

    fn read(&mut self, item: &Bound<PyAny>, path: &str, depth: usize) -> PyResult<()> {
        if item.is_none() || item.is_instance_of::<PyString>() {
            return Ok(());
        }
        if item.hasattr("shape")? && item.hasattr("dtype")? {
            if self.parts.len() >= MAX_PARTS {
                self.skipped += 1;
                return Ok(());
            }
            let shape = item.getattr("shape")?.try_iter()?.map(|d| d?.extract::<u64>()).collect::<PyResult<_>>()?;
            let dtype = item.getattr("dtype")?.str()?.to_string();
            self.parts.push(BatchPart { path: path.to_string(), shape, dtype: Some(dtype) });
            return Ok(());
        }
        if depth >= MAX_DEPTH {
            return Ok(());
        }
        if let Ok(mapping) = item.cast::<PyMapping>() {
            for pair in mapping.items()?.iter() {
                let (key, value): (Bound<PyAny>, Bound<PyAny>) = pair.extract()?;
                let key = match key.cast::<PyString>() {
                    Ok(name) if path.is_empty() => name.to_string(),
                    Ok(name) => format!("{path}[{:?}]", name.to_string()),
                    Err(_) => format!("{path}[{}]", key.repr()?),
                };
                self.visit(&value, key, depth + 1);
            }
        } else if item.is_instance_of::<PyList>() || item.is_instance_of::<PyTuple>() {
            for (index, value) in item.try_iter()?.enumerate() {
                self.visit(&value?, format!("{path}[{index}]"), depth + 1);
            }
        }
        Ok(())
    }
}
