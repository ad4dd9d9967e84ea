//! What the kernel keeps across experiments: its settings and the history of finished reports.

use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict};

use crate::bindings::cell_trace;
use crate::bindings::host_trace;
use crate::bindings::registry::registry;
use crate::bindings::report::ReportPy;
use crate::live_view::schedule::SCHEDULE;
use crate::peak_sampler;
use crate::scope::settings::{self, Change, LiveViewAfter};
use crate::snapshot::host;

/// Reads and changes settings; returns them all. `host_peak` is read-only: "exact" where the
/// kernel's peak RSS can be reset, "sampled" where the sampler thread stands in for it.
/// `live_view_after_s` is seconds, or False for no live view (None leaves it as it is).
#[pyfunction]
#[allow(clippy::too_many_arguments)] // one per keyword of gpuexp.config
#[pyo3(signature = (sample_interval_ms=None, cell_log_all_gpus=None, oom_rescue=None, cell_log_min_change=None,
                    live_view_after_s=None, trace=None, flight_recorder=None, trace_sampling=None))]
pub(in crate::bindings) fn config<'py>(
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
    let change = Change {
        cell_log_all_gpus,
        oom_rescue,
        cell_log_min_change,
        trace: trace.as_ref().map(host_trace::trace_kinds).transpose()?,
        flight_recorder,
    };
    if let Some(after) = live_view_after_s {
        SCHEDULE.set_after(live_view_after(&after)?);
    }
    if let Some(ms) = sample_interval_ms {
        let interval = settings::sample_interval(ms)?;
        py.detach(|| peak_sampler::set_interval(interval))?;
    }
    if let Some(sampled) = trace_sampling {
        crate::bindings::trace_sampling::set_enabled(sampled);
    }
    let mut registry = registry();
    registry.configure(&change);
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
    settings.set_item("trace_sampling", crate::bindings::trace_sampling::enabled())?;
    settings.set_item("live_view_after_s", SCHEDULE.after().map(|after| after.as_secs_f64()))?;
    settings.set_item("host_peak", if host::peak_reset_supported() { "exact" } else { "sampled" })?;
    drop(registry);
    if change.stops_cuda_trace() {
        cell_trace::settle(py);
    }
    if change.stops_flight_recorder() {
        crate::bindings::recorder::settle(py);
    }
    Ok(settings)
}

/// `live_view_after_s=` as [`LiveViewAfter`] decides it.
fn live_view_after(value: &Bound<PyAny>) -> PyResult<Option<Duration>> {
    let given = match value.cast::<PyBool>() {
        Ok(flag) => LiveViewAfter::Flag(flag.is_true()),
        Err(_) => value.extract().map_or(LiveViewAfter::Other, LiveViewAfter::Seconds),
    };
    Ok(given.after(&value.to_string())?)
}

/// Stops the sampler thread (at interpreter exit, and when a kernel shuts down).
#[pyfunction]
pub(in crate::bindings) fn shutdown(py: Python) {
    py.detach(peak_sampler::stop);
}

#[pyfunction]
pub(in crate::bindings) fn history() -> Vec<ReportPy> {
    registry().history().into_iter().map(ReportPy).collect()
}

#[pyfunction]
pub(in crate::bindings) fn history_json() -> String {
    let reports = registry().history();
    serde_json::to_string_pretty(&reports.iter().map(|r| r.as_ref()).collect::<Vec<_>>()).expect("reports serialise")
}
