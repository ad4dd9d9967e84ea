use std::collections::HashMap;

use super::*;
use crate::grid::escape;
use crate::grid::testing::{expected_cells, html_cells, text_cells};
use crate::snapshot::testing::{gpu, host, torch, GIB};
use crate::snapshot::TorchStats;
use crate::teardown::Names;

const MIB: u64 = 1 << 20;

fn finished(name: &str, start: &Snapshot, before: &Snapshot, end: &Snapshot, peaks: &HashMap<Gauge, u64>) -> Report {
    let span = Span { start, before_teardown: before, end: Some(end) };
    Report::build(name, true, span, |g| peaks.get(g).copied(), Details::default())
}

fn no_peaks() -> HashMap<Gauge, u64> {
    HashMap::new()
}

fn with_torch(reading: GpuReading, allocated: u64, reserved: u64) -> GpuReading {
    GpuReading { torch: Some(torch(allocated, reserved, allocated, reserved)), ..reading }
}

fn with_used(reading: GpuReading, device_used: u64, process_used: Option<u64>) -> GpuReading {
    GpuReading { device_used, process_used, ..reading }
}

fn gpu_row<'a>(report: &'a Report, uuid: &str) -> &'a GpuReport {
    report.gpus.iter().find(|g| g.uuid == uuid).expect("a row for every GPU of the start snapshot")
}

// --- Metric ---------------------------------------------------------------------------

#[test]
fn consumed_and_reclaimed_are_measured_from_the_reading_before_teardown() {
    let m = Metric::new(100, 300, Some(120), 0);
    assert_eq!(m.consumed, 200);
    assert_eq!(m.reclaimed, Some(180));
    assert_eq!(m.reclaimed_share(), Some(0.9));
}

#[test]
fn consumed_and_reclaimed_can_be_negative() {
    // The scope freed more than it allocated, and teardown let something grow (a cache warming up).
    let m = Metric::new(300, 100, Some(150), 0);
    assert_eq!(m.consumed, -200);
    assert_eq!(m.reclaimed, Some(-50));
    assert_eq!(m.reclaimed_share(), None, "a share of a negative consumption means nothing");
}

#[test]
fn reclaimed_share_needs_something_consumed_and_an_end() {
    assert_eq!(Metric::new(100, 100, Some(50), 0).reclaimed_share(), None);
    assert_eq!(Metric::new(100, 300, None, 0).reclaimed_share(), None);
    assert_eq!(Metric::new(100, 300, None, 0).reclaimed, None);
    // Teardown can reclaim more than the scope consumed (memory from before it was freed too).
    assert_eq!(Metric::new(100, 200, Some(50), 0).reclaimed_share(), Some(1.5));
}

#[test]
fn the_peak_is_at_least_the_start_and_the_reading_before_teardown() {
    assert_eq!(Metric::new(100, 300, Some(0), 0).peak, 300);
    assert_eq!(Metric::new(500, 300, Some(0), 0).peak, 500);
    assert_eq!(Metric::new(100, 300, Some(0), 1000).peak, 1000);
}

#[test]
fn metrics_of_large_values_do_not_overflow() {
    let m = Metric::new(0, 80 * 1024 * GIB, Some(0), 0);
    assert_eq!(m.consumed, (80 * 1024 * GIB) as i64);
    assert_eq!(m.reclaimed, Some((80 * 1024 * GIB) as i64));
}

// --- Report::build --------------------------------------------------------------------

