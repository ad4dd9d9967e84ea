//! The cell log's share of torch's allocation history, with the log on and the trace on (for
//! every experiment by `gpuexp.config(trace=True)`, or for one that is open): joined once, at
//! the first logged cell that starts with CUDA initialised (the log never creates a CUDA
//! context), kept across cells, and given back as soon as the log or the trace is turned off,
//! so no recording outlives them. A cell reads the history only when its torch peak moved; with
//! the trace off, nothing here runs but a look at the settings.

use std::sync::Arc;

use pyo3::prelude::*;

use super::registry::registry;
use super::torch::PyTorch;
use super::trace;
use super::trace_recording;
use crate::fork::{Guard, PerProcess};
use crate::report::CellRecord;
use crate::snapshot::GpuSelection;

/// The cell log's share while it holds one.
struct Share {
    /// The ring buffer's size when gpuexp started the recording (None: the user's).
    max_entries: Option<u64>,
    /// When the running cell's window opened, in Unix microseconds (torch's `time_us` clock).
    cell_opened_us: i64,
    /// When the last logged cell ended: the next cell's window opens there when it carries on
    /// from it, as its figures do.
    last_end_us: Option<i64>,
}

/// A forked child holds no share of the parent's recording (trace_recording forgets it too).
static SHARE: PerProcess<Option<Share>> = PerProcess::new(|| None);

fn share() -> Guard<'static, Option<Share>> {
    SHARE.lock()
}

/// Whether the cell log should record: the log is on over GPUs, and the trace is on (for every
/// experiment, or for one that is open: a share of the recording beyond the log's own, which
/// `log_holds` tells).
fn wanted(log_holds: bool) -> bool {
    let (by_default, logging) = {
        let registry = registry();
        (registry.trace_by_default, registry.cell_log_active() && registry.cell_selection() != GpuSelection::None)
    };
    logging && (by_default.cuda() || trace_recording::open_shares() > usize::from(log_holds))
}

/// At a logged cell's start, once its window is open: joins the recording where the log wants
/// one and CUDA is initialised, and opens the cell's window of it. `carried` tells that the
/// cell's figures start where the last cell ended.
pub(super) fn begin_cell(py: Python, carried: bool) {
    let now = trace_recording::now_us();
    let mut share = share();
    if let Some(held) = share.as_mut() {
        held.cell_opened_us = held.last_end_us.filter(|_| carried).unwrap_or(now);
        return;
    }
    drop(share);
    if !wanted(false) || PyTorch::find(py).cuda().is_none() {
        return;
    }
    let (window, notes) = trace_recording::open(py);
    if window.unavailable.is_some() {
        // Torch without a CUDA GPU: the log stays as it is, and the next cell asks again.
        return;
    }
    *self::share() = Some(Share { max_entries: window.max_entries, cell_opened_us: now, last_end_us: None });
    let mut registry = registry();
    for note in notes {
        registry.note_cell(note);
    }
}

/// At a logged cell's end: the record with its torch peaks' top sites where the cell log holds
/// a share and a peak moved (the record as it was otherwise). The history is read only then.
pub(super) fn end_cell(py: Python, record: Arc<CellRecord>) -> Arc<CellRecord> {
    let now = trace_recording::now_us();
    let (since_us, max_entries) = {
        let mut share = share();
        let Some(held) = share.as_mut() else { return record };
        held.last_end_us = Some(now);
        (held.cell_opened_us, held.max_entries)
    };
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

/// Gives the cell log's share back where the log or the trace is now off: the recording stops
/// if gpuexp started it and no traced experiment still needs it. Cheap when no share is held.
pub(super) fn settle(py: Python) {
    let holds = share().is_some();
    if !holds || wanted(true) {
        return;
    }
    *share() = None;
    if let Some(note) = trace_recording::close(py) {
        // No cell is open to carry it: said where the user sees it.
        let _ = py.import("gpuexp.ipython").and_then(|m| m.call_method1("warn", (note,)));
    }
}
