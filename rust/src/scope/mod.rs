//! The scope registry: open scopes nest by time, each keeps its start snapshot and its peaks,
//! and finished scopes stay in this kernel's history.

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::report::{CellRecord, Details, Params, Report, Span};
use crate::snapshot::{Gauge, GpuSelection, Snapshot};
use crate::training::Runs;

mod attached;
pub mod cell_creep;
pub mod cell_log;
mod cells;
mod finishing;
pub mod lifecycle;
mod opening;
mod peaks;
mod running;
pub mod settings;
mod unreachable;
pub use attached::Attached;
use cells::CellEnd;
pub use cells::OpenCell;
pub use peaks::PeakBook;
pub use running::Inner;
pub use unreachable::{Dropped, Finish, Identities, SafePoint, Sighting, Unreachable};

pub type ScopeId = u64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Cpu,
    Gpu,
}

/// Who opened a scope. Replacement by name and the finishing of inner scopes never cross owners:
/// a trainer's callback that names its run like the user's experiment must not finish it (and
/// delete the user's names), and the user's scopes must not finish the tool's measurement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner {
    /// The user's code: `GPUExperiment(...)`, `%%gpuexp`.
    User,
    /// A tool of gpuexp's (a trainer's callback): it finishes its scope itself, and only its own.
    Tool,
}

#[derive(Debug)]
pub struct Scope {
    pub id: ScopeId,
    pub name: String,
    pub kind: Kind,
    pub selection: GpuSelection,
    pub start: Snapshot,
    pub keep: BTreeSet<String>,
    /// Set once teardown has begun: a second finish (say from `__del__` during teardown) waits for none.
    pub closing: bool,
    /// Whether the scope asks for the per-cell log.
    pub cell_log: bool,
    /// Index of the first cell record made while the scope was open.
    pub first_cell: usize,
    /// Bytes torch may allocate on each of the scope's GPUs (`limit=`), while it is open.
    pub limit: Option<u64>,
    /// The names the constructor's cell bound the experiment to (`exp = GPUExperiment(...)`):
    /// a later constructor bound to one of them replaces this scope.
    pub handles: BTreeSet<String>,
    /// What the experiment varied (`params=`); None: read from its name.
    pub params: Option<Params>,
    /// What the report should say beside its figures (how a training run ended).
    pub notes: Vec<String>,
    pub owner: Owner,
    /// When one of the user's names was last seen to lead to it (see `unreachable`).
    pub sighting: Option<Sighting>,
    /// Found unreachable where its teardown could not run, or finished on another thread: it
    /// waits for a safe point.
    pub unreachable: Option<Unreachable>,
    /// The experiment object registered at the opening (CPython's `id`): only it finishes the scope.
    owner_identity: Option<u64>,
    /// How many `with` blocks over it are running (see `running`).
    entered: u32,
    /// What the bindings keep for it (its pins into the user's namespace, its monitor, its trace
    /// windows, the experiment object): taken out when its teardown begins.
    attached: Attached,
}

/// What a scope opens with.
pub struct Opening {
    pub name: String,
    pub kind: Kind,
    pub selection: GpuSelection,
    pub start: Snapshot,
    pub cell_log: bool,
    pub limit: Option<u64>,
    pub handles: BTreeSet<String>,
    pub params: Option<Params>,
    pub owner: Owner,
}

/// Where a scope stands when someone asks to finish it.
pub enum Finishing {
    Finished(Arc<Report>),
    /// Teardown is under way further up the stack.
    InProgress,
    /// Its teardown begins: the scope stays open (closing) until its report is recorded.
    Ready(Closing),
    Unknown,
}

/// What a scope's teardown starts from, handed out once.
#[derive(Debug)]
pub struct Closing {
    pub selection: GpuSelection,
    pub keep: BTreeSet<String>,
    pub attached: Attached,
}

pub struct Registry {
    next_id: ScopeId,
    unnamed: u64,
    open: Vec<Scope>,
    finished: Vec<(ScopeId, Arc<Report>)>,
    pub peaks: PeakBook,
    cell: Option<OpenCell>,
    last_cell_end: Option<CellEnd>,
    cells: Vec<Arc<CellRecord>>,
    cell_creep: cell_creep::CellCreep,
    /// `%gpuexp log on`: the cell log without an experiment.
    pub standalone_log: bool,
    /// Show every GPU in the cell log, not only those the cell touched.
    pub cell_log_all_gpus: bool,
    /// Rescue after a CUDA OOM (on unless the user wants `%debug` on the failed frames).
    pub oom_rescue: bool,
    /// A cell's block shows only when a figure moved by this many bytes (its Δ or its peak above start).
    pub cell_log_min_change: u64,
    /// `%gpuexp log all`: every cell's block shows, whatever moved.
    pub cell_log_every_cell: bool,
    /// `gpuexp.config(trace=...)`: what every experiment records of where in the code it allocates.
    pub trace_by_default: crate::trace::TraceKinds,
    /// The scopes that are training runs measured by a framework's callback.
    pub runs: Runs,
    /// `gpuexp.config(flight_recorder=)`: torch's allocation history without stacks while gpuexp
    /// is active, for the OOM diagnosis.
    pub flight_recorder: bool,
}