#[test]
fn the_host_row_takes_start_before_end_and_the_window_peak() {
    let start = host(10.0, 100 * MIB, 100 * MIB);
    let before = host(20.0, 400 * MIB, 400 * MIB);
    let mut end = host(25.5, 150 * MIB, 150 * MIB);
    end.host.available = 60 * GIB;
    end.host.total = 128 * GIB;
    end.host.cgroup_limit = Some(32 * GIB);
    let mut before = before;
    before.host.cgroup_limit = Some(32 * GIB);
    let peaks = HashMap::from([(Gauge::HostRss, 600 * MIB)]);

    let report = finished("exp-1", &start, &before, &end, &peaks);
    let rss = report.host.rss;
    assert_eq!((rss.start, rss.before_teardown, rss.end, rss.peak), (100 * MIB, 400 * MIB, Some(150 * MIB), 600 * MIB));
    assert_eq!(rss.consumed, (300 * MIB) as i64);
    assert_eq!(rss.reclaimed, Some((250 * MIB) as i64));
    assert_eq!(report.host.available, 60 * GIB, "available is what is left after teardown");
    assert_eq!(report.host.total, 128 * GIB);
    assert_eq!(report.host.cgroup_limit, Some(32 * GIB));
    assert_eq!(report.name, "exp-1");
    assert_eq!(report.kind, "gpu");
    assert!(report.finished);
    assert_eq!(report.started_at, "1970-01-01T00:00:10.000Z");
    assert_eq!(report.finished_at.as_deref(), Some("1970-01-01T00:00:25.500Z"));
    assert_eq!(report.duration_s, 15.5);
    assert!(report.gpus.is_empty());
}

#[test]
fn without_a_recorded_peak_the_peak_is_the_highest_reading() {
    let report = finished("a", &host(0.0, 100, 100), &host(1.0, 300, 300), &host(2.0, 50, 50), &no_peaks());
    assert_eq!(report.host.rss.peak, 300);
    // The end reading counts too: teardown itself can briefly raise memory.
    let report = finished("a", &host(0.0, 100, 100), &host(1.0, 300, 300), &host(2.0, 700, 700), &no_peaks());
    assert_eq!(report.host.rss.peak, 700);
}

#[test]
fn a_cpu_scope_reports_kind_cpu() {
    let s = host(0.0, 1, 1);
    let span = Span { start: &s, before_teardown: &s, end: Some(&s) };
    let report = Report::build("c", false, span, |_| None, Details::default());
    assert_eq!(report.kind, "cpu");
}

#[test]
fn a_trace_describes_the_gpus_whose_allocator_moved_or_all_when_none_did() {
    let (a, b) = ("GPU-aaaa", "GPU-bbbb");
    let snapshot = |at: f64, allocated_a: u64| {
        host(at, 0, 0)
            .with_gpu(with_torch(with_used(gpu(0, a), GIB, Some(0)), allocated_a, allocated_a))
            .with_gpu(with_torch(with_used(gpu(1, b), GIB, Some(0)), GIB, GIB))
    };
    let (start, end) = (snapshot(0.0, GIB), snapshot(2.0, GIB));
    let idle = finished("idle", &start, &start, &end, &no_peaks());
    assert_eq!(idle.traced_devices(), [0, 1], "nothing moved: every GPU keeps its section");
    // cuda:0 went up and back down within the scope; cuda:1 held its gigabyte throughout.
    let peaks = HashMap::from([(Gauge::TorchAllocated(a.into()), 3 * GIB)]);
    let used = finished("used", &start, &snapshot(1.0, GIB), &end, &peaks);
    assert_eq!(used.traced_devices(), [0]);
}

