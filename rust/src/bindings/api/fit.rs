//! `gpuexp.fit`'s core calls: Python (`python/gpuexp/fit.py`) runs the step under fake tensors
//! and gathers what it saw as JSON; these convert it, and the core decides (`crate::fit`).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::fit::{accumulation, FitInput, FitReport};

fn parse(input: &str) -> PyResult<FitInput> {
    serde_json::from_str(input).map_err(|error| PyValueError::new_err(format!("fit's findings don't parse: {error}")))
}

fn to_python<'py>(py: Python<'py>, value: &impl serde::Serialize) -> PyResult<Bound<'py, PyAny>> {
    crate::bindings::report::json_to_python(py, &serde_json::to_string(value).expect("fit's answers serialise"))
}

/// The blocks to checkpoint so that the step fits, saving `more` bytes beyond what is needed:
/// ``{"paths": [...], "saving": bytes, "forward_flops": n, "enough": bool}``.
#[pyfunction]
pub(in crate::bindings) fn fit_checkpoint_plan<'py>(
    py: Python<'py>,
    input: &str,
    more: u64,
) -> PyResult<Bound<'py, PyAny>> {
    to_python(py, &parse(input)?.checkpoint_plan(more))
}

/// Gradient accumulation's micro-batches: ``{"k": n, "micro_batch": n, "predicted": bytes}``, or None.
#[pyfunction]
pub(in crate::bindings) fn fit_accumulation<'py>(py: Python<'py>, input: &str) -> PyResult<Bound<'py, PyAny>> {
    to_python(py, &accumulation(&parse(input)?))
}

/// What ``gpuexp.fit`` found: why the step does not fit, and the options ranked by what they
/// save, each with its predicted peak, its cost and its code. ``str()`` and ``_repr_html_`` are
/// its tables.
#[pyclass(name = "FitReport", module = "gpuexp", frozen)]
pub(in crate::bindings) struct FitPy(FitReport);

#[pymethods]
impl FitPy {
    /// The step's predicted peak, in bytes above what is allocated now.
    #[getter]
    fn peak(&self) -> u64 {
        self.0.peak
    }
    /// Bytes the peak may reach (free memory, or ``limit=``); None where it is unknown.
    #[getter]
    fn budget(&self) -> Option<u64> {
        self.0.budget.as_ref().map(|b| b.bytes)
    }
    /// Whether the step fits as it is; None without a budget.
    #[getter]
    fn fits(&self) -> Option<bool> {
        self.0.fits
    }
    /// The options, ranked, as dicts: option, title, peak, saves, fits, cost, code, refused.
    #[getter]
    fn options<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        to_python(py, &self.0.options)
    }
    /// The first option that fits, else the one that saves the most; None where none was estimated.
    #[getter]
    fn best<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        to_python(py, &self.0.best())
    }
    /// The largest batch that fits as the step is, from the estimates' line.
    #[getter]
    fn largest_batch(&self) -> Option<u64> {
        self.0.largest_batch
    }
    /// Which options raise the batch that fits above ``answer``, and to about what, in a sentence.
    fn raises(&self, answer: u64) -> Option<String> {
        self.0.raises(answer)
    }
}

shown_as_table!(FitPy, |this| &this.0, this.0.view());

/// The report, from everything Python gathered.
#[pyfunction]
pub(in crate::bindings) fn fit_report(input: &str) -> PyResult<FitPy> {
    Ok(FitPy(FitReport::new(&parse(input)?)))
}
