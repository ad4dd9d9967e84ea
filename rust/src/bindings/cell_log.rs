//! The per-cell log: a peak window from `pre_run_cell` to `post_run_cell`, its records, and
//! whether a cell's block shows; with the trace on, the top site of a cell's torch peak
//! (`cell_trace`).

use pyo3::prelude::*;

use super::cell_trace;
use super::live_view::schedule;
use super::registry::registry;
use super::report::CellRecordPy;
use super::snapshot::{
    opening_snapshot, other_readings, reset_counters, take_cell_snapshot, take_snapshot, update_sampler,
};
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
        registry.forget_cell_end();
    }
    if !on {
        update_sampler(py, None);
        cell_trace::settle(py);
        super::recorder::settle(py);
    }
}

/// Opens the window of a cell about to run (the `pre_run_cell` event): where the previous
/// logged cell ended when nothing came in between, so that a cell reads memory once, at its end.
#[pyfunction]
pub(super) fn begin_cell(py: Python) {
    let selection = registry().cell_selection();
    let carried = registry().begin_cell_where_last_ended(&selection, other_readings());
    let window = carried.unwrap_or_else(|| {
        let (start, torch) = opening_snapshot(py, &selection, take_cell_snapshot);
        let window = registry().begin_cell(start.clone());
        reset_counters(&torch, &start);
        window
    });
    cell_trace::begin_cell(py, carried.is_some());
    schedule().cell_began(window);
}

/// Closes the running cell's window and records it (the `post_run_cell` event). Returns the
/// record when its block shows (something moved by `cell_log_min_change`, or `%gpuexp log all`),
/// and the window of the cell's live view if one was drawn: the caller replaces it.
#[pyfunction]
pub(super) fn end_cell(py: Python, execution_count: u64) -> (Option<CellRecordPy>, Option<u64>) {
    let drawn = schedule().cell_ended();
    let Some(selection) = registry().open_cell_selection() else { return (None, drawn) };
    let (end, torch) = take_cell_snapshot(py, &selection);
    let record = registry().end_cell(execution_count, &end);
    // The trace is read without the registry held: naming a site calls into Python.
    let record = record.map(|record| cell_trace::end_cell(py, record));
    let (shown, next_selection) = {
        let registry = registry();
        let shown = record
            .filter(|r| registry.shows(r))
            .map(|record| CellRecordPy { record, all_gpus: registry.cell_log_all_gpus });
        (shown, registry.cell_log_active().then(|| registry.cell_selection()))
    };
    if let Some(next_selection) = next_selection {
        // The end's peaks are in every open window now: the next cell's window starts here.
        reset_counters(&torch, &end);
        registry().keep_cell_end(end, next_selection, other_readings());
    }
    update_sampler(py, None);
    cell_trace::settle(py);
    super::recorder::settle(py);
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
