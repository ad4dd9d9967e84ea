//! The books of an estimate as `gpuexp.fake_step.LedgerRun` reaches them: that dispatch mode and
//! its hooks (torch instrumentation, so Python) report each storage made, grown, freed or found
//! to be a gradient in plain calls, and the core's [`Books`] decide what each means. Here too the
//! step runs inside the fake mode and the ledger's mode, and an error names its operator.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyModule;

use super::error::NoEstimate;
use super::fakes::Fakes;
use super::holders::Memory;
use crate::estimate::{Category, Entry, Peak, Phase, Rounding};
use crate::estimate_books::Books;
use crate::estimate_run;

/// Runs `body` with the ledger's dispatch mode inside the fake mode of `fakes`; the peak it found.
pub(super) fn run<'py, T>(
    fakes: &Fakes<'py>,
    memory: &Memory,
    target: &Bound<'py, PyAny>,
    body: impl FnOnce(&Ledgered<'py>) -> PyResult<T>,
) -> PyResult<(Peak, T)> {
    let py = fakes.py;
    let rounding = match memory {
        Memory::Cuda(_) => Rounding::CudaCaching,
        _ => Rounding::Exact,
    };
    let books = Bound::new(py, BooksPy(Books::new(rounding)))?;
    let run = fake_step(py)?.getattr("LedgerRun")?.call1((&fakes.swapped, &books, target))?;
    let ledgered = Ledgered { run };
    let mode = ledgered.run.getattr("mode")?;
    let outcome = within(&fakes.mode, || within(&mode, || body(&ledgered)));
    let marked = ledgered.run.call_method0("mark_gradients_and_state");
    let peak = books.borrow().0.ledger.peak();
    // The hooks go whatever happened: the optimizer's are global.
    ledgered.run.call_method0("close")?;
    let outcome = outcome?;
    marked?;
    Ok((peak, outcome))
}

/// Runs `inner` with `mode` entered. A mode is left only if it was entered: leaving one that was
/// not would pop another off torch's stack.
fn within<T>(mode: &Bound<PyAny>, inner: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    mode.call_method0("__enter__")?;
    let outcome = inner();
    let none = mode.py().None();
    let left = mode.call_method1("__exit__", (&none, &none, &none));
    let outcome = outcome?;
    left?;
    Ok(outcome)
}

/// `gpuexp.fake_step`'s torch instrumentation, which torch calls back.
fn fake_step(py: Python) -> PyResult<Bound<PyModule>> {
    py.import("gpuexp.fake_step")
}

/// A step run in progress: `gpuexp.fake_step.LedgerRun`, whose dispatch mode and hooks report to
/// the books.
pub(super) struct Ledgered<'py> {
    run: Bound<'py, PyAny>,
}

impl Ledgered<'_> {
    /// How many parameters have optimizer state: it grows when a step creates it.
    pub(super) fn optimizer_state_entries(&self) -> PyResult<usize> {
        self.run.call_method0("optimizer_state_entries")?.extract()
    }

    /// The step's error as `NoEstimate`, naming the operator it failed at.
    pub(super) fn no_estimate(&self, py: Python, error: PyErr) -> PyErr {
        if error.is_instance_of::<NoEstimate>(py) {
            return error;
        }
        let value = error.value(py);
        let operator = value
            .getattr("func")
            .ok()
            .filter(|f| !f.is_none())
            .or_else(|| self.run.getattr("last_op").ok().filter(|op| !op.is_none()))
            .map(|op| op.to_string());
        let kind = value.get_type().name().map(|n| n.to_string()).unwrap_or_default();
        let message = value.str().map(|s| s.to_string()).unwrap_or_default();
        let wrapped = NoEstimate::new_err(estimate_run::failed_at(operator.as_deref(), &kind, &message));
        wrapped.set_cause(py, Some(error));
        wrapped
    }
}

/// The core's [`Books`] of one estimate, as `LedgerRun` reports to them. Storages are known by
/// `id()` (their address) while they live; a category by its label.
#[pyclass(name = "EstimateBooks", module = "gpuexp._core")]
struct BooksPy(Books);

fn category(label: &str) -> PyResult<Category> {
    let known = Category::ALL.into_iter().find(|c| c.label() == label);
    known.ok_or_else(|| PyValueError::new_err(format!("no category {label:?}")))
}

#[pymethods]
impl BooksPy {
    /// A storage that exists before the step; the entry to watch, or None ([`Books::existing`]).
    fn existing(&mut self, storage: usize, nbytes: u64, category_name: &str, loaded: bool) -> PyResult<Option<Entry>> {
        Ok(self.0.existing(storage, nbytes, category(category_name)?, loaded))
    }
    /// An operator runs ([`Books::operator`]).
    fn operator(&mut self, in_backward: bool) {
        self.0.operator(in_backward);
    }
    /// A storage an operator's output holds; the entry to watch, or None ([`Books::output`]).
    fn output(&mut self, storage: usize, nbytes: u64, alias: bool) -> Option<Entry> {
        self.0.output(storage, nbytes, alias)
    }
    /// A watched storage died.
    fn freed(&mut self, storage: usize, entry: Entry) {
        self.0.freed(storage, entry);
    }
    /// A storage turned out to be a gradient or optimizer state.
    fn mark(&mut self, storage: usize, category_name: &str) -> PyResult<()> {
        self.0.mark(storage, category(category_name)?);
        Ok(())
    }
    /// The optimizer's step began: its own phase until it ends.
    fn enter_optimizer(&mut self) {
        self.0.ledger.enter(Phase::Optimizer);
    }
    /// The optimizer's step ended.
    fn leave_optimizer(&mut self) {
        self.0.ledger.enter(Phase::Forward);
    }
    /// The error that stops an estimate whose step uses a real tensor requiring grad of `shape`.
    fn unknown_parameter(&self, py: Python, shape: &str) -> Py<PyAny> {
        NoEstimate::new_err(estimate_run::unknown_parameter(shape)).into_value(py).into_any()
    }
    /// The error that stops an estimate at cuDNN's RNN (`crate::cudnn_rnn`).
    fn cudnn_rnn_refusal(&self, py: Python, mode: i64) -> Py<PyAny> {
        NoEstimate::new_err(crate::cudnn_rnn::refusal(mode)).into_value(py).into_any()
    }
}
