//! The cell log's share of torch's allocation history (`crate::cell_history` decides when it is
//! joined and given back): the settings read from the registry, torch reached through
//! `trace_recording`, and a cell's peak sites read where its torch peak moved.

use std::sync::Arc;

use pyo3::prelude::*;

use crate::bindings::registry::registry;
use crate::bindings::torch::PyTorch;
use crate::bindings::trace;
use crate::bindings::trace_recording;
use crate::cell_history::{self, CellWorld};
use crate::report::CellRecord;
use crate::snapshot::GpuSelection;
use crate::torch_history::TraceWindow;

struct PyCells<'py>(Python<'py>);

impl CellWorld for PyCells<'_> {
    fn logging(&self) -> bool {
        let registry = registry();
        registry.cell_log_active() && registry.cell_selection() != GpuSelection::None
    }

    fn traced_by_default(&self) -> bool {
        registry().trace_by_default.cuda()
    }

    fn cuda_initialised(&self) -> bool {
        PyTorch::find(self.0).cuda().is_some()
    }

    fn open(&self) -> (TraceWindow, Vec<String>) {
        trace_recording::open(self.0)
    }

    fn close(&self) -> Option<String> {
        trace_recording::close(self.0)
    }
}

/// At a logged cell's start, once its window is open (`carried`: its figures start where the
/// last cell ended).
pub(in crate::bindings) fn begin_cell(py: Python, carried: bool) {
    let notes = cell_history::begin_cell(&PyCells(py), carried);
    let mut registry = registry();
    for note in notes {
        registry.note_cell(note);
    }
}

/// At a logged cell's end: the record with its torch peaks' top sites where the cell log holds
/// a share and a peak moved (the record as it was otherwise). The history is read only then.
pub(in crate::bindings) fn end_cell(py: Python, record: Arc<CellRecord>) -> Arc<CellRecord> {
    let Some((since_us, max_entries)) = cell_history::end_cell() else { return record };
    let moved = record.torch_peaks_moved(registry().cell_log_min_change);
    if moved.is_empty() {
        return record;
    }
    let found = trace::cell_peak_sites(py, &moved, max_entries, since_us);
    let updated = registry().update_last_cell(|last| match found {
        Ok(sites) => last.peak_sites = sites,
        Err(e) => last.notes.push(format!("trace: reading torch's allocation history failed: {e}")),
    });
    updated.unwrap_or(record)
}

/// Gives the cell log's share back where the log or the trace is now off.
pub(in crate::bindings) fn settle(py: Python) {
    if let Some(note) = cell_history::settle(&PyCells(py)) {
        // No cell is open to carry it: said where the user sees it.
        let _ = py.import("gpuexp.ipython").and_then(|m| m.call_method1("warn", (note,)));
    }
}
