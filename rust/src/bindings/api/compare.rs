//! `gpuexp.compare`: finished experiments side by side. The table, the JSON, the columns of a
//! data frame and the plot's content come from the core; pandas and matplotlib draw them.

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::bindings::registry::registry;
use crate::bindings::report::{to_python, ReportPy};
use crate::bindings::trace::{diff_reports, SiteDiffPy};
use crate::compare::{traced_ends, Comparison};
use crate::report::Report;

/// Experiments side by side (``gpuexp.compare``): ``str()`` and ``_repr_html_`` are the table,
/// ``to_dict()`` is ``{"rows": [...]}`` with each report's figures in its own JSON shape.
#[pyclass(name = "Comparison", module = "gpuexp", frozen)]
// The reports are kept for `sites()`.
pub(in crate::bindings) struct ComparisonPy(Comparison, Vec<Arc<Report>>);

shown_as_table!(ComparisonPy, |this| &this.0, this.0.grid());

#[pymethods]
impl ComparisonPy {
    fn __len__(&self) -> usize {
        self.0.rows.len()
    }

    /// One row per experiment, one column per param (numbers stay numbers) and per figure: a
    /// pandas DataFrame.
    fn to_pandas<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let table = self.0.columns();
        let rows = to_python(py, &table.rows)?;
        let columns = pyo3::types::PyDict::new(py);
        columns.set_item("columns", table.columns)?;
        crate::bindings::error::optional(py, "pandas", "to_pandas()")?.call_method("DataFrame", (rows,), Some(&columns))
    }

    /// The peak of each layer against a numeric param (``x``, or the only one that varies), the
    /// device's total and the limit as levels, and a fit extrapolated to the largest value
    /// that fits: a matplotlib Figure.
    #[pyo3(signature = (x=None))]
    fn plot<'py>(&self, py: Python<'py>, x: Option<&str>) -> PyResult<Bound<'py, PyAny>> {
        let plot = self.0.plot(x).map_err(PyValueError::new_err)?;
        let spec = to_python(py, &plot)?;
        crate::bindings::error::optional(py, "matplotlib", "plot()")?;
        py.import("gpuexp.comparison")?.call_method1("draw", (spec,))
    }

    /// Why the last traced experiment compared peaks higher (or lower) than the first, by site:
    /// ``last.diff(first)``, each site's growth related to the params that changed.
    fn sites(&self) -> PyResult<SiteDiffPy> {
        let (first, last) = traced_ends(&self.1).map_err(PyValueError::new_err)?;
        diff_reports(last, first)
    }
}

/// ``reports`` side by side; by default this kernel's history.
#[pyfunction]
#[pyo3(signature = (reports=None))]
pub(in crate::bindings) fn compare(reports: Option<Vec<PyRef<ReportPy>>>) -> ComparisonPy {
    let reports: Vec<Arc<Report>> = match reports {
        Some(reports) => reports.iter().map(|r| r.0.clone()).collect(),
        None => registry().history(),
    };
    ComparisonPy(Comparison::of(reports.iter().map(|r| r.as_ref())), reports)
}
