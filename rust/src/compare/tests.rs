use super::*;
use crate::grid::testing::{expected_cells, html_cells, text_cells};
use crate::report::{Details, Param, Span};
use crate::snapshot::testing::{gpu, host, torch, GIB};
use crate::snapshot::{GpuReading, Snapshot};

const MIB: u64 = 1 << 20;

/// A finished GPU experiment whose cuda:0 peaked at `peak` bytes (torch and NVML alike), of
/// which it kept a quarter until teardown, and gave everything back.
fn gpu_report(name: &str, peak: u64, limit: Option<u64>, details: Details) -> Report {
    let reading = |held: u64| GpuReading {
        torch: Some(torch(held, held, held, held)),
        process_used: Some(500 * MIB + held),
        ..gpu(0, "GPU-aaaa")
    };
    let start = host(0.0, GIB, GIB).with_gpu(reading(0));
    let before = host(2.5, 2 * GIB, 2 * GIB).with_gpu(reading(peak / 4));
    let end = host(3.0, GIB, GIB).with_gpu(reading(0));
    let gauge_peak = |g: &crate::snapshot::Gauge| match g {
        crate::snapshot::Gauge::HostRss => None,
        crate::snapshot::Gauge::ProcessUsed(_) => Some(500 * MIB + peak),
        _ => Some(peak),
    };
    let span = Span { start: &start, before_teardown: &before, end: Some(&end) };
    Report::build(name, true, span, gauge_peak, Details { limit, ..details })
}

fn cpu_report(name: &str, rss_peak: u64) -> Report {
    let start: Snapshot = host(0.0, GIB, GIB);
    let before = host(1.0, GIB + 100 * MIB, rss_peak);
    let end = host(1.2, GIB + 20 * MIB, GIB);
    let span = Span { start: &start, before_teardown: &before, end: Some(&end) };
    let peak = |g: &crate::snapshot::Gauge| matches!(g, crate::snapshot::Gauge::HostRss).then_some(rss_peak);
    Report::build(name, false, span, peak, Details::default())
}

/// bs=16, 32 and 64 on cuda:0: peaks of 1 GiB + bs/16 GiB.
fn batch_sizes() -> Comparison {
    let reports: Vec<Report> = [16u64, 32, 64]
        .iter()
        .map(|bs| gpu_report(&format!("bs={bs}"), GIB + bs * GIB / 16, None, Details::default()))
        .collect();
    Comparison::of(&reports)
}

#[test]
fn each_row_has_its_params_and_the_reports_figures_in_the_reports_json_shape() {
    let json = serde_json::to_value(batch_sizes()).unwrap();
    let row = &json["rows"][1];
    assert_eq!(row["name"], "bs=32");
    assert_eq!(row["params"], serde_json::json!({"bs": 32}));
    assert_eq!(row["host"]["rss"]["peak"], 2 * GIB);
    assert_eq!(row["gpus"][0]["torch_allocated"]["peak"], 3 * GIB);
    assert_eq!(row["gpus"][0]["torch_allocated"]["reclaimed"], (3 * GIB / 4) as i64);
    assert_eq!(row["gpus"][0]["total"], 80 * GIB);
}

#[test]
fn the_table_shows_a_column_per_param_and_per_layers_peak() {
    let explicit = Details {
        params: Some(crate::report::Params(vec![
            ("bs".into(), Param::Int(8)),
            ("opt".into(), Param::Text("sgd".into())),
        ])),
        ..Details::default()
    };
    let mut comparison = batch_sizes();
    comparison.rows.push(Row::from(&gpu_report("tiny", GIB, None, explicit)));
    comparison.rows.push(Row::from(&cpu_report("numpy", 3 * GIB)));
    let grid = comparison.grid();
    assert_eq!(
        grid.header,
        [
            "experiment",
            "bs",
            "opt",
            "duration",
            "host RSS peak",
            "cuda:0 allocated peak",
            "cuda:0 reserved peak",
            "cuda:0 NVML peak",
            "consumed",
            "share reclaimed",
            "OOMs"
        ]
    );
    assert_eq!(
        grid.rows[0],
        ["bs=16", "16", "—", "3.0 s", "2.00 GiB", "2.00 GiB", "2.00 GiB", "2.49 GiB", "+512.00 MiB", "100.0%", "0"]
    );
    assert_eq!(&grid.rows[3][..3], ["tiny", "8", "sgd"], "params= wins over the name");
    // A CPU experiment's consumed and reclaimed are host RSS's: +100 MiB, 80 MiB of it back.
    assert_eq!(grid.rows[4][4..], ["3.00 GiB", "—", "—", "—", "+100.00 MiB", "80.0%", "—"]);
    assert_eq!(text_cells(&grid.to_text()), expected_cells(&grid));
    assert_eq!(html_cells(&grid.to_html()), expected_cells(&grid));
    assert!(grid.notes[0].contains("torch allocated where torch ran"), "{:?}", grid.notes);
    assert_eq!(batch_sizes().grid().notes, ["note: consumed and reclaimed: torch allocated"]);
    assert_eq!(Comparison::default().grid().notes, ["note: no finished experiments in this kernel yet"]);
}