#[test]
fn gpu_rows_are_matched_by_uuid_when_the_gpu_order_changes() {
    let (a, b) = ("GPU-aaaa", "GPU-bbbb");
    let start = host(0.0, 0, 0).with_gpu(with_torch(with_used(gpu(0, a), GIB, Some(0)), 0, 0)).with_gpu(with_torch(
        with_used(gpu(1, b), 2 * GIB, Some(0)),
        0,
        0,
    ));
    // Listed the other way round from here on: rows must follow the UUID, not the position.
    let before = host(1.0, 0, 0)
        .with_gpu(with_torch(with_used(gpu(1, b), 20 * GIB, Some(18 * GIB)), 16 * GIB, 17 * GIB))
        .with_gpu(with_torch(with_used(gpu(0, a), 5 * GIB, Some(4 * GIB)), 3 * GIB, 4 * GIB));
    let end = host(2.0, 0, 0)
        .with_gpu(with_torch(with_used(gpu(1, b), 3 * GIB, Some(GIB)), 0, 0))
        .with_gpu(with_torch(with_used(gpu(0, a), 2 * GIB, Some(GIB)), GIB, GIB));
    let peaks =
        HashMap::from([(Gauge::TorchAllocated(a.into()), 7 * GIB), (Gauge::TorchAllocated(b.into()), 19 * GIB)]);
    let report = finished("x", &start, &before, &end, &peaks);

    assert_eq!(
        report.gpus.iter().map(|g| g.uuid.as_str()).collect::<Vec<_>>(),
        [a, b],
        "rows follow the start snapshot"
    );
    let row_a = gpu_row(&report, a);
    assert_eq!(row_a.torch_index, 0);
    assert_eq!(row_a.device_used.unwrap().before_teardown, 5 * GIB);
    assert_eq!(row_a.device_used.unwrap().end, Some(2 * GIB));
    assert_eq!(row_a.device_used.unwrap().consumed, (4 * GIB) as i64);
    let alloc_a = row_a.torch_allocated.unwrap();
    assert_eq!((alloc_a.before_teardown, alloc_a.end, alloc_a.peak), (3 * GIB, Some(GIB), 7 * GIB));
    assert_eq!(row_a.torch_reserved.unwrap().before_teardown, 4 * GIB);
    assert_eq!(row_a.process_used.unwrap().reclaimed, Some((3 * GIB) as i64));

    let row_b = gpu_row(&report, b);
    assert_eq!(row_b.torch_index, 1);
    assert_eq!(row_b.device_used.unwrap().consumed, (18 * GIB) as i64);
    assert_eq!(row_b.device_used.unwrap().reclaimed, Some((17 * GIB) as i64));
    let alloc_b = row_b.torch_allocated.unwrap();
    assert_eq!((alloc_b.before_teardown, alloc_b.end, alloc_b.peak), (16 * GIB, Some(0), 19 * GIB));
    assert_eq!(row_b.torch_reserved.unwrap().before_teardown, 17 * GIB);
}

#[test]
fn gpu_identity_comes_from_the_start_snapshot() {
    let reading = GpuReading { nvml_index: 3, name: "Tesla T4".into(), total: 16 * GIB, ..gpu(1, "GPU-cccc") };
    let s = host(0.0, 0, 0).with_gpu(reading);
    let report = finished("x", &s, &s, &s, &no_peaks());
    let row = &report.gpus[0];
    assert_eq!((row.torch_index, row.nvml_index), (1, 3));
    assert_eq!((row.name.as_str(), row.uuid.as_str(), row.total), ("Tesla T4", "GPU-cccc", 16 * GIB));
}

#[test]
fn torch_rows_are_absent_when_torch_was_never_imported() {
    let s = host(0.0, 0, 0).with_gpu(gpu(0, "GPU-aaaa"));
    let report = finished("x", &s, &s, &s, &no_peaks());
    let row = &report.gpus[0];
    assert_eq!(row.torch_allocated, None);
    assert_eq!(row.torch_reserved, None);
    assert_eq!(row.num_ooms, None);
    assert!(row.process_used.is_some(), "NVML rows do not depend on torch");
}

#[test]
fn torch_imported_mid_scope_counts_from_zero() {
    let uuid = "GPU-aaaa";
    let start = host(0.0, 0, 0).with_gpu(gpu(0, uuid));
    let before = host(1.0, 0, 0).with_gpu(with_torch(gpu(0, uuid), 3 * GIB, 4 * GIB));
    let end = host(2.0, 0, 0).with_gpu(with_torch(gpu(0, uuid), GIB, GIB));
    let peaks = HashMap::from([(Gauge::TorchAllocated(uuid.into()), 5 * GIB)]);
    let report = finished("x", &start, &before, &end, &peaks);
    let allocated = report.gpus[0].torch_allocated.expect("torch was imported during the scope");
    assert_eq!(allocated.start, 0);
    assert_eq!(allocated.consumed, (3 * GIB) as i64);
    assert_eq!(allocated.reclaimed, Some((2 * GIB) as i64));
    assert_eq!(allocated.peak, 5 * GIB);
    let reserved = report.gpus[0].torch_reserved.expect("torch was imported during the scope");
    assert_eq!((reserved.start, reserved.consumed, reserved.peak), (0, (4 * GIB) as i64, 4 * GIB));
}

