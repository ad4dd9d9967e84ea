//! The per-cell log (a peak window from `pre_run_cell` to `post_run_cell`), history and settings.

use super::*;

#[pyfunction]
pub(super) fn cell_log_active() -> bool {
    registry().cell_log_active()
}

/// `%gpuexp log on|off`: the cell log without an experiment.
#[pyfunction]
pub(super) fn set_standalone_log(py: Python, on: bool) {
    registry().standalone_log = on;
    if !on {
        update_sampler(py, None);
    }
}

/// Opens the window of a cell about to run (the `pre_run_cell` event).
#[pyfunction]
pub(super) fn begin_cell(py: Python) {
    let selection = registry().cell_selection();
    let (start, torch) = opening_snapshot(py, &selection, take_cell_snapshot);
    registry().begin_cell(start.clone());
    reset_counters(&torch, &start);
}

/// Closes the running cell's window and returns its record (the `post_run_cell` event).
#[pyfunction]
pub(super) fn end_cell(py: Python, execution_count: u64) -> Option<CellRecordPy> {
    let selection = registry().open_cell_selection()?;
    let (end, _) = take_cell_snapshot(py, &selection);
    let (record, all_gpus) = {
        let mut registry = registry();
        (registry.end_cell(execution_count, &end)?, registry.cell_log_all_gpus)
    };
    update_sampler(py, None);
    Some(CellRecordPy { record, all_gpus })
}

/// Every cell record of this kernel, oldest first.
#[pyfunction]
pub(super) fn cells() -> Vec<CellRecordPy> {
    let registry = registry();
    let all_gpus = registry.cell_log_all_gpus;
    registry.cells().iter().map(|record| CellRecordPy { record: record.clone(), all_gpus }).collect()
}

/// The records of the cells that ran while a scope was open.
#[pyfunction]
pub(super) fn scope_cells(id: ScopeId) -> PyResult<Vec<CellRecordPy>> {
    let registry = registry();
    let all_gpus = registry.cell_log_all_gpus;
    let records = match registry.scope(id) {
        Some(scope) => registry.cells_of(scope),
        None => registry.report(id).ok_or_else(|| unknown(id))?.cells.clone(),
    };
    Ok(records.into_iter().map(|r| CellRecordPy { record: Arc::new(r), all_gpus }).collect())
}

/// Called by gpuexp's wrapper of `torch.cuda.reset_peak_memory_stats` just before the
/// user's reset: the peaks seen so far are folded into the open windows, so none is lost.
#[pyfunction]
pub(super) fn before_user_peak_reset(py: Python) {
    let (now, _) = take_snapshot(py, &GpuSelection::AllVisible);
    let mut registry = registry();
    registry.peaks.observe(&now);
    registry.note_cell(
        "torch.cuda.reset_peak_memory_stats() ran in this cell; gpuexp kept the peaks seen before it".into(),
    );
}

/// Reads and changes settings; returns them all.
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
        py.detach(|| peak_sampler::set_interval(interval)).map_err(PyValueError::new_err)?;
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

/// The current state of the host and (with `gpu`) every visible GPU.
#[pyfunction]
#[pyo3(signature = (gpu=true))]
pub(super) fn snapshot(py: Python, gpu: bool) -> SnapshotPy {
    SnapshotPy { snapshot: take_snapshot(py, &selection(gpu, None)).0, title: "snapshot".into() }
}

/// Whether the kernel's peak RSS can be reset here (otherwise a sampler thread stands in).
#[pyfunction]
pub(super) fn host_peak_exact() -> bool {
    host::peak_reset_supported()
}

#[pyfunction]
pub(super) fn sampler_running() -> bool {
    peak_sampler::is_running()
}

#[pyfunction]
pub(super) fn oom_rescue_enabled() -> bool {
    registry().oom_rescue
}
