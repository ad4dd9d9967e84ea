use super::*;

fn open_ids(registry: &Registry) -> Vec<ScopeId> {
    registry.open.iter().map(|s| s.id).collect()
}
use crate::report::Details;
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
        Details::default(),
    )
}

fn opening(name: &str, kind: Kind, selection: GpuSelection, start: Snapshot) -> Opening {
    Opening {
        name: name.into(),
        kind,
        selection,
        start,
        cell_log: false,
        limit: None,
        handles: BTreeSet::new(),
        params: None,
        owner: Owner::User,
    }
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
    assert_eq!(registry.close_torch_window(window, &end, 0), Some((3 * GIB, 4 * GIB)));
    assert!(!registry.has_windows());
}

#[test]
fn a_trial_window_on_a_gpu_the_end_does_not_show_has_no_peaks_and_still_closes() {
    let mut registry = Registry::default();
    let window = registry.open_window(&host(0.0, 0, 0));
    let mut end = host(1.0, 0, 0);
    end.gpus = vec![torch_gpu(0, "GPU-a", (1, 2, 3, 4))];
    assert_eq!(registry.close_torch_window(window, &end, 1), None);
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
    book.open(1, &host(0.0, 0, 0).with_gpu(torch_gpu(0, a, (1, 2, 1, 2))).with_gpu(torch_gpu(1, b, (10, 12, 10, 12))));
    // A spiked to 5/6 GiB and B to 20/24 GiB, both back down; the GPU order differs in this snapshot.
    book.open(2, &host(1.0, 0, 0).with_gpu(torch_gpu(1, b, (11, 12, 20, 24))).with_gpu(torch_gpu(0, a, (1, 2, 5, 6))));
    // After torch's reset: A spikes to 3/4 GiB inside the inner window, B stays flat.
    book.observe(&host(2.0, 0, 0).with_gpu(torch_gpu(0, a, (2, 4, 3, 4))).with_gpu(torch_gpu(1, b, (11, 12, 11, 12))));

    assert_eq!(book.peak(1, &allocated(a)), Some(5 * GIB));
    assert_eq!(book.peak(1, &reserved(a)), Some(6 * GIB));
    assert_eq!(book.peak(2, &allocated(a)), Some(3 * GIB));
    assert_eq!(book.peak(2, &reserved(a)), Some(4 * GIB));
    assert_eq!(book.peak(1, &allocated(b)), Some(20 * GIB));
    assert_eq!(book.peak(1, &reserved(b)), Some(24 * GIB));
    assert_eq!(book.peak(2, &allocated(b)), Some(11 * GIB), "B's earlier spike belongs to the outer window only");
    assert_eq!(book.peak(2, &reserved(b)), Some(12 * GIB));

    book.close(2);
    book.observe(&host(3.0, 0, 0).with_gpu(torch_gpu(0, a, (2, 4, 8, 9))).with_gpu(torch_gpu(1, b, (11, 12, 11, 12))));
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
    assert_eq!(registry.name_or_default(Some(String::new())), "exp-4", "a blank name is no name");
    assert_eq!(registry.name_or_default(Some(" \t".into())), "exp-5");
}

#[test]
fn open_keeps_what_the_scope_needs_and_ids_are_distinct() {
    let mut registry = Registry::default();
    let start = host(42.0, 100 * MIB, 100 * MIB).with_gpu(gpu(0, "GPU-aaaa"));
    let a = registry
        .open(Opening { limit: Some(24 << 30), ..opening("a", Kind::Gpu, GpuSelection::Only(vec![0]), start.clone()) });
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
    let no_ids = BTreeSet::new();
    assert_eq!(registry.replaced_by(Some("a"), &none, &no_ids, Owner::User), vec![a]);
    assert_eq!(registry.replaced_by(Some("c"), &none, &no_ids, Owner::User), Vec::<ScopeId>::new());
    assert_eq!(
        registry.replaced_by(None, &["exp".to_string()].into(), &no_ids, Owner::User),
        vec![a],
        "exp = GPUExperiment(...) again"
    );
    assert_eq!(registry.replaced_by(Some("b"), &["exp".to_string()].into(), &no_ids, Owner::User), vec![a, b]);

    assert!(matches!(registry.begin_finish(b), Finishing::Ready(_)));
    assert_eq!(
        registry.replaced_by(Some("b"), &none, &no_ids, Owner::User),
        Vec::<ScopeId>::new(),
        "a scope being torn down is not replaced"
    );
    registry.complete(a, report_named("a"));
    assert_eq!(
        registry.replaced_by(Some("a"), &none, &no_ids, Owner::User),
        Vec::<ScopeId>::new(),
        "a finished scope is history"
    );
}