#[test]
fn columns_for_a_data_frame_keep_numbers_as_numbers() {
    let columns = batch_sizes().columns();
    let at = |name: &str| columns.columns.iter().position(|c| c == name).unwrap_or_else(|| panic!("{name}"));
    let last = &columns.rows[2];
    assert_eq!(last[at("name")], "bs=64");
    assert_eq!(last[at("bs")], 64);
    assert_eq!(last[at("cuda:0.torch_reserved.peak")], 5 * GIB);
    assert_eq!(last[at("host.rss.consumed")], GIB as i64);
    assert_eq!(last[at("cuda:0.num_ooms")], 0);
    assert_eq!(last[at("limit")], serde_json::Value::Null);
    assert!(columns.rows.iter().all(|r| r.len() == columns.columns.len()));
}

#[test]
fn the_plot_picks_the_param_that_varies_draws_the_total_and_fits_the_largest_that_fits() {
    let plot = batch_sizes().plot(None).expect("bs varies");
    assert_eq!(plot.x, "bs");
    let nvml = plot.series.iter().find(|s| s.label == "cuda:0 NVML process").expect("an NVML series");
    assert_eq!(nvml.x, [16.0, 32.0, 64.0]);
    assert_eq!(plot.levels, [Level { label: "device total (80.00 GiB)".into(), y: 80 * GIB }]);
    let fit = plot.fit.expect("a fit");
    assert_eq!(fit.layer, "cuda:0 NVML process");
    // 500 MiB + 1 GiB + bs/16 GiB stays under 80 GiB up to bs = 1256.
    assert_eq!(fit.largest, Some(1256.0));
    assert_eq!(fit.x, [16.0, 256.0], "drawn to four times the largest measured");
    assert!(plot.notes.iter().any(|n| n.contains("1256")), "{:?}", plot.notes);
    assert!(fit.label.contains("fits up to bs = 1256 (80.00 GiB total)"), "{}", fit.label);
}

#[test]
fn with_a_limit_torch_reserved_is_fitted_against_it() {
    let reports: Vec<Report> = [8u64, 16]
        .iter()
        .map(|bs| gpu_report(&format!("bs={bs}"), bs * GIB, Some(24 * GIB), Details::default()))
        .collect();
    let plot = Comparison::of(&reports).plot(Some("bs")).unwrap();
    assert!(plot.levels.iter().any(|l| l.label == "limit (24.00 GiB)" && l.y == 24 * GIB), "{:?}", plot.levels);
    let fit = plot.fit.unwrap();
    assert_eq!((fit.layer.as_str(), fit.largest), ("cuda:0 torch reserved", Some(24.0)));
}

#[test]
fn the_param_must_be_named_when_none_or_several_vary() {
    let same: Vec<Report> = (0..2).map(|_| cpu_report("bs=8", GIB)).collect();
    assert!(Comparison::of(&same).plot(None).unwrap_err().contains("no numeric param varies"));
    let two: Vec<Report> = ["bs=8,lr=0.1", "bs=16,lr=0.2"].iter().map(|n| cpu_report(n, GIB)).collect();
    let error = Comparison::of(&two).plot(None).unwrap_err();
    assert!(error.contains("several params vary (bs, lr)") && error.contains("plot(x=\"bs\")"), "{error}");
    assert!(Comparison::of(&two).plot(Some("opt")).unwrap_err().contains("no experiment has a number for \"opt\""));
    let plot = Comparison::of(&two).plot(Some("lr")).unwrap();
    assert_eq!(plot.series[0].x, [0.1, 0.2]);
    assert!(plot.levels[0].label.starts_with("host memory"), "{:?}", plot.levels);
}

#[test]
fn experiments_without_the_param_are_left_out_and_say_so() {
    let reports = vec![cpu_report("bs=8", 2 * GIB), cpu_report("baseline", GIB), cpu_report("bs=16", 3 * GIB)];
    let plot = Comparison::of(&reports).plot(None).unwrap();
    assert_eq!(plot.series[0].y, [2 * GIB, 3 * GIB]);
    assert_eq!(plot.notes[0], "baseline is left out: it has no number for bs");
    let fit = plot.fit.unwrap();
    assert_eq!((fit.layer.as_str(), fit.slope), ("host RSS", (GIB / 8) as f64));
}

#[test]
fn sites_need_two_traced_experiments_and_say_how_to_trace_them() {
    let reports = vec![std::sync::Arc::new(cpu_report("a", 2 * GIB)), std::sync::Arc::new(cpu_report("b", 3 * GIB))];
    let refused = traced_ends(&reports).unwrap_err();
    assert_eq!(
        refused,
        "sites() compares two traced experiments and 0 of these 2 were traced: open them with \
         GPUExperiment(..., trace=True)"
    );
}
