//! The per-cell log: a peak window from `pre_run_cell` to `post_run_cell`, its records, and
//! whether a cell's block shows.

use pyo3::prelude::*;

use super::live_view::schedule;
use super::registry::registry;
use super::report::CellRecordPy;
use super::snapshot::{opening_snapshot, reset_counters, take_cell_snapshot, take_snapshot, update_sampler};
use crate::snapshot::GpuSelection;

#[pyfunction]
pub(super) fn cell_log_active() -> bool {
    registry().cell_log_active()
}

/// `%gpuexp log on|all|off`: the cell log without an experiment; `every_cell` (`log all`) shows
/// every cell's block, not only those of cells where something moved.
#[pyfunction]
#[pyo3(signature = (on, every_cell=false))]
pub(super) fn set_standalone_log(py: Python, on: bool, every_cell: bool) {
    {
        let mut registry = registry();
        registry.standalone_log = on;
        registry.cell_log_every_cell = on && every_cell;
    }
    if !on {
        update_sampler(py, None);
    }
}

/// Opens the window of a cell about to run (the `pre_run_cell` event).
#[pyfunction]
pub(super) fn begin_cell(py: Python) {
    let selection = registry().cell_selection();
    let (start, torch) = opening_snapshot(py, &selection, take_cell_snapshot);
    let window = registry().begin_cell(start.clone());
    reset_counters(&torch, &start);
    schedule().cell_began(window);
}

/// Closes the running cell's window and records it (the `post_run_cell` event). Returns the
/// record when its block shows (something moved by `cell_log_min_change`, or `%gpuexp log all`),
/// and the window of the cell's live view if one was drawn: the caller replaces it.
#[pyfunction]
pub(super) fn end_cell(py: Python, execution_count: u64) -> (Option<CellRecordPy>, Option<u64>) {
    let drawn = schedule().cell_ended();
    let Some(selection) = registry().open_cell_selection() else { return (None, drawn) };
    let (end, _) = take_cell_snapshot(py, &selection);
    let shown = {
        let mut registry = registry();
        let record = registry.end_cell(execution_count, &end);
        record.filter(|r| registry.shows(r)).map(|record| CellRecordPy { record, all_gpus: registry.cell_log_all_gpus })
    };
    update_sampler(py, None);
    (shown, drawn)
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