#[test]
fn a_scope_on_the_call_stack_is_nested_in_not_replaced_by_its_name() {
    let mut registry = Registry::default();
    let outer = open_bound_to(&mut registry, "step", &[]);
    let on_stack = BTreeSet::from([outer]);
    assert_eq!(registry.replaced_by(Some("step"), &BTreeSet::new(), &on_stack, Owner::User), Vec::<ScopeId>::new());
    assert_eq!(
        registry.replaced_by(Some("step"), &BTreeSet::new(), &BTreeSet::new(), Owner::User),
        vec![outer],
        "re-running the constructor's cell still replaces it"
    );
}

fn open_for_a_tool(registry: &mut Registry, name: &str) -> ScopeId {
    registry.open(Opening { owner: Owner::Tool, ..opening(name, Kind::Cpu, GpuSelection::None, host(0.0, 0, 0)) })
}

#[test]
fn a_tools_scope_never_replaces_the_users_scope_of_its_name_nor_the_names_it_binds() {
    let mut registry = Registry::default();
    let users = open_bound_to(&mut registry, "baseline", &["exp"]);
    let none = BTreeSet::new();
    let no_ids = BTreeSet::new();
    assert_eq!(registry.replaced_by(Some("baseline"), &none, &no_ids, Owner::Tool), Vec::<ScopeId>::new());
    assert_eq!(
        registry.replaced_by(Some("baseline"), &["exp".to_string()].into(), &no_ids, Owner::Tool),
        Vec::<ScopeId>::new(),
        "nor by a handle"
    );
    assert_eq!(
        registry.replaced_by(Some("baseline"), &none, &no_ids, Owner::User),
        vec![users],
        "the user's own still do"
    );
}

#[test]
fn a_users_scope_never_replaces_a_tools_scope_of_its_name() {
    let mut registry = Registry::default();
    let tools = open_for_a_tool(&mut registry, "MLP bs=32");
    let none = BTreeSet::new();
    let no_ids = BTreeSet::new();
    assert_eq!(registry.replaced_by(Some("MLP bs=32"), &none, &no_ids, Owner::User), Vec::<ScopeId>::new());
    assert_eq!(
        registry.replaced_by(Some("MLP bs=32"), &none, &no_ids, Owner::Tool),
        Vec::<ScopeId>::new(),
        "a tool finishes its own runs itself"
    );
    assert!(registry.scope(tools).is_some());
}

#[test]
fn finishing_never_finishes_an_inner_scope_of_another_owner() {
    let mut registry = Registry::default();
    let users = open_cpu(&mut registry, "baseline");
    let tools = open_for_a_tool(&mut registry, "baseline");
    let users_inner = open_cpu(&mut registry, "inside the run");
    assert_eq!(registry.inner_of(users).finish, vec![users_inner], "the tool's run stays open for the tool");
    assert_eq!(
        registry.inner_of(tools).finish,
        Vec::<ScopeId>::new(),
        "the tool's run ends alone, the user's stay open"
    );
}