#[test]
fn num_ooms_counts_those_since_the_scope_began() {
    let uuid = "GPU-aaaa";
    let ooms = |n: u64| GpuReading { torch: Some(TorchStats { num_ooms: n, ..torch(0, 0, 0, 0) }), ..gpu(0, uuid) };
    let at = |t: f64, n: u64| host(t, 0, 0).with_gpu(ooms(n));
    let report = finished("x", &at(0.0, 1), &at(1.0, 2), &at(2.0, 3), &no_peaks());
    assert_eq!(report.gpus[0].num_ooms, Some(2), "torch's counter is for the process: one came before");
}

#[test]
fn params_come_from_the_name_unless_given() {
    let snapshot = host(0.0, 0, 0);
    let span = || Span { start: &snapshot, before_teardown: &snapshot, end: Some(&snapshot) };
    let from_name = Report::build("bs=64,lr=3e-4", false, span(), |_| None, Details::default());
    assert_eq!(serde_json::to_value(&from_name).unwrap()["params"], serde_json::json!({"bs": 64, "lr": 0.0003}));
    let given = Params(vec![("bs".into(), Param::Int(32))]);
    let details = Details { params: Some(given.clone()), ..Details::default() };
    assert_eq!(Report::build("bs=64", false, span(), |_| None, details).params, given);
}

#[test]
fn process_used_is_unavailable_if_any_snapshot_lacked_it() {
    let uuid = "GPU-aaaa";
    let at = |t: f64, process: Option<u64>| host(t, 0, 0).with_gpu(with_used(gpu(0, uuid), GIB, process));
    let known = Some(GIB);
    for (missing_in, (s, b, e)) in
        [("start", (None, known, known)), ("before teardown", (known, None, known)), ("end", (known, known, None))]
    {
        let report = finished("x", &at(0.0, s), &at(1.0, b), &at(2.0, e), &no_peaks());
        assert_eq!(report.gpus[0].process_used, None, "process_used was missing in the {missing_in} snapshot");
        assert!(report.gpus[0].device_used.unwrap().end.is_some(), "the device row stays available");
    }
    let report = finished("x", &at(0.0, known), &at(1.0, known), &at(2.0, known), &no_peaks());
    assert!(report.gpus[0].process_used.is_some());

    // While the scope is open only start and now count.
    let (s, now) = (at(0.0, known), at(1.0, known));
    let span = Span { start: &s, before_teardown: &now, end: None };
    let live = Report::build("x", true, span, |_| None, Details::default());
    assert!(live.gpus[0].process_used.is_some());
}

#[test]
fn notes_are_deduplicated_in_order_of_first_appearance() {
    let start = host(0.0, 0, 0).with_note("x").with_note("y");
    let before = host(1.0, 0, 0).with_note("y").with_note("z");
    let end = host(2.0, 0, 0).with_note("x").with_note("w");
    let report = finished("x", &start, &before, &end, &no_peaks());
    assert_eq!(report.notes, ["x", "y", "z", "w"]);
}

#[test]
fn a_live_report_is_not_finished_and_reclaims_nothing() {
    let uuid = "GPU-aaaa";
    let start = host(100.0, 100 * MIB, 100 * MIB).with_gpu(with_torch(gpu(0, uuid), 0, 0));
    let mut now = host(103.0, 300 * MIB, 300 * MIB).with_gpu(with_torch(gpu(0, uuid), GIB, 2 * GIB)).with_note("n");
    now.host.available = 50 * GIB;
    let span = Span { start: &start, before_teardown: &now, end: None };
    let report = Report::build("live", true, span, |_| None, Details::default());
    assert!(!report.finished);
    assert_eq!(report.finished_at, None);
    assert_eq!(report.duration_s, 3.0);
    assert_eq!(report.host.available, 50 * GIB);
    assert_eq!(report.host.rss.end, None);
    assert_eq!(report.host.rss.reclaimed, None);
    assert_eq!(report.host.rss.consumed, (200 * MIB) as i64);
    let row = &report.gpus[0];
    for m in
        [row.torch_allocated.unwrap(), row.torch_reserved.unwrap(), row.process_used.unwrap(), row.device_used.unwrap()]
    {
        assert_eq!((m.end, m.reclaimed), (None, None));
    }
    assert_eq!(row.torch_allocated.unwrap().consumed, GIB as i64);
    assert_eq!(report.notes, ["n"]);
}