/// The default of `cell_log_min_change`: less than this is the noise of running any cell.
pub const CELL_LOG_MIN_CHANGE: u64 = 1 << 20;

impl Default for Registry {
    fn default() -> Registry {
        Registry {
            next_id: 0,
            unnamed: 0,
            open: Vec::new(),
            finished: Vec::new(),
            peaks: PeakBook::default(),
            cell: None,
            last_cell_end: None,
            cells: Vec::new(),
            cell_creep: Default::default(),
            standalone_log: false,
            cell_log_all_gpus: false,
            oom_rescue: true,
            trace_by_default: crate::trace::TraceKinds::Off,
            cell_log_min_change: CELL_LOG_MIN_CHANGE,
            cell_log_every_cell: false,
            runs: Runs::default(),
            flight_recorder: true,
        }
    }
}

impl Registry {
    /// The name given, or the next `exp-N` where none was (a blank one would make a blank title).
    pub fn name_or_default(&mut self, name: Option<String>) -> String {
        name.filter(|name| !name.trim().is_empty()).unwrap_or_else(|| {
            self.unnamed += 1;
            format!("exp-{}", self.unnamed)
        })
    }

    fn next_window(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    pub fn open(&mut self, opening: Opening) -> ScopeId {
        let id = self.next_window();
        self.peaks.open(id, &opening.start);
        let Opening { name, kind, selection, start, cell_log, limit, handles, params, owner } = opening;
        let first_cell = self.cells.len();
        self.open.push(Scope {
            id,
            name,
            kind,
            selection,
            start,
            keep: BTreeSet::new(),
            closing: false,
            cell_log,
            first_cell,
            limit,
            handles,
            params,
            notes: Vec::new(),
            owner,
            sighting: None,
            unreachable: None,
            owner_identity: None,
            entered: 0,
            attached: Attached::default(),
        });
        id
    }

    /// Gives an open scope the bindings' handles (see [`Attached`]).
    pub fn attach(&mut self, id: ScopeId, attached: Attached) {
        if let Some(scope) = self.scope_mut(id) {
            scope.attached = attached;
        }
    }

    /// The handles of an open scope whose teardown has not begun.
    pub fn attached<H: 'static>(&self, id: ScopeId) -> Option<&H> {
        self.scope(id)?.attached.get()
    }