#[test]
fn inner_of_lists_scopes_opened_later_innermost_first() {
    let mut registry = Registry::default();
    let a = open_cpu(&mut registry, "a");
    let b = open_cpu(&mut registry, "b");
    let c = open_cpu(&mut registry, "c");
    assert_eq!(registry.inner_of(a).finish, vec![c, b]);
    assert_eq!(registry.inner_of(b).finish, vec![c]);
    assert_eq!(registry.inner_of(c).finish, Vec::<ScopeId>::new());
    assert_eq!(registry.inner_of(999).finish, Vec::<ScopeId>::new());

    // A scope already being torn down is finished by whoever started that.
    assert!(matches!(registry.begin_finish(c), Finishing::Ready(_)));
    assert_eq!(registry.inner_of(a).finish, vec![b]);

    registry.complete(c, report_named("c"));
    registry.complete(b, report_named("b"));
    assert_eq!(registry.inner_of(a).finish, Vec::<ScopeId>::new());
    assert_eq!(registry.inner_of(b).finish, Vec::<ScopeId>::new(), "a finished scope has no inner scopes");
}

#[test]
fn begin_finish_hands_out_the_scope_once_then_waits_then_returns_the_report() {
    let mut registry = Registry::default();
    let id = open_cpu(&mut registry, "a");

    match registry.begin_finish(id) {
        Finishing::Ready(closing) => assert_eq!(closing.selection, GpuSelection::None),
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
fn a_scope_has_its_name_and_cells_while_open_and_from_its_report_once_finished() {
    let mut registry = Registry::default();
    let id = open_cpu(&mut registry, "a");
    assert_eq!(registry.name_of(id).as_deref(), Some("a"));
    assert_eq!(registry.cells_of_id(id).map(|c| c.len()), Some(0));
    registry.complete(id, report_named("b"));
    assert_eq!(registry.name_of(id).as_deref(), Some("b"), "the report's name once finished");
    assert!(registry.cells_of_id(id).is_some());
    assert_eq!((registry.name_of(id + 1), registry.cells_of_id(id + 1)), (None, None));
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
fn notes_added_after_completion_are_kept_in_the_history() {
    let mut registry = Registry::default();
    let a = open_cpu(&mut registry, "a");
    let first = registry.complete(a, report_named("a"));
    assert!(registry.add_notes(a, Vec::new()).is_none(), "nothing to add");
    let amended = registry.add_notes(a, vec!["publishing failed".into()]).unwrap();
    assert_eq!(amended.notes.last().map(String::as_str), Some("publishing failed"));
    assert_eq!(first.notes.len() + 1, amended.notes.len(), "the report handed out before stays as it was");
    assert!(Arc::ptr_eq(&registry.report(a).unwrap(), &amended) && Arc::ptr_eq(&registry.history()[0], &amended));
    assert!(registry.add_notes(a + 1, vec!["x".into()]).is_none(), "no such report");
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

// --- cells ------------------------------------------------------------------------------

#[test]
fn a_running_cell_shows_its_figures_so_far_and_only_for_its_own_window() {
    let mut registry = Registry::default();
    let window = registry.begin_cell(host(0.0, 100 * MIB, 100 * MIB));
    // A spike to 400 MiB came and went; VmHWM (reset at the cell's start) kept it.
    let now = host(3.0, 150 * MIB, 400 * MIB);
    let live = registry.running_cell(window, &now).expect("the cell is running");
    assert_eq!((live.host.consumed, live.host.peak_above_start), ((50 * MIB) as i64, 300 * MIB));
    assert!(registry.running_cell(window + 1, &now).is_none(), "another window is not this cell");
    // The live look folded the peak into the cell's window: its record keeps it.
    let record = registry.end_cell(7, &host(3.5, 150 * MIB, 150 * MIB)).expect("a record");
    assert_eq!(record.host.peak_above_start, 300 * MIB);
    assert!(registry.running_cell(window, &now).is_none(), "the cell has ended");
}

#[test]
fn a_block_shows_when_a_figure_moved_by_the_setting_or_every_cell_is_asked_for() {
    let mut registry = Registry::default();
    let record_after = |registry: &mut Registry, grew: u64| {
        registry.begin_cell(host(0.0, 100 * MIB, 100 * MIB));
        registry.end_cell(1, &host(0.1, 100 * MIB + grew, 100 * MIB + grew)).expect("a record")
    };
    let trivial = record_after(&mut registry, 16 << 10);
    let moved = record_after(&mut registry, 8 * MIB);
    assert_eq!(registry.cell_log_min_change, CELL_LOG_MIN_CHANGE);
    assert!(!registry.shows(&trivial) && registry.shows(&moved));
    registry.cell_log_min_change = 16 * MIB;
    assert!(!registry.shows(&moved));
    registry.cell_log_every_cell = true;
    assert!(registry.shows(&trivial) && registry.shows(&moved));
    assert_eq!(registry.cells().len(), 2, "quiet cells are recorded all the same");
}

#[test]
fn a_cell_starts_where_the_last_one_ended_while_nothing_came_in_between() {
    let mut registry = Registry::default();
    let all = GpuSelection::AllVisible;
    registry.begin_cell(host(0.0, 100 * MIB, 100 * MIB));
    let end = host(1.0, 120 * MIB, 130 * MIB);
    registry.end_cell(1, &end).expect("a record");
    registry.keep_cell_end(end, all.clone(), 7);
    registry.begin_cell_where_last_ended(&all, 7).expect("nothing came in between");
    let record = registry.end_cell(2, &host(2.0, 125 * MIB, 125 * MIB)).expect("a record");
    assert_eq!((record.host.start, record.host.consumed), (120 * MIB, (5 * MIB) as i64));
    assert!(record.wall_s < 1.0, "the cell's time starts when it begins, not where the last one ended");
    assert!(registry.begin_cell_where_last_ended(&all, 7).is_none(), "an end starts one cell only");

    let kept = |registry: &mut Registry| registry.keep_cell_end(host(3.0, 0, 0), GpuSelection::AllVisible, 7);
    kept(&mut registry);
    assert!(registry.begin_cell_where_last_ended(&all, 8).is_none(), "gpuexp read memory in between");
    kept(&mut registry);
    assert!(registry.begin_cell_where_last_ended(&GpuSelection::None, 7).is_none(), "the cell asks for less");
    kept(&mut registry);
    registry.forget_cell_end();
    assert!(registry.begin_cell_where_last_ended(&all, 7).is_none(), "the log was switched");
}

#[test]
fn the_limit_on_a_gpu_is_the_innermost_scope_over_it_that_has_one() {
    let mut registry = Registry::default();
    let start = host(0.0, 0, 0);
    let gpu_scope = |name: &str, selection: GpuSelection, limit: Option<u64>| Opening {
        limit,
        ..opening(name, Kind::Gpu, selection, start.clone())
    };
    registry.open(gpu_scope("outer", GpuSelection::AllVisible, Some(24 * GIB)));
    assert_eq!((registry.limit_on(0), registry.limit_on(1)), (Some(24 * GIB), Some(24 * GIB)));
    registry.open(gpu_scope("one", GpuSelection::Only(vec![1]), Some(8 * GIB)));
    registry.open(gpu_scope("none", GpuSelection::AllVisible, None));
    assert_eq!((registry.limit_on(0), registry.limit_on(1)), (Some(24 * GIB), Some(8 * GIB)));
    assert_eq!(Registry::default().limit_on(0), None);
}

#[test]
fn a_finished_run_closes_its_interval_windows_and_its_report_carries_its_notes() {
    let mut registry = Registry::default();
    let id = open_cpu(&mut registry, "run");
    let start = host(0.0, 100 * MIB, 100 * MIB);
    let windows = [registry.open_window(&start), registry.open_window(&start)];
    registry.runs.begin(id, windows);
    registry.scope_mut(id).unwrap().notes.push("the run raised OutOfMemoryError at epoch 1, step 5".into());
    let report = registry.report_of(registry.scope(id).unwrap(), &start, Some(&start), Details::default());
    assert!(report.notes.iter().any(|n| n.contains("epoch 1, step 5")), "{:?}", report.notes);
    registry.complete(id, report);
    assert!(!registry.runs.is_run(id));
    assert!(!registry.has_windows(), "the scope's window and both of the run's are closed");
}
