//! What the kernel keeps across experiments: its settings and the history of finished reports.

use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict};

use super::cell_trace;
use super::host_trace;
use super::live_view::schedule;
use super::registry::registry;
use super::report::ReportPy;
use crate::peak_sampler;
use crate::snapshot::host;

/// Reads and changes settings; returns them all. `host_peak` is read-only: "exact" where the
/// kernel's peak RSS can be reset, "sampled" where the sampler thread stands in for it.
/// `live_view_after_s` is seconds, or False for no live view (None leaves it as it is).
#[pyfunction]
#[allow(clippy::too_many_arguments)] // one per keyword of gpuexp.config
#[pyo3(signature = (sample_interval_ms=None, cell_log_all_gpus=None, oom_rescue=None, cell_log_min_change=None,
                    live_view_after_s=None, trace=None, flight_recorder=None, trace_sampling=None))]
pub(super) fn config<'py>(
    py: Python<'py>,
    sample_interval_ms: Option<f64>,
    cell_log_all_gpus: Option<bool>,
    oom_rescue: Option<bool>,
    cell_log_min_change: Option<u64>,
    live_view_after_s: Option<Bound<'py, PyAny>>,
    trace: Option<Bound<'py, PyAny>>,
    flight_recorder: Option<bool>,
    trace_sampling: Option<bool>,
) -> PyResult<Bound<'py, PyDict>> {
    let trace = trace.as_ref().map(host_trace::trace_kinds).transpose()?;
    if let Some(after) = live_view_after_s {
        schedule().set_after(live_view_after(&after)?);
    }
    if let Some(ms) = sample_interval_ms {
        let interval = std::time::Duration::try_from_secs_f64(ms / 1e3).map_err(|_| {
            PyValueError::new_err(format!(
                "sample_interval_ms must be a positive number of milliseconds, e.g. gpuexp.config(sample_interval_ms=1); got {ms}"
            ))
        })?;
        py.detach(|| peak_sampler::set_interval(interval))?;
    }
    if let Some(sampled) = trace_sampling {
        super::trace_sampling::set_enabled(sampled);
    }
    let mut registry = registry();
    if let Some(all) = cell_log_all_gpus {
        registry.cell_log_all_gpus = all;
    }
    if let Some(rescue) = oom_rescue {
        registry.oom_rescue = rescue;
    }
    if let Some(min_change) = cell_log_min_change {
        registry.cell_log_min_change = min_change;
    }
    if let Some(trace) = trace {
        registry.trace_by_default = trace;
    }
    if let Some(on) = flight_recorder {
        registry.flight_recorder = on;
    }
    let settings = PyDict::new(py);
    settings.set_item("sample_interval_ms", peak_sampler::interval().as_secs_f64() * 1e3)?;
    settings.set_item("cell_log_all_gpus", registry.cell_log_all_gpus)?;
    settings.set_item("oom_rescue", registry.oom_rescue)?;
    settings.set_item("cell_log_min_change", registry.cell_log_min_change)?;
    match registry.trace_by_default.setting() {
        Some(kinds) => settings.set_item("trace", kinds)?,
        None => settings.set_item("trace", registry.trace_by_default.cuda())?,
    }
    settings.set_item("flight_recorder", registry.flight_recorder)?;
    settings.set_item("trace_sampling", super::trace_sampling::enabled())?;
    settings.set_item("live_view_after_s", schedule().after().map(|after| after.as_secs_f64()))?;
    settings.set_item("host_peak", if host::peak_reset_supported() { "exact" } else { "sampled" })?;
    drop(registry);
    if trace.is_some_and(|kinds| !kinds.cuda()) {
        cell_trace::settle(py);
    }
    if flight_recorder == Some(false) {
        super::recorder::settle(py);
    }
    Ok(settings)
}

/// False: no live view; seconds: how long a cell runs before it shows one.
fn live_view_after(value: &Bound<PyAny>) -> PyResult<Option<Duration>> {
    let bad = || {
        PyValueError::new_err(format!(
            "live_view_after_s is the seconds a cell runs before its live view shows, e.g. \
             gpuexp.config(live_view_after_s=2), or None to turn it off; got {value}"
        ))
    };
    if let Ok(flag) = value.cast::<PyBool>() {
        return if flag.is_true() { Err(bad()) } else { Ok(None) };
    }
    let seconds: f64 = value.extract().map_err(|_| bad())?;
    Duration::try_from_secs_f64(seconds).map(Some).map_err(|_| bad())
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
