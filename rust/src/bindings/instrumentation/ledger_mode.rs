//! The books of an estimate as `gpuexp.fake_step.LedgerRun` reaches them: that dispatch mode and
//! its hooks (torch instrumentation, so Python) report each storage made, grown, freed or found
//! to be a gradient in plain calls, and the core's [`LedgerBooks`] decide what each means. Here too the
//! step runs inside the fake mode and the ledger's mode, and an error names its operator.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyModule;

use crate::bindings::error::NoEstimate;
use std::collections::HashMap;

use crate::bindings::fakes::Fakes;
use crate::bindings::holders::Memory;
use crate::bindings::step_state::StepState;
use crate::estimate::{Category, Entry, Peak, Phase};
use crate::estimate_books::LedgerBooks;
use crate::estimate_run;
use crate::scalar_reads::Place;

/// Runs `body` with the ledger's dispatch mode (a `gpuexp.fake_step.LedgerRun`, given to `body`)
/// inside the fake mode of `fakes`; the peak it found, and the notes on what the step read.
/// `state` names what the step reaches.
pub(in crate::bindings) fn run<'py, T>(
    fakes: &Fakes<'py>,
    state: &StepState<'py>,
    memory: &Memory,
    target: &Bound<'py, PyAny>,
    body: impl FnOnce(&Bound<'py, PyAny>) -> PyResult<T>,
) -> PyResult<(Peak, T, Vec<String>)> {
    let py = fakes.py;
    let books = BooksPy { books: LedgerBooks::new(estimate_run::rounding(memory)), paths: state.takes_grad_paths() };
    let books = Bound::new(py, books)?;
    let ledgered = fake_step(py)?.getattr("LedgerRun")?.call1((&fakes.swapped, &books, target))?;
    let mode = ledgered.getattr("mode")?;
    let outcome = within(&fakes.mode, || within(&mode, || body(&ledgered)));
    let marked = ledgered.call_method0("mark_gradients_and_state");
    let (peak, notes) = (books.borrow().books.ledger.peak(), books.borrow().books.reads.notes());
    // The hooks go whatever happened: the optimizer's are global.
    ledgered.call_method0("close")?;
    let outcome = outcome?;
    marked?;
    Ok((peak, outcome, notes))
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

/// The core's [`LedgerBooks`] of one estimate, as `LedgerRun` reports to them. Storages are known by
/// `id()` (their address) while they live; a category by its label.
#[pyclass(name = "EstimateBooks", module = "gpuexp._core")]
struct BooksPy {
    books: LedgerBooks,
    /// The path to each real tensor that requires grad that the step reaches, by its `id()`.
    paths: HashMap<usize, String>,
}

fn category(label: &str) -> PyResult<Category> {
    Category::labelled(label).ok_or_else(|| PyValueError::new_err(format!("no category {label:?}")))
}

#[pymethods]
impl BooksPy {
    /// A storage that exists before the step; the entry to watch, or None ([`LedgerBooks::existing`]).
    fn existing(&mut self, storage: usize, nbytes: u64, category_name: &str, loaded: bool) -> PyResult<Option<Entry>> {
        Ok(self.books.existing(storage, nbytes, category(category_name)?, loaded))
    }
    /// An operator runs ([`LedgerBooks::operator`]).
    fn operator(&mut self, in_backward: bool) {
        self.books.operator(in_backward);
    }
    /// A storage an operator's output holds; the entry to watch, or None ([`LedgerBooks::output`]).
    fn output(&mut self, storage: usize, nbytes: u64, alias: bool) -> Option<Entry> {
        self.books.output(storage, nbytes, alias)
    }
    /// A watched storage died.
    fn freed(&mut self, storage: usize, entry: Entry) {
        self.books.freed(storage, entry);
    }
    /// A storage turned out to be a gradient or optimizer state.
    fn mark(&mut self, storage: usize, category_name: &str) -> PyResult<()> {
        self.books.mark(storage, category(category_name)?);
        Ok(())
    }
    /// The optimizer's step began: its own phase until it ends.
    fn enter_optimizer(&mut self) {
        self.books.ledger.enter(Phase::Optimizer);
    }
    /// The optimizer's step ended.
    fn leave_optimizer(&mut self) {
        self.books.ledger.enter(Phase::Forward);
    }
    /// The error that stops an estimate whose step uses a real tensor requiring grad of `shape`.
    fn unknown_parameter(&self, py: Python, tensor: usize, shape: &str) -> Py<PyAny> {
        let path = self.paths.get(&tensor).map(String::as_str);
        NoEstimate::new_err(estimate_run::unknown_parameter(path, shape)).into_value(py).into_any()
    }
    /// The step's error as `NoEstimate`: it raised (`kind`: `message`) at `operator` (None: before
    /// its first), or in the user's own code at `raised_at` (file and line).
    #[pyo3(signature = (operator, kind, message, raised_at=None))]
    fn failed_at(
        &self,
        py: Python,
        operator: Option<&str>,
        kind: &str,
        message: &str,
        raised_at: Option<&str>,
    ) -> Py<PyAny> {
        NoEstimate::new_err(estimate_run::failed_at(operator, kind, message, raised_at)).into_value(py).into_any()
    }
    /// What a stand-in for a read value shows when printed or formatted.
    #[classattr]
    const STAND_IN: &'static str = crate::scalar_reads::STAND_IN;
    /// The step read a tensor's value, `symbol` standing in for it, at `line` (`file:line`,
    /// whose code is `source`).
    #[pyo3(signature = (symbol, line=None, source=None))]
    fn read(&mut self, symbol: String, line: Option<String>, source: Option<String>) {
        self.books.reads.read(symbol, Place { line, source });
    }
    /// A `float()` of a fake tensor at `line` returned NaN.
    #[pyo3(signature = (line=None, source=None))]
    fn nan(&mut self, line: Option<String>, source: Option<String>) {
        self.books.reads.nan(Place { line, source });
    }
    /// The error that stops an estimate whose step needed, at `line`, the value of an
    /// expression over `symbols` ([`crate::scalar_reads::Reads::needed`]).
    #[pyo3(signature = (symbols, line=None, source=None))]
    fn needed(&self, py: Python, symbols: Vec<String>, line: Option<String>, source: Option<String>) -> Py<PyAny> {
        let why = self.books.reads.needed(&symbols, &Place { line, source });
        NoEstimate::new_err(why).into_value(py).into_any()
    }
    /// The error that stops an estimate at cuDNN's RNN (`crate::cudnn_rnn`).
    fn cudnn_rnn_refusal(&self, py: Python, mode: i64) -> Py<PyAny> {
        NoEstimate::new_err(crate::cudnn_rnn::refusal(mode)).into_value(py).into_any()
    }
}
