//! The per-cell log: a peak window from `pre_run_cell` to `post_run_cell`, and its records.

use pyo3::prelude::*;

use super::registry::registry;
use super::report::CellRecordPy;
use super::snapshot::{opening_snapshot, reset_counters, take_cell_snapshot, take_snapshot, update_sampler};
use crate::snapshot::GpuSelection;

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
