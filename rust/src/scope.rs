//! The scope registry: open scopes nest by time, each keeps its start snapshot and its peaks,
//! and finished scopes stay in this kernel's history.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use crate::report::{CellRecord, Report};
use crate::snapshot::{Gauge, GpuSelection, Snapshot};

pub type ScopeId = u64;

/// Peaks of nested windows over process-wide counters that can only be reset as a whole
/// (the kernel's VmHWM, torch's one peak per device). Before any reset, the counters' peaks
/// are folded into every open window, so opening an inner window never erases an outer peak.
#[derive(Default, Debug)]
pub struct PeakBook {
    windows: BTreeMap<u64, HashMap<Gauge, u64>>,
}

impl PeakBook {
    /// Folds a snapshot's values and counter peaks into every open window.
    pub fn observe(&mut self, snapshot: &Snapshot) {
        let gauges = snapshot.gauges();
        for peaks in self.windows.values_mut() {
            for (gauge, _, peak) in &gauges {
                let seen = peaks.entry(gauge.clone()).or_insert(0);
                *seen = (*seen).max(*peak);
            }
        }
    }

    /// Opens a window at `snapshot`, which must be taken just before the caller resets the
    /// counters: what they saw until then belongs to the windows already open.
    pub fn open(&mut self, window: u64, snapshot: &Snapshot) {
        self.observe(snapshot);
        let start = snapshot.gauges().into_iter().map(|(gauge, current, _)| (gauge, current)).collect();
        self.windows.insert(window, start);
    }

    pub fn peak(&self, window: u64, gauge: &Gauge) -> Option<u64> {
        self.windows.get(&window)?.get(gauge).copied()
    }

    pub fn close(&mut self, window: u64) {
        self.windows.remove(&window);
    }

    pub fn is_empty(&self) -> bool {
        self.windows.is_empty()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Cpu,
    Gpu,
}

#[derive(Clone, Debug)]
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
}

/// The cell being run while the log is on.
#[derive(Clone, Debug)]
pub struct OpenCell {
    pub window: u64,
    pub start: Snapshot,
    pub notes: Vec<String>,
}

/// Where a scope stands when someone asks to finish it.
pub enum Finishing {
    Finished(Arc<Report>),
    /// Teardown is under way further up the stack.
    InProgress,
    Ready(Box<Scope>),
    Unknown,
}

pub struct Registry {
    next_id: ScopeId,
    unnamed: u64,
    open: Vec<Scope>,
    finished: Vec<(ScopeId, Arc<Report>)>,
    pub peaks: PeakBook,
    cell: Option<OpenCell>,
    cells: Vec<Arc<CellRecord>>,
    /// `%gpuexp log on`: the cell log without an experiment.
    pub standalone_log: bool,
    /// Show every GPU in the cell log, not only those the cell touched.
    pub cell_log_all_gpus: bool,
    /// Rescue after a CUDA OOM (on unless the user wants `%debug` on the failed frames).
    pub oom_rescue: bool,
}

impl Default for Registry {
    fn default() -> Registry {
        Registry {
            next_id: 0,
            unnamed: 0,
            open: Vec::new(),
            finished: Vec::new(),
            peaks: PeakBook::default(),
            cell: None,
            cells: Vec::new(),
            standalone_log: false,
            cell_log_all_gpus: false,
            oom_rescue: true,
        }
    }
}