#[test]
fn a_gpu_that_could_not_be_read_at_the_end_is_not_reported_as_fully_reclaimed() {
    let uuid = "GPU-aaaa";
    let start = host(0.0, 0, 0).with_gpu(with_torch(with_used(gpu(0, uuid), GIB, Some(0)), 0, 0));
    let busy = with_used(gpu(0, uuid), 20 * GIB, Some(19 * GIB));
    let before = host(1.0, 0, 0).with_gpu(with_torch(busy, 18 * GIB, 18 * GIB));
    // Snapshot::take drops a GPU it cannot read and leaves a note instead.
    let end = host(2.0, 0, 0).with_note("cuda:0 could not be read through NVML: Unknown Error");
    let report = finished("x", &start, &before, &end, &no_peaks());
    let row = &report.gpus[0];
    assert_ne!(row.device_used.unwrap().end, Some(0), "0 is a made-up reading, not what the device showed");
    assert_ne!(row.device_used.unwrap().reclaimed, Some((20 * GIB) as i64));
    assert_ne!(row.torch_allocated.unwrap().reclaimed, Some((18 * GIB) as i64));
}

// --- text, HTML and JSON --------------------------------------------------------------

/// A finished report with a bit of everything: two GPUs, torch on one, an unavailable
/// NVML process figure, names, and text that needs escaping in HTML.
fn rich_report() -> Report {
    let (a, b) = ("GPU-aaaa", "GPU-bbbb");
    let start = host(1_700_000_000.0, 100 * MIB, 100 * MIB)
        .with_gpu(with_torch(with_used(gpu(0, a), GIB, Some(0)), 0, 0))
        .with_gpu(with_used(gpu(1, b), 2 * GIB, None))
        .with_note("cuda:1: the driver does not report per-process memory");
    let before = host(1_700_000_012.3, 900 * MIB, 900 * MIB)
        .with_gpu(with_torch(with_used(gpu(0, a), 11 * GIB, Some(10 * GIB)), 8 * GIB, 9 * GIB))
        .with_gpu(with_used(gpu(1, b), 2 * GIB, None))
        .with_note("cuda:1: the driver does not report per-process memory");
    let end = host(1_700_000_013.0, 300 * MIB, 300 * MIB)
        .with_gpu(with_torch(with_used(gpu(0, a), 2 * GIB, Some(GIB)), 0, 0))
        .with_gpu(with_used(gpu(1, b), 2 * GIB, None))
        .with_note("teardown <gc> & \"friends\"");
    let peaks = HashMap::from([(Gauge::HostRss, GIB), (Gauge::TorchAllocated(a.into()), 10 * GIB)]);
    let names = Names {
        deleted: vec!["x".into(), "model".into()],
        rebound: vec!["y".into()],
        kept: vec!["keep_me".into()],
        cleared: vec!["Out[3]".into(), "_".into()],
        not_deleted: vec!["weird (still bound after del)".into()],
        left: vec!["_1".into(), "__cache__".into()],
    };
    let span = Span { start: &start, before_teardown: &before, end: Some(&end) };
    Report::build(
        "train <big> & \"fast\"",
        true,
        span,
        |g| peaks.get(g).copied(),
        Details { names, ..Details::default() },
    )
}

fn live_report() -> Report {
    let start = host(0.0, 100 * MIB, 100 * MIB).with_gpu(with_torch(gpu(0, "GPU-aaaa"), 0, 0));
    let now = host(2.0, 200 * MIB, 200 * MIB).with_gpu(with_torch(gpu(0, "GPU-aaaa"), GIB, GIB));
    let span = Span { start: &start, before_teardown: &now, end: None };
    let names = Names { deleted: vec!["never shown while running".into()], ..Names::default() };
    Report::build("live", true, span, |_| None, Details { names, ..Details::default() })
}

#[test]
fn text_and_html_show_the_same_cells() {
    for report in [rich_report(), live_report()] {
        let grid = report.grid();
        let expected = expected_cells(&grid);
        assert_eq!(text_cells(&report.grid().to_text()), expected, "text of {}", report.name);
        assert_eq!(html_cells(&report.grid().to_html()), expected, "HTML of {}", report.name);
    }
}

