//! What the kernel keeps across experiments: its settings and the history of finished reports.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::registry::registry;
use super::report::ReportPy;
use crate::peak_sampler;
use crate::snapshot::host;

/// Reads and changes settings; returns them all. `host_peak` is read-only: "exact" where the
/// kernel's peak RSS can be reset, "sampled" where the sampler thread stands in for it.
#[pyfunction]
#[pyo3(signature = (sample_interval_ms=None, cell_log_all_gpus=None, oom_rescue=None))]
pub(super) fn config<'py>(
    py: Python<'py>,
    sample_interval_ms: Option<f64>,
    cell_log_all_gpus: Option<bool>,
    oom_rescue: Option<bool>,
) -> PyResult<Bound<'py, PyDict>> {
    if let Some(ms) = sample_interval_ms {
        let interval = std::time::Duration::try_from_secs_f64(ms / 1e3).map_err(|_| {
            PyValueError::new_err(format!(
                "sample_interval_ms must be a positive number of milliseconds, e.g. gpuexp.config(sample_interval_ms=1); got {ms}"
            ))
        })?;
        py.detach(|| peak_sampler::set_interval(interval))?;
    }
    let mut registry = registry();
    if let Some(all) = cell_log_all_gpus {
        registry.cell_log_all_gpus = all;
    }
    if let Some(rescue) = oom_rescue {
        registry.oom_rescue = rescue;
    }
    let settings = PyDict::new(py);
    settings.set_item("sample_interval_ms", peak_sampler::interval().as_secs_f64() * 1e3)?;
    settings.set_item("cell_log_all_gpus", registry.cell_log_all_gpus)?;
    settings.set_item("oom_rescue", registry.oom_rescue)?;
    settings.set_item("host_peak", if host::peak_reset_supported() { "exact" } else { "sampled" })?;
    Ok(settings)
}

/// Stops the sampler thread (at interpreter exit, and when a kernel shuts down).
#[pyfunction]
pub(super) fn shutdown(py: Python) {
    py.detach(peak_sampler::stop);
}

#[pyfunction]
pub(super) fn history() -> Vec<ReportPy> {
    registry().history().into_iter().map(ReportPy).collect()
}

#[pyfunction]
pub(super) fn history_json() -> String {
    let reports = registry().history();
    serde_json::to_string_pretty(&reports.iter().map(|r| r.as_ref()).collect::<Vec<_>>()).expect("reports serialise")
}
