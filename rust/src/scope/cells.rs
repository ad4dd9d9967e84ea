//! The cell log's side of the registry: the running cell's window, where the last one ended,
//! and the records of the cells run.

use std::sync::Arc;

use super::cell_creep::HolderReading;
use super::{Registry, Scope};
use crate::live_view::LiveView;
use crate::report::CellRecord;
use crate::snapshot::{GpuSelection, Snapshot};

/// The cell being run while the log is on.
#[derive(Clone, Debug)]
pub struct OpenCell {
    pub window: u64,
    pub start: Snapshot,
    pub notes: Vec<String>,
    /// The holders the cell's code grows, read at its end ([`Registry::cell_grew`]).
    pub holders: Vec<HolderReading>,
}

/// Where the last logged cell ended, the counters reset there: the next cell starts from it
/// instead of reading memory again, unless gpuexp read it in between (`mark` tells).
#[derive(Clone, Debug)]
pub(super) struct CellEnd {
    snapshot: Snapshot,
    selection: GpuSelection,
    mark: u64,
}

impl Registry {
    /// Opens the cell's peak window at `start`, taken just before the counters are reset;
    /// returns the window, which names the cell to its live view.
    pub fn begin_cell(&mut self, start: Snapshot) -> u64 {
        if let Some(stale) = self.cell.take() {
            self.peaks.close(stale.window);
        }
        let window = self.next_window();
        self.peaks.open(window, &start);
        self.cell = Some(OpenCell { window, start, notes: Vec::new(), holders: Vec::new() });
        window
    }

    /// Keeps where a logged cell ended, the counters reset just after it, for a next cell that
    /// asks for `selection`; `mark` counts gpuexp's other readings (see
    /// [`Registry::begin_cell_where_last_ended`]).
    pub fn keep_cell_end(&mut self, snapshot: Snapshot, selection: GpuSelection, mark: u64) {
        self.last_cell_end = Some(CellEnd { snapshot, selection, mark });
    }

    pub fn forget_cell_end(&mut self) {
        self.last_cell_end = None;
    }

    /// Opens the cell's window where the previous logged cell ended, when nothing came in
    /// between that gpuexp knows of: the same `selection`, and `mark` unchanged, since every
    /// other reading gpuexp takes (a scope opening, a teardown, a user's snapshot) moves it.
    /// Memory that code between the two cells moved (a widget's callback, another extension's
    /// hook) is the new cell's. Returns the window, or None when the caller must read memory.
    pub fn begin_cell_where_last_ended(&mut self, selection: &GpuSelection, mark: u64) -> Option<u64> {
        let end = self.last_cell_end.take().filter(|end| end.mark == mark && end.selection == *selection)?;
        Some(self.begin_cell(Snapshot { taken_at: crate::snapshot::now(), ..end.snapshot }))
    }

    /// The running cell's figures so far (`now` against its start, with its peaks), for its
    /// live view; None unless `window` is still the running cell.
    pub fn running_cell(&mut self, window: u64, now: &Snapshot) -> Option<CellRecord> {
        let cell = self.cell.as_ref().filter(|c| c.window == window)?;
        self.peaks.observe(now);
        let peaks = &self.peaks;
        Some(CellRecord::build(0, &cell.start, now, |g| peaks.peak(window, g), cell.notes.clone()))
    }

    /// Whether a finished cell's block shows: with `%gpuexp log all` always, else only when a
    /// figure moved by `cell_log_min_change`.
    pub fn shows(&self, record: &CellRecord) -> bool {
        self.cell_log_every_cell || record.moved_by(self.cell_log_min_change)
    }

    /// The bytes torch may allocate on a GPU (by torch index): the `limit` of the innermost open
    /// scope over that GPU that has one.
    pub fn limit_on(&self, torch_index: u32) -> Option<u64> {
        let covers = |selection: &GpuSelection| match selection {
            GpuSelection::AllVisible => true,
            GpuSelection::Only(devices) => devices.contains(&torch_index),
            GpuSelection::None => false,
        };
        self.open.iter().rev().filter(|s| covers(&s.selection)).find_map(|s| s.limit)
    }

    /// What the running cell's start snapshot covered: its end snapshot must cover the same.
    pub fn open_cell_selection(&self) -> Option<GpuSelection> {
        let cell = self.cell.as_ref()?;
        Some(if cell.start.gpus.is_empty() { GpuSelection::None } else { GpuSelection::AllVisible })
    }

    /// Something the record of the running cell should say.
    pub fn note_cell(&mut self, note: String) {
        if let Some(cell) = self.cell.as_mut() {
            if !cell.notes.contains(&note) {
                cell.notes.push(note);
            }
        }
    }

    /// The holders the running cell's code grows, as read at its end: the cell log's creep note
    /// ([`super::cell_creep`]) looks at them when the cell is recorded.
    pub fn cell_grew(&mut self, holders: Vec<HolderReading>) {
        if let Some(cell) = self.cell.as_mut() {
            cell.holders = holders;
        }
    }

    /// Closes the running cell's window and records it under the shell's number for the cell.
    pub fn end_cell(&mut self, execution_count: u64, end: &Snapshot) -> Option<Arc<CellRecord>> {
        let cell = self.cell.take()?;
        self.peaks.observe(end);
        let peaks = &self.peaks;
        let mut record =
            CellRecord::build(execution_count, &cell.start, end, |g| peaks.peak(cell.window, g), cell.notes);
        self.peaks.close(cell.window);
        if let Some(note) = self.cell_creep.cell_ended(&record, cell.holders) {
            record.notes.push(note);
        }
        let record = Arc::new(record);
        self.cells.push(record.clone());
        Some(record)
    }

    /// Completes the last cell record with what was read once the cell had ended (the sites
    /// of its torch peaks, from the trace); returns the record as it now is.
    pub fn update_last_cell(&mut self, update: impl FnOnce(&mut CellRecord)) -> Option<Arc<CellRecord>> {
        let last = self.cells.last_mut()?;
        update(Arc::make_mut(last));
        Some(last.clone())
    }

    /// Every cell record of this kernel, oldest first.
    pub fn cells(&self) -> &[Arc<CellRecord>] {
        &self.cells
    }

    /// The records of the cells that ran while the scope was open.
    pub fn cells_of(&self, scope: &Scope) -> Vec<CellRecord> {
        self.cells[scope.first_cell.min(self.cells.len())..].iter().map(|c| c.as_ref().clone()).collect()
    }
}

impl Registry {
    /// The live view of the cell of `window` as `now` finds it; None once that cell has ended.
    pub fn live_view(&mut self, window: u64, now: &Snapshot) -> Option<LiveView> {
        let record = self.running_cell(window, now)?;
        Some(LiveView::build(&record, now, |index| self.limit_on(index), self.cell_log_all_gpus))
    }
}