#[test]
fn every_cell_string_appears_in_text_and_escaped_in_html() {
    let report = rich_report();
    let (text, html) = (report.grid().to_text(), report.grid().to_html());
    let grid = report.grid();
    for cell in grid.rows.iter().flatten().chain(&grid.header) {
        assert!(text.contains(cell.as_str()), "text lacks {cell:?}");
        assert!(html.contains(&escape(cell)), "HTML lacks {cell:?}");
    }
    for line in std::iter::once(&grid.title).chain(&grid.lines).chain(&grid.notes) {
        assert!(text.contains(line.as_str()), "text lacks {line:?}");
        assert!(html.contains(&escape(line)), "HTML lacks {line:?}");
    }
}

#[test]
fn the_grid_shows_each_figure_of_the_report() {
    let report = rich_report();
    let grid = report.grid();
    let row =
        |label: &str| grid.rows.iter().find(|r| r[0] == label).unwrap_or_else(|| panic!("no row {label}")).clone();

    let rss = report.host.rss;
    let share = format!("{:.1}%", 100.0 * (900.0 - 300.0) / (900.0 - 100.0));
    assert_eq!(
        row("host RSS"),
        ["host RSS", "100.00 MiB", "1.00 GiB", "+800.00 MiB", "+600.00 MiB", share.as_str(), "300.00 MiB"]
    );
    assert_eq!(rss.peak, GIB);
    assert_eq!(
        row("cuda:0 torch allocated"),
        ["cuda:0 torch allocated", "0 B", "10.00 GiB", "+8.00 GiB", "+8.00 GiB", "100.0%", "0 B"]
    );
    assert_eq!(row("cuda:0 NVML device")[3], "+10.00 GiB");
    // Rows without torch are left out; an unavailable NVML process figure is shown as such.
    assert!(grid.rows.iter().all(|r| r[0] != "cuda:1 torch allocated" && r[0] != "cuda:1 torch reserved"));
    assert_eq!(row("cuda:1 NVML process")[1..], ["n/a"; 6]);
    assert_eq!(row("cuda:1 NVML device")[3..6], ["0 B", "0 B", "—"]);

    assert_eq!(grid.header.last().unwrap(), "end");
    assert!(grid.title.contains("finished"), "{}", grid.title);
    assert!(grid.title.contains("13.0 s"), "{}", grid.title);
    assert!(grid.lines.contains(&"deleted: x, model".to_string()), "{:?}", grid.lines);
    assert!(grid.lines.contains(&"rebound (deleted): y".to_string()));
    assert!(grid.lines.contains(&"kept: keep_me".to_string()));
    assert!(grid.lines.contains(&"cleared: Out[3], _".to_string()));
    let identifies_gpu_b =
        |l: &String| l.starts_with("cuda:1 = NVML 1 · ") && l.contains("GPU-bbbb") && l.ends_with("80.00 GiB total");
    assert!(grid.lines.iter().any(identifies_gpu_b), "{:?}", grid.lines);
}

#[test]
fn a_live_grid_shows_now_and_no_teardown() {
    let report = live_report();
    let grid = report.grid();
    assert_eq!(grid.header.last().unwrap(), "now");
    assert!(grid.title.contains("running"), "{}", grid.title);
    assert!(grid.lines.iter().all(|l| !l.starts_with("deleted")), "{:?}", grid.lines);
    let rss = grid.rows.iter().find(|r| r[0] == "host RSS").unwrap();
    assert_eq!(rss[4..], ["—", "—", "200.00 MiB"]);
}

#[test]
fn a_finished_scope_that_deleted_nothing_says_so() {
    let s = host(0.0, 0, 0);
    let names = Names { kept: vec!["k".into()], ..Names::default() };
    let report = Report::build(
        "n",
        false,
        Span { start: &s, before_teardown: &s, end: Some(&s) },
        |_| None,
        Details { names, ..Details::default() },
    );
    let text = report.grid().to_text();
    assert!(text.contains("deleted: nothing"), "{text}");
    assert!(text.contains("kept: k"), "{text}");
}