impl Registry {
    pub fn name_or_default(&mut self, name: Option<String>) -> String {
        name.unwrap_or_else(|| {
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
        let Opening { name, kind, selection, start, cell_log, limit, handles } = opening;
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
        });
        id
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
    pub fn replaced_by(&self, name: Option<&str>, handles: &BTreeSet<String>) -> Vec<ScopeId> {
        self.open
            .iter()
            .filter(|s| !s.closing && (name == Some(s.name.as_str()) || !s.handles.is_disjoint(handles)))
            .map(|s| s.id)
            .collect()
    }

    /// Scopes opened after `id` and still open, innermost first: they finish before it does.
    pub fn inner_of(&self, id: ScopeId) -> Vec<ScopeId> {
        match self.open.iter().position(|s| s.id == id) {
            Some(at) => self.open[at + 1..].iter().rev().filter(|s| !s.closing).map(|s| s.id).collect(),
            None => Vec::new(),
        }
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
                Finishing::Ready(Box::new(scope.clone()))
            }
            None => Finishing::Unknown,
        }
    }

    /// Records the finished report and closes the scope's peak window.
    pub fn complete(&mut self, id: ScopeId, report: Report) -> Arc<Report> {
        self.open.retain(|s| s.id != id);
        self.peaks.close(id);
        let report = Arc::new(report);
        self.finished.push((id, report.clone()));
        report
    }

    pub fn report(&self, id: ScopeId) -> Option<Arc<Report>> {
        self.finished.iter().find(|(done, _)| *done == id).map(|(_, r)| r.clone())
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

    /// Closes a window opened by [`Registry::open_window`], returning its peaks of `gauges`, the
    /// end snapshot's counters included.
    pub fn close_window<const N: usize>(
        &mut self,
        window: u64,
        end: &Snapshot,
        gauges: [Gauge; N],
    ) -> [Option<u64>; N] {
        self.peaks.observe(end);
        let peaks = gauges.map(|gauge| self.peaks.peak(window, &gauge));
        self.peaks.close(window);
        peaks
    }

    /// Opens the cell's peak window at `start`, taken just before the counters are reset.
    pub fn begin_cell(&mut self, start: Snapshot) {
        if let Some(stale) = self.cell.take() {
            self.peaks.close(stale.window);
        }
        let window = self.next_window();
        self.peaks.open(window, &start);
        self.cell = Some(OpenCell { window, start, notes: Vec::new() });
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

    /// Closes the running cell's window and records it under the shell's number for the cell.
    pub fn end_cell(&mut self, execution_count: u64, end: &Snapshot) -> Option<Arc<CellRecord>> {
        let cell = self.cell.take()?;
        self.peaks.observe(end);
        let peaks = &self.peaks;
        let record = CellRecord::build(execution_count, &cell.start, end, |g| peaks.peak(cell.window, g), cell.notes);
        self.peaks.close(cell.window);
        let record = Arc::new(record);
        self.cells.push(record.clone());
        Some(record)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn open_ids(registry: &Registry) -> Vec<ScopeId> {
        registry.open.iter().map(|s| s.id).collect()
    }
    use crate::report::{Names, Span};
    use crate::snapshot::testing::{gpu, host, torch, GIB};
    use crate::snapshot::GpuReading;

    const MIB: u64 = 1 << 20;

    fn rss(book: &PeakBook, window: u64) -> Option<u64> {
        book.peak(window, &Gauge::HostRss)
    }

    fn allocated(uuid: &str) -> Gauge {
        Gauge::TorchAllocated(uuid.to_string())
    }

    fn reserved(uuid: &str) -> Gauge {
        Gauge::TorchReserved(uuid.to_string())
    }

    /// A GPU whose torch allocator reports `stats` (allocated, reserved, peak allocated, peak reserved).
    fn torch_gpu(torch_index: u32, uuid: &str, stats: (u64, u64, u64, u64)) -> GpuReading {
        let (a, r, pa, pr) = stats;
        GpuReading { torch: Some(torch(a * GIB, r * GIB, pa * GIB, pr * GIB)), ..gpu(torch_index, uuid) }
    }

    fn report_named(name: &str) -> Report {
        let snapshot = host(0.0, 0, 0);
        Report::build(
            name,
            false,
            Span { start: &snapshot, before_teardown: &snapshot, end: Some(&snapshot) },
            |_| None,
            Names::default(),
        )
    }

    fn opening(name: &str, kind: Kind, selection: GpuSelection, start: Snapshot) -> Opening {
        Opening { name: name.into(), kind, selection, start, cell_log: false, limit: None, handles: BTreeSet::new() }
    }

    fn open_cpu(registry: &mut Registry, name: &str) -> ScopeId {
        registry.open(opening(name, Kind::Cpu, GpuSelection::None, host(0.0, 100 * MIB, 100 * MIB)))
    }

    fn open_bound_to(registry: &mut Registry, name: &str, handles: &[&str]) -> ScopeId {
        let handles = handles.iter().map(|h| h.to_string()).collect();
        registry.open(Opening { handles, ..opening(name, Kind::Cpu, GpuSelection::None, host(0.0, 0, 0)) })
    }

    // --- PeakBook -------------------------------------------------------------------------

    #[test]
    fn an_outer_window_keeps_a_host_peak_that_happened_before_an_inner_window_reset_the_counter() {
        let mut book = PeakBook::default();
        book.open(1, &host(0.0, 100 * MIB, 100 * MIB));
        // Spike to 500 then back to 120; the caller resets VmHWM right after opening the inner window.
        book.open(2, &host(1.0, 120 * MIB, 500 * MIB));
        // After the reset the counter reports peaks relative to 120 only.
        book.observe(&host(2.0, 130 * MIB, 300 * MIB));

        assert_eq!(rss(&book, 1), Some(500 * MIB), "the outer window must not lose the spike before the reset");
        assert_eq!(rss(&book, 2), Some(300 * MIB), "the inner window must not inherit the spike before it opened");

        book.close(2);
        book.observe(&host(3.0, 140 * MIB, 800 * MIB));
        assert_eq!(rss(&book, 1), Some(800 * MIB));
        assert_eq!(rss(&book, 2), None, "a closed window records nothing more");
    }

    #[test]
    fn a_trial_window_returns_every_peak_asked_for_with_the_end_counters() {
        // The batch-size finder reads peak allocated and reserved at once: torch's counters in
        // the end snapshot hold the step's peaks, so both must be read after it is observed.
        let mut registry = Registry::default();
        let mut start = host(0.0, 0, 0);
        start.gpus = vec![torch_gpu(0, "GPU-a", (1, 1, 1, 1))];
        let window = registry.open_window(&start);
        let mut end = host(1.0, 0, 0);
        end.gpus = vec![torch_gpu(0, "GPU-a", (1, 2, 3, 4))];
        let peaks = registry.close_window(window, &end, [allocated("GPU-a"), reserved("GPU-a")]);
        assert_eq!(peaks, [Some(3 * GIB), Some(4 * GIB)]);
        assert!(!registry.has_windows());
    }

    #[test]
    fn a_window_starts_at_the_current_value_not_at_the_counters_earlier_peak() {
        let mut book = PeakBook::default();
        book.open(7, &host(0.0, 120 * MIB, 900 * MIB));
        assert_eq!(rss(&book, 7), Some(120 * MIB));
    }

    #[test]
    fn a_peak_never_goes_down_when_later_readings_are_lower() {
        let mut book = PeakBook::default();
        book.open(1, &host(0.0, 100 * MIB, 100 * MIB));
        book.observe(&host(1.0, 400 * MIB, 400 * MIB));
        book.observe(&host(2.0, 50 * MIB, 50 * MIB));
        assert_eq!(rss(&book, 1), Some(400 * MIB));
    }

    #[test]
    fn a_counter_peak_below_the_current_value_still_counts_the_current_value() {
        // A counter that lags (or a sampler that missed the latest page) must not hide what is resident now.
        let mut book = PeakBook::default();
        book.open(1, &host(0.0, 100 * MIB, 100 * MIB));
        book.observe(&host(1.0, 250 * MIB, 200 * MIB));
        assert_eq!(rss(&book, 1), Some(250 * MIB));
    }

    #[test]
    fn torch_peaks_nest_per_gpu_uuid_and_two_gpus_do_not_mix() {
        let (a, b) = ("GPU-aaaa", "GPU-bbbb");
        let mut book = PeakBook::default();
        // Outer opens with A at 1 GiB and B at 10 GiB allocated.
        book.open(
            1,
            &host(0.0, 0, 0).with_gpu(torch_gpu(0, a, (1, 2, 1, 2))).with_gpu(torch_gpu(1, b, (10, 12, 10, 12))),
        );
        // A spiked to 5/6 GiB and B to 20/24 GiB, both back down; the GPU order differs in this snapshot.
        book.open(
            2,
            &host(1.0, 0, 0).with_gpu(torch_gpu(1, b, (11, 12, 20, 24))).with_gpu(torch_gpu(0, a, (1, 2, 5, 6))),
        );
        // After torch's reset: A spikes to 3/4 GiB inside the inner window, B stays flat.
        book.observe(&host(2.0, 0, 0).with_gpu(torch_gpu(0, a, (2, 4, 3, 4))).with_gpu(torch_gpu(
            1,
            b,
            (11, 12, 11, 12),
        )));

        assert_eq!(book.peak(1, &allocated(a)), Some(5 * GIB));
        assert_eq!(book.peak(1, &reserved(a)), Some(6 * GIB));
        assert_eq!(book.peak(2, &allocated(a)), Some(3 * GIB));
        assert_eq!(book.peak(2, &reserved(a)), Some(4 * GIB));
        assert_eq!(book.peak(1, &allocated(b)), Some(20 * GIB));
        assert_eq!(book.peak(1, &reserved(b)), Some(24 * GIB));
        assert_eq!(book.peak(2, &allocated(b)), Some(11 * GIB), "B's earlier spike belongs to the outer window only");
        assert_eq!(book.peak(2, &reserved(b)), Some(12 * GIB));

        book.close(2);
        book.observe(&host(3.0, 0, 0).with_gpu(torch_gpu(0, a, (2, 4, 8, 9))).with_gpu(torch_gpu(
            1,
            b,
            (11, 12, 11, 12),
        )));
        assert_eq!(book.peak(1, &allocated(a)), Some(8 * GIB));
        assert_eq!(book.peak(1, &reserved(a)), Some(9 * GIB));
        assert_eq!(book.peak(1, &allocated(b)), Some(20 * GIB), "A's spike must not show up under B");
        assert_eq!(book.peak(2, &allocated(a)), None);
    }

    #[test]
    fn gauges_without_a_counter_peak_at_the_highest_value_observed() {
        let uuid = "GPU-aaaa";
        let reading = |device_used: u64, process_used: u64| GpuReading {
            device_used: device_used * GIB,
            process_used: Some(process_used * GIB),
            ..gpu(0, uuid)
        };
        let mut book = PeakBook::default();
        book.open(1, &host(0.0, 0, 0).with_gpu(reading(1, 0)));
        book.observe(&host(1.0, 0, 0).with_gpu(reading(7, 5)));
        book.observe(&host(2.0, 0, 0).with_gpu(reading(2, 1)));
        assert_eq!(book.peak(1, &Gauge::DeviceUsed(uuid.into())), Some(7 * GIB));
        assert_eq!(book.peak(1, &Gauge::ProcessUsed(uuid.into())), Some(5 * GIB));
    }

    #[test]
    fn a_gauge_that_appears_mid_window_is_tracked_from_then_on() {
        let uuid = "GPU-aaaa";
        let mut book = PeakBook::default();
        // torch is not imported yet when the window opens: no torch gauges at all.
        book.open(1, &host(0.0, 0, 0).with_gpu(gpu(0, uuid)));
        assert_eq!(book.peak(1, &allocated(uuid)), None);

        book.observe(&host(1.0, 0, 0).with_gpu(torch_gpu(0, uuid, (1, 2, 3, 4))));
        assert_eq!(book.peak(1, &allocated(uuid)), Some(3 * GIB));
        assert_eq!(book.peak(1, &reserved(uuid)), Some(4 * GIB));

        // An inner window opened now starts from the current torch figures.
        book.open(2, &host(2.0, 0, 0).with_gpu(torch_gpu(0, uuid, (1, 2, 3, 4))));
        assert_eq!(book.peak(2, &allocated(uuid)), Some(GIB));
    }

    #[test]
    fn a_gpu_missing_from_a_later_snapshot_keeps_its_peaks() {
        let uuid = "GPU-aaaa";
        let mut book = PeakBook::default();
        book.open(1, &host(0.0, 0, 0).with_gpu(torch_gpu(0, uuid, (2, 2, 2, 2))));
        book.observe(&host(1.0, 0, 0));
        assert_eq!(book.peak(1, &allocated(uuid)), Some(2 * GIB));
    }

    #[test]
    fn is_empty_follows_open_and_close() {
        let mut book = PeakBook::default();
        assert!(book.is_empty());
        book.open(1, &host(0.0, 0, 0));
        book.open(2, &host(0.0, 0, 0));
        book.close(1);
        assert!(!book.is_empty());
        book.close(2);
        assert!(book.is_empty());
        // Closing twice, or a window never opened, is harmless.
        book.close(2);
        book.close(99);
        assert!(book.is_empty());
        assert_eq!(rss(&book, 99), None);
    }

    // --- Registry -------------------------------------------------------------------------

    #[test]
    fn default_names_are_numbered_and_given_names_do_not_use_a_number() {
        let mut registry = Registry::default();
        assert_eq!(registry.name_or_default(None), "exp-1");
        assert_eq!(registry.name_or_default(Some("train".into())), "train");
        assert_eq!(registry.name_or_default(None), "exp-2");
        assert_eq!(registry.name_or_default(Some("exp-7".into())), "exp-7");
        assert_eq!(registry.name_or_default(None), "exp-3");
    }

    #[test]
    fn open_keeps_what_the_scope_needs_and_ids_are_distinct() {
        let mut registry = Registry::default();
        let start = host(42.0, 100 * MIB, 100 * MIB).with_gpu(gpu(0, "GPU-aaaa"));
        let a = registry.open(Opening {
            limit: Some(24 << 30),
            ..opening("a", Kind::Gpu, GpuSelection::Only(vec![0]), start.clone())
        });
        let b = open_cpu(&mut registry, "b");
        assert_ne!(a, b);
        assert_eq!(open_ids(&registry), vec![a, b]);

        let scope = registry.scope(a).expect("a is open");
        assert_eq!((scope.id, scope.name.as_str(), scope.kind), (a, "a", Kind::Gpu));
        assert_eq!(scope.selection, GpuSelection::Only(vec![0]));
        assert_eq!(scope.start, start);
        assert!(scope.keep.is_empty());
        assert!(!scope.closing);
        assert_eq!(scope.limit, Some(24 << 30));

        registry.scope_mut(b).expect("b is open").keep.insert("model".into());
        assert!(registry.scope(b).unwrap().keep.contains("model"));
        assert!(registry.scope(12345).is_none());
    }

    #[test]
    fn opening_a_scope_opens_its_peak_window_and_completing_closes_it() {
        let mut registry = Registry::default();
        let outer = registry.open(opening("outer", Kind::Cpu, GpuSelection::None, host(0.0, 100 * MIB, 100 * MIB)));
        let inner = registry.open(opening("inner", Kind::Cpu, GpuSelection::None, host(1.0, 120 * MIB, 500 * MIB)));
        registry.peaks.observe(&host(2.0, 130 * MIB, 300 * MIB));
        assert_eq!(registry.peaks.peak(outer, &Gauge::HostRss), Some(500 * MIB));
        assert_eq!(registry.peaks.peak(inner, &Gauge::HostRss), Some(300 * MIB));

        registry.complete(inner, report_named("inner"));
        assert_eq!(registry.peaks.peak(inner, &Gauge::HostRss), None);
        registry.complete(outer, report_named("outer"));
        assert!(registry.peaks.is_empty());
    }

    #[test]
    fn a_new_scope_replaces_the_open_one_of_its_name_and_those_bound_to_a_name_it_rebinds() {
        let mut registry = Registry::default();
        let a = open_bound_to(&mut registry, "a", &["exp"]);
        let b = open_bound_to(&mut registry, "b", &["other"]);
        let none = BTreeSet::new();
        assert_eq!(registry.replaced_by(Some("a"), &none), vec![a]);
        assert_eq!(registry.replaced_by(Some("c"), &none), Vec::<ScopeId>::new());
        assert_eq!(registry.replaced_by(None, &["exp".to_string()].into()), vec![a], "exp = GPUExperiment(...) again");
        assert_eq!(registry.replaced_by(Some("b"), &["exp".to_string()].into()), vec![a, b]);

        assert!(matches!(registry.begin_finish(b), Finishing::Ready(_)));
        assert_eq!(
            registry.replaced_by(Some("b"), &none),
            Vec::<ScopeId>::new(),
            "a scope being torn down is not replaced"
        );
        registry.complete(a, report_named("a"));
        assert_eq!(registry.replaced_by(Some("a"), &none), Vec::<ScopeId>::new(), "a finished scope is history");
    }

    #[test]
    fn inner_of_lists_scopes_opened_later_innermost_first() {
        let mut registry = Registry::default();
        let a = open_cpu(&mut registry, "a");
        let b = open_cpu(&mut registry, "b");
        let c = open_cpu(&mut registry, "c");
        assert_eq!(registry.inner_of(a), vec![c, b]);
        assert_eq!(registry.inner_of(b), vec![c]);
        assert_eq!(registry.inner_of(c), Vec::<ScopeId>::new());
        assert_eq!(registry.inner_of(999), Vec::<ScopeId>::new());

        // A scope already being torn down is finished by whoever started that.
        assert!(matches!(registry.begin_finish(c), Finishing::Ready(_)));
        assert_eq!(registry.inner_of(a), vec![b]);

        registry.complete(c, report_named("c"));
        registry.complete(b, report_named("b"));
        assert_eq!(registry.inner_of(a), Vec::<ScopeId>::new());
        assert_eq!(registry.inner_of(b), Vec::<ScopeId>::new(), "a finished scope has no inner scopes");
    }

    #[test]
    fn begin_finish_hands_out_the_scope_once_then_waits_then_returns_the_report() {
        let mut registry = Registry::default();
        let id = open_cpu(&mut registry, "a");

        match registry.begin_finish(id) {
            Finishing::Ready(scope) => {
                assert_eq!((scope.id, scope.name.as_str()), (id, "a"));
                assert!(scope.closing);
            }
            _ => panic!("the first finish must get the scope"),
        }
        assert!(registry.scope(id).unwrap().closing);
        assert!(matches!(registry.begin_finish(id), Finishing::InProgress));
        assert!(matches!(registry.begin_finish(id), Finishing::InProgress));
        assert!(registry.has_windows(), "the scope stays open until its report is recorded");

        let recorded = registry.complete(id, report_named("a"));
        match registry.begin_finish(id) {
            Finishing::Finished(report) => assert!(Arc::ptr_eq(&report, &recorded)),
            _ => panic!("a completed scope must answer with its report"),
        }
        assert!(Arc::ptr_eq(&registry.report(id).unwrap(), &recorded));
        assert!(registry.scope(id).is_none());
    }

    #[test]
    fn begin_finish_of_an_unknown_scope_says_so() {
        let mut registry = Registry::default();
        assert!(matches!(registry.begin_finish(1), Finishing::Unknown));
        let id = open_cpu(&mut registry, "a");
        assert!(matches!(registry.begin_finish(id + 1), Finishing::Unknown));
        assert!(registry.report(id).is_none());
    }

    #[test]
    fn history_is_in_order_of_completion() {
        let mut registry = Registry::default();
        let a = open_cpu(&mut registry, "a");
        let b = open_cpu(&mut registry, "b");
        let c = open_cpu(&mut registry, "c");
        registry.complete(b, report_named("b"));
        registry.complete(a, report_named("a"));
        let names: Vec<String> = registry.history().iter().map(|r| r.name.clone()).collect();
        assert_eq!(names, ["b", "a"]);
        assert_eq!(open_ids(&registry), vec![c]);
        assert_eq!(registry.report(a).unwrap().name, "a");
        assert_eq!(registry.report(b).unwrap().name, "b");
    }

    #[test]
    fn has_windows_is_true_exactly_while_a_scope_is_open() {
        let mut registry = Registry::default();
        assert!(!registry.has_windows());
        let a = open_cpu(&mut registry, "a");
        let b = open_cpu(&mut registry, "b");
        assert!(registry.has_windows());
        registry.complete(a, report_named("a"));
        assert!(registry.has_windows());
        registry.complete(b, report_named("b"));
        assert!(!registry.has_windows());
        assert!(open_ids(&registry).is_empty());
    }
}
