//! The live view of a running cell: the drawing thread of `gpuexp.live` waits here, without
//! the GIL, until a drawing is due, then asks for the view, rendered from the sampler's latest
//! NVML sample and torch's allocator figures.

use pyo3::prelude::*;

use crate::bindings::registry::registry;
use crate::bindings::snapshot::take_live_snapshot;
use crate::live_view::schedule::SCHEDULE;

/// Blocks until a running cell's view is due: (the cell's window, whether the view is new);
/// None once `live_view_stop` ran.
#[pyfunction]
pub(in crate::bindings) fn live_view_wait(py: Python) -> Option<(u64, bool)> {
    py.detach(|| SCHEDULE.wait()).map(|tick| (tick.window, tick.first))
}

/// The view of the cell of `window` as it stands: (one line of at most `width` characters for
/// a terminal, the text table, the HTML); None once that cell has ended.
#[pyfunction]
pub(in crate::bindings) fn live_view(py: Python, window: u64, width: usize) -> Option<(String, String, String)> {
    if !SCHEDULE.is_running(window) {
        return None;
    }
    let selection = registry().open_cell_selection()?;
    let (now, _) = take_live_snapshot(py, &selection);
    let view = registry().live_view(window, &now)?;
    Some((view.to_line(width), view.grid().to_text(), view.to_html()))
}

/// Ends the drawing thread's wait for good (at interpreter exit).
#[pyfunction]
pub(in crate::bindings) fn live_view_stop(py: Python) {
    py.detach(|| SCHEDULE.stop());
}