#[test]
fn html_escapes_names_and_notes() {
    let html = rich_report().grid().to_html();
    assert!(html.contains("train &lt;big&gt; &amp; &quot;fast&quot;"), "{html}");
    assert!(html.contains("teardown &lt;gc&gt; &amp; &quot;friends&quot;"), "{html}");
    assert!(!html.contains("<big>") && !html.contains("<gc>"));
    let text = rich_report().grid().to_text();
    assert!(text.contains("train <big> & \"fast\""), "the text table shows names as they are");
    assert!(text.contains("note: teardown <gc> & \"friends\""));
}

#[test]
fn a_report_reads_back_from_its_json_with_its_cells_and_timeline() {
    let mut report = rich_report();
    let (start, end) = (host(1_700_000_000.25, 100 * MIB, 100 * MIB), host(1_700_000_001.5, 300 * MIB, 300 * MIB));
    report.cells.push(CellRecord::build(7, &start, &end, |_| None, vec!["a note".into()]));
    report.monitor.push(crate::monitor::Sample {
        t: 0.1,
        time: 1_700_000_000.5,
        cpu_percent: 12.5,
        rss: MIB,
        available: GIB,
        gpus: Vec::new(),
    });
    let back: Report = serde_json::from_str(&serde_json::to_string(&report).unwrap()).expect("reads back");
    assert_eq!(serde_json::to_value(&back).unwrap(), serde_json::to_value(&report).unwrap());
    assert_eq!(back.cells.len(), 1);
    assert_eq!(back.monitor, report.monitor);
    assert_eq!(back.names, report.names);
}

#[test]
fn names_that_failed_or_were_left_show_under_their_own_headings() {
    let text = rich_report().grid().to_text();
    assert!(text.contains("not deleted, still bound: weird (still bound after del)"), "{text}");
    assert!(text.contains("left, looks like IPython's: _1, __cache__"), "{text}");
    assert!(!text.contains("deleted: x, model, weird"), "{text}");
}

#[test]
fn json_has_the_documented_schema() {
    let json: serde_json::Value =
        serde_json::from_str(&serde_json::to_string_pretty(&rich_report()).unwrap()).expect("valid JSON");
    let names = ["deleted", "rebound", "kept", "cleared"];
    for key in ["name", "started_at", "finished_at", "duration_s", "host", "gpus", "notes"].into_iter().chain(names) {
        assert!(json.get(key).is_some(), "missing {key}");
    }
    assert!(json.get("names").is_none(), "names are flattened into the top level");
    assert_eq!(json["name"], "train <big> & \"fast\"");
    assert_eq!(json["started_at"], "2023-11-14T22:13:20.000Z");
    assert_eq!(json["finished_at"], "2023-11-14T22:13:33.000Z");
    assert_eq!(json["deleted"], serde_json::json!(["x", "model"]));
    assert_eq!(json["cleared"], serde_json::json!(["Out[3]", "_"]));

    let rss = &json["host"]["rss"];
    for key in ["start", "before_teardown", "end", "peak", "consumed", "reclaimed"] {
        assert!(rss.get(key).is_some(), "missing host.rss.{key}");
    }
    assert_eq!(rss["start"], 100 * MIB);
    assert_eq!(rss["consumed"], 800 * MIB as i64);
    assert_eq!(rss["reclaimed"], 600 * MIB as i64);
    assert!(json["host"]["available"].is_u64());
    assert!(json["host"]["total"].is_u64());

    let gpus = json["gpus"].as_array().expect("gpus is a list");
    assert_eq!(gpus.len(), 2);
    for g in gpus {
        let identity = ["torch_index", "nvml_index", "uuid", "name", "total"];
        let metrics = ["torch_allocated", "torch_reserved", "process_used", "device_used"];
        for key in identity.into_iter().chain(metrics) {
            assert!(g.get(key).is_some(), "missing gpus[].{key} in {g}");
        }
    }
    assert_eq!(gpus[0]["uuid"], "GPU-aaaa");
    assert_eq!(gpus[0]["torch_allocated"]["peak"], 10 * GIB);
    assert!(gpus[1]["torch_allocated"].is_null(), "absent torch is null, not zeros");
    assert!(gpus[1]["process_used"].is_null());
    assert_eq!(gpus[1]["device_used"]["start"], 2 * GIB);
}

