//! The per-cell log: a peak window from `pre_run_cell` to `post_run_cell`, its records, and
//! whether a cell's block shows; with the trace on, the top site of a cell's torch peak
//! (`cell_trace`).

use pyo3::prelude::*;

use crate::bindings::cell_trace;
use crate::bindings::registry::registry;
use crate::bindings::report::CellRecordPy;
use crate::bindings::snapshot::{
    opening_snapshot, other_readings, reset_counters, take_cell_snapshot, take_snapshot, update_sampler,
};
use crate::bindings::torch::PyTorch;
use crate::live_view::schedule::SCHEDULE;
use crate::report::CellRecord;
use crate::scope::cell_creep::HolderReading;
use crate::scope::cell_log::{self, CellWorld};
use crate::scope::Registry;
use crate::snapshot::{GpuSelection, Snapshot};
use std::sync::{Arc, MutexGuard};

#[pyfunction]
pub(in crate::bindings) fn cell_log_active() -> bool {
    registry().cell_log_active()
}

/// `%gpuexp log on|all|off`: the cell log without an experiment; `every_cell` (`log all`) shows
/// every cell's block, not only those of cells where something moved.
#[pyfunction]
#[pyo3(signature = (on, every_cell=false))]
pub(in crate::bindings) fn set_standalone_log(py: Python, on: bool, every_cell: bool) {
    let went_off = registry().set_standalone_log(on, every_cell);
    if went_off {
        PyCells(py).settle();
    }
}

/// The cell log's steps over torch and NVML, for the core's sequence.
struct PyCells<'py>(Python<'py>);

impl<'py> CellWorld for PyCells<'py> {
    type Torch = PyTorch<'py>;
    fn registry(&self) -> MutexGuard<'_, Registry> {
        registry()
    }
    fn other_readings(&self) -> u64 {
        other_readings()
    }
    fn opening_snapshot(&mut self, selection: &GpuSelection) -> (Snapshot, PyTorch<'py>) {
        opening_snapshot(self.0, selection, take_cell_snapshot)
    }
    fn cell_snapshot(&mut self, selection: &GpuSelection) -> (Snapshot, PyTorch<'py>) {
        take_cell_snapshot(self.0, selection)
    }
    fn reset_counters(&mut self, torch: &PyTorch<'py>, at: &Snapshot) {
        reset_counters(torch, at);
    }
    fn begin_trace(&mut self, carried: bool) {
        cell_trace::begin_cell(self.0, carried);
    }
    fn end_trace(&mut self, record: Arc<CellRecord>) -> Arc<CellRecord> {
        cell_trace::end_cell(self.0, record)
    }
    fn settle(&mut self) {
        update_sampler(self.0, None);
        cell_trace::settle(self.0);
        crate::bindings::recorder::settle(self.0);
    }
}

/// Opens the window of a cell about to run (the `pre_run_cell` event): where the previous
/// logged cell ended when nothing came in between, so that a cell reads memory once, at its end.
#[pyfunction]
pub(in crate::bindings) fn begin_cell(py: Python) {
    cell_log::begin_cell(&mut PyCells(py), &SCHEDULE);
}

/// Closes the running cell's window and records it (the `post_run_cell` event). Returns the
/// record when its block shows (something moved by `cell_log_min_change`, or `%gpuexp log all`),
/// and the window of the cell's live view if one was drawn: the caller replaces it.
#[pyfunction]
pub(in crate::bindings) fn end_cell(py: Python, execution_count: u64) -> (Option<CellRecordPy>, Option<u64>) {
    let ended = cell_log::end_cell(&mut PyCells(py), &SCHEDULE, execution_count);
    let all_gpus = registry().cell_log_all_gpus;
    (ended.shown.map(|record| CellRecordPy { record, all_gpus }), ended.drawn)
}

/// The holders the running cell's code grows, each `(path, items, tensor_bytes)` as read at its
/// end: the cell log notes a creep where three cells in a row each end higher growing one.
#[pyfunction]
pub(in crate::bindings) fn cell_grew(holders: Vec<(String, u64, u64)>) {
    let readings =
        holders.into_iter().map(|(name, items, tensor_bytes)| HolderReading { name, items, tensor_bytes }).collect();
    registry().cell_grew(readings);
}

/// Every cell record of this kernel, oldest first.
#[pyfunction]
pub(in crate::bindings) fn cells() -> Vec<CellRecordPy> {
    let registry = registry();
    let all_gpus = registry.cell_log_all_gpus;
    registry.cells().iter().map(|record| CellRecordPy { record: record.clone(), all_gpus }).collect()
}

/// Called by gpuexp's wrapper of `torch.cuda.reset_peak_memory_stats` just before the
/// user's reset: the peaks seen so far are folded into the open windows, so none is lost.
#[pyfunction]
pub(in crate::bindings) fn before_user_peak_reset(py: Python) {
    let (now, _) = take_snapshot(py, &GpuSelection::AllVisible);
    let mut registry = registry();
    registry.peaks.observe(&now);
    registry.note_cell(
        "torch.cuda.reset_peak_memory_stats() ran in this cell; gpuexp kept the peaks seen before it".into(),
    );
}