    /// Every open scope's handles, oldest first, with their ids.
    pub fn all_attached<H: 'static>(&self) -> impl Iterator<Item = (ScopeId, &H)> {
        self.open.iter().filter_map(|s| Some((s.id, s.attached.get()?)))
    }

    pub fn scope(&self, id: ScopeId) -> Option<&Scope> {
        self.open.iter().find(|s| s.id == id)
    }

    pub fn scope_mut(&mut self, id: ScopeId) -> Option<&mut Scope> {
        self.open.iter_mut().find(|s| s.id == id)
    }

    /// The open scopes a new one replaces: the one of the same name (re-running a constructor
    /// cell), and those bound to a name the new constructor's cell binds again (`exp = ...`
    /// after editing the name). They finish first, so the new baseline holds none of their memory.
    /// A scope in `on_stack` (the code that made it is still running) or whose `with` block
    /// runs (in any task or thread) is never replaced by its name: a helper's `with GPUExperiment("step")` inside the caller's
    /// `with GPUExperiment("step")` nests, and what the caller made in its block stays.
    /// Only the user's scopes replace, and are replaced: a tool's scope of the same name nests.
    pub fn replaced_by(
        &self,
        name: Option<&str>,
        handles: &BTreeSet<String>,
        on_stack: &BTreeSet<ScopeId>,
        owner: Owner,
    ) -> Vec<ScopeId> {
        if owner != Owner::User {
            return Vec::new();
        }
        let same_name = |s: &Scope| name == Some(s.name.as_str()) && !on_stack.contains(&s.id) && !s.running();
        self.open
            .iter()
            .filter(|s| s.owner == Owner::User && !s.closing && (same_name(s) || !s.handles.is_disjoint(handles)))
            .map(|s| s.id)
            .collect()
    }

    /// Marks the scope as closing and hands out what its teardown needs.
    pub fn begin_finish(&mut self, id: ScopeId) -> Finishing {
        if let Some(report) = self.report(id) {
            return Finishing::Finished(report);
        }
        match self.scope_mut(id) {
            Some(scope) if scope.closing => Finishing::InProgress,
            Some(scope) => {
                scope.closing = true;
                Finishing::Ready(Closing {
                    selection: scope.selection.clone(),
                    keep: scope.keep.clone(),
                    attached: std::mem::take(&mut scope.attached),
                })
            }
            None => Finishing::Unknown,
        }
    }

    /// Records the finished report and closes the scope's peak window (and a run's interval).
    pub fn complete(&mut self, id: ScopeId, report: Report) -> Arc<Report> {
        self.open.retain(|s| s.id != id);
        self.peaks.close(id);
        for window in self.runs.end(id).into_iter().flatten() {
            self.peaks.close(window);
        }
        let report = Arc::new(report);
        self.finished.push((id, report.clone()));
        report
    }

    /// Adds notes to a finished report (what publishing it across ranks found, which happens
    /// once the teardown is done): the history keeps the amended report, returned here. None
    /// when there is nothing to add or no such report.
    pub fn add_notes(&mut self, id: ScopeId, notes: Vec<String>) -> Option<Arc<Report>> {
        if notes.is_empty() {
            return None;
        }
        let (_, kept) = self.finished.iter_mut().find(|(done, _)| *done == id)?;
        let mut amended = Report::clone(kept);
        amended.notes.extend(notes);
        *kept = Arc::new(amended);
        Some(kept.clone())
    }

    /// A scope's report as it stands: final with `end`, live without. The registry adds the
    /// scope's peaks, its cells and its limit to `details`.
    pub fn report_of(&self, scope: &Scope, before: &Snapshot, end: Option<&Snapshot>, details: Details) -> Report {
        let mut notes = details.notes;
        notes.extend(scope.notes.iter().cloned());
        let details =
            Details { cells: self.cells_of(scope), limit: scope.limit, params: scope.params.clone(), notes, ..details };
        let span = Span { start: &scope.start, before_teardown: before, end };
        Report::build(&scope.name, scope.kind == Kind::Gpu, span, |gauge| self.peaks.peak(scope.id, gauge), details)
    }

    pub fn report(&self, id: ScopeId) -> Option<Arc<Report>> {
        self.finished.iter().find(|(done, _)| *done == id).map(|(_, r)| r.clone())
    }

    /// A scope's name, open or finished.
    pub fn name_of(&self, id: ScopeId) -> Option<String> {
        match self.scope(id) {
            Some(scope) => Some(scope.name.clone()),
            None => self.report(id).map(|r| r.name.clone()),
        }
    }

    /// The records of the cells that ran while a scope was open, so far or in its report.
    pub fn cells_of_id(&self, id: ScopeId) -> Option<Vec<CellRecord>> {
        match self.scope(id) {
            Some(scope) => Some(self.cells_of(scope)),
            None => self.report(id).map(|r| r.cells.clone()),
        }
    }

    pub fn history(&self) -> Vec<Arc<Report>> {
        self.finished.iter().map(|(_, r)| r.clone()).collect()
    }

    /// Whether any peak window is open (a scope or a logged cell): samplers are needed only then.
    pub fn has_windows(&self) -> bool {
        !self.peaks.is_empty()
    }

    /// Whether an open window covers GPUs.
    pub fn has_gpu_windows(&self) -> bool {
        self.open.iter().any(|s| s.kind == Kind::Gpu) || self.cell.as_ref().is_some_and(|c| !c.start.gpus.is_empty())
    }

    // ---- the per-cell log ----

    /// Whether gpuexp is active: an experiment open, or the cell log on. Nothing gpuexp hooks
    /// into (torch's allocation history, optimizer hooks) outlives this state.
    pub fn gpuexp_active(&self) -> bool {
        self.standalone_log || self.open.iter().any(|s| !s.closing)
    }

    pub fn cell_log_active(&self) -> bool {
        self.standalone_log || self.open.iter().any(|s| s.cell_log && !s.closing)
    }

    /// What the cell log measures: GPUs too, unless only CPU experiments asked for it.
    pub fn cell_selection(&self) -> GpuSelection {
        let gpu_wanted = self.standalone_log || self.open.iter().any(|s| s.cell_log && s.kind == Kind::Gpu);
        if gpu_wanted {
            GpuSelection::AllVisible
        } else {
            GpuSelection::None
        }
    }

    /// Opens a peak window of its own (one trial of the batch-size finder) at `start`, taken
    /// just before the counters are reset.
    pub fn open_window(&mut self, start: &Snapshot) -> u64 {
        let window = self.next_window();
        self.peaks.open(window, start);
        window
    }

    /// Closes a window opened by [`Registry::open_window`] (one trial of the batch-size finder),
    /// returning torch's peaks (allocated, reserved) on the GPU of `torch_index` in it, the end
    /// snapshot's counters included; None where the end snapshot has no such GPU.
    pub fn close_torch_window(&mut self, window: u64, end: &Snapshot, torch_index: u32) -> Option<(u64, u64)> {
        self.peaks.observe(end);
        let peak = |gauge| self.peaks.peak(window, &gauge);
        let peaks = end.gpus.iter().find(|g| g.torch_index == torch_index).and_then(|gpu| {
            peak(Gauge::TorchAllocated(gpu.uuid.clone())).zip(peak(Gauge::TorchReserved(gpu.uuid.clone())))
        });
        self.peaks.close(window);
        peaks
    }
}

#[cfg(test)]
mod lifecycle_tests;
#[cfg(test)]
mod running_tests;
#[cfg(test)]
mod tests;