#[test]
fn json_of_a_live_report_has_no_end() {
    let json: serde_json::Value = serde_json::from_str(&serde_json::to_string_pretty(&live_report()).unwrap()).unwrap();
    assert!(json["finished_at"].is_null());
    assert_eq!(json["finished"], false);
    assert!(json["host"]["rss"]["end"].is_null());
    assert!(json["host"]["rss"]["reclaimed"].is_null());
}

// --- snapshot_grid --------------------------------------------------------------------

#[test]
fn the_snapshot_grid_shows_used_free_and_total() {
    let mut s = host(1_700_000_000.25, 3 * GIB, 3 * GIB)
        .with_gpu(with_torch(with_used(gpu(0, "GPU-aaaa"), 5 * GIB, Some(4 * GIB)), GIB, 2 * GIB))
        .with_gpu(with_used(gpu(1, "GPU-bbbb"), GIB, None));
    s.host.cgroup_limit = Some(16 * GIB);
    let grid = snapshot_grid(&s, "now");
    let row =
        |label: &str| grid.rows.iter().find(|r| r[0] == label).unwrap_or_else(|| panic!("no row {label}")).clone();

    assert_eq!(grid.title, "gpuexp · now · 2023-11-14T22:13:20.250Z");
    assert_eq!(row("host RSS")[1], "3.00 GiB");
    assert_eq!(row("host system")[1..], ["64.00 GiB", "64.00 GiB", "128.00 GiB"]);
    assert_eq!(row("host cgroup limit")[3], "16.00 GiB");
    assert_eq!(row("cuda:0 torch allocated")[1], "1.00 GiB");
    assert_eq!(row("cuda:0 torch reserved")[1], "2.00 GiB");
    assert_eq!(row("cuda:0 NVML process")[1], "4.00 GiB");
    assert_eq!(row("cuda:0 NVML device")[1..], ["5.00 GiB", "79.00 GiB", "80.00 GiB"]);
    assert_eq!(row("cuda:1 NVML process")[1], "n/a");
    assert!(grid.rows.iter().all(|r| !r[0].starts_with("cuda:1 torch")));
    assert_eq!(grid.lines.len(), 2);
    // The same cells come out in both renderings here too.
    assert_eq!(text_cells(&grid.to_text()), expected_cells(&grid));
    assert_eq!(html_cells(&grid.to_html()), expected_cells(&grid));
}

#[test]
fn changes_below_the_noise_floor_read_as_about_zero_in_tables_and_stay_exact_in_json() {
    // An experiment that did nothing: the host grew 8 KiB and gave back 8 KiB less than that.
    let (start, before, end) = (
        host(0.0, 100 * MIB, 100 * MIB),
        host(1.0, 100 * MIB + 8192, 100 * MIB + 8192),
        host(2.0, 100 * MIB + 16384, 100 * MIB + 16384),
    );
    let report = Report::build(
        "idle",
        false,
        Span { start: &start, before_teardown: &before, end: Some(&end) },
        |_| None,
        Details::default(),
    );
    let grid = report.grid();
    let rss = grid.rows.iter().find(|r| r[0] == "host RSS").expect("host row");
    assert_eq!(rss[3..6], ["≈ 0", "≈ 0", "—"], "{rss:?}");
    assert_eq!((report.host.rss.consumed, report.host.rss.reclaimed), (8192, Some(-8192)));
}

// --- What still holds memory ----------------------------------------------------------

#[test]
fn a_finished_report_names_what_holds_its_memory_and_what_that_is_to_training() {
    let start = host(0.0, GIB, GIB);
    let mut report = finished("leaky", &start, &start, &start, &no_peaks());
    let roles = TensorRoles { parameters: 64 * MIB, optimizer_state: 128 * MIB, ..Default::default() };
    report.holders.push(Holders {
        device: "host".into(),
        holders: vec![Holder {
            path: "cache[0]".into(),
            bytes: 64 * MIB,
            device: "cpu".into(),
            kind: "tensor".into(),
            shape: "[16777216]".into(),
            saved_for_backward: 0,
        }],
        roles: Some(roles),
        ..Holders::default()
    });
    let lines = report.grid().lines;
    let at = lines.iter().position(|l| l == "still held on host: cache[0] (64.00 MiB)").expect("the holder line");
    assert_eq!(lines[at + 1], "  that is parameters 64.00 MiB, optimizer state 128.00 MiB");
}
