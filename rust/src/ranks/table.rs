//! The gathered table: one row per rank (host, GPU, torch's peaks, NVML's, host RSS, OOMs,
//! duration), then min, median and max, and the flags a person should look at first.

use std::time::Duration;

use serde::Serialize;

use super::{plural_ranks as plural, Header, Record};
use crate::grid::Grid;
use crate::report::{parse_oom_message, GpuReport, Report};
use crate::units::bytes;

/// A rank whose peak is more than this share over the median is flagged...
const OVER_MEDIAN: f64 = 0.10;
/// ...when it is over by at least this much too (a few KiB over an empty median is noise).
const OVER_MEDIAN_FLOOR: u64 = 1 << 20;

/// The figures of one row. Peaks are in bytes; None where the rank has no such figure.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Figures {
    pub torch_allocated_peak: Option<u64>,
    pub torch_reserved_peak: Option<u64>,
    pub nvml_process_peak: Option<u64>,
    pub host_rss_peak: Option<u64>,
    pub ooms: Option<u64>,
    pub duration_s: Option<f64>,
}

type Pick = fn(&Figures) -> Option<u64>;

/// The peaks compared against the median, by how a flag names them.
const PEAKS: [(&str, Pick); 4] = [
    ("torch allocated", |f| f.torch_allocated_peak),
    ("torch reserved", |f| f.torch_reserved_peak),
    ("NVML process", |f| f.nvml_process_peak),
    ("host RSS", |f| f.host_rss_peak),
];

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RankRow {
    pub rank: u32,
    pub reported: bool,
    pub host: Option<String>,
    /// The GPU the rank used most: `cuda:0 = NVML 3`.
    pub gpu: Option<String>,
    #[serde(flatten)]
    pub figures: Figures,
}

/// Every rank's latest report of one experiment, as `gpuexp.ranks()` returns it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Gathered {
    pub name: String,
    pub world_size: u32,
    pub run: Option<String>,
    pub store: String,
    pub timeout_s: f64,
    pub waited_s: f64,
    pub rows: Vec<RankRow>,
    pub min: Figures,
    pub median: Figures,
    pub max: Figures,
    pub flags: Vec<String>,
    /// By rank; None for a rank that is missing.
    pub reports: Vec<Option<Report>>,
    /// The exception that ended a rank's experiment, by rank.
    pub errors: Vec<Option<String>>,
}

/// The GPU a rank used most: the highest torch peak, then NVML's.
fn main_gpu(report: &Report) -> Option<&GpuReport> {
    let peak = |m: &Option<crate::report::Metric>| m.map(|m| m.peak).unwrap_or(0);
    report.gpus.iter().max_by_key(|g| (peak(&g.torch_allocated), peak(&g.process_used)))
}

fn figures(report: &Report) -> Figures {
    let gpu = main_gpu(report);
    let peak = |pick: fn(&GpuReport) -> Option<crate::report::Metric>| gpu.and_then(pick).map(|m| m.peak);
    let ooms: Vec<u64> = report.gpus.iter().filter_map(|g| g.num_ooms).collect();
    Figures {
        torch_allocated_peak: peak(|g| g.torch_allocated),
        torch_reserved_peak: peak(|g| g.torch_reserved),
        nvml_process_peak: peak(|g| g.process_used),
        host_rss_peak: Some(report.host.rss.peak),
        ooms: (!ooms.is_empty()).then(|| ooms.iter().sum()),
        duration_s: Some(report.duration_s),
    }
}

/// Min, median (the mean of the middle two for an even count) and max, over the known values.
fn spread<T: Copy + PartialOrd>(values: impl Iterator<Item = Option<T>>, middle: fn(T, T) -> T) -> [Option<T>; 3] {
    let mut known: Vec<T> = values.flatten().collect();
    if known.is_empty() {
        return [None, None, None];
    }
    known.sort_by(|a, b| a.partial_cmp(b).expect("figures are never NaN"));
    let n = known.len();
    let median = if n % 2 == 1 { known[n / 2] } else { middle(known[n / 2 - 1], known[n / 2]) };
    [Some(known[0]), Some(median), Some(known[n - 1])]
}

fn summary(rows: &[RankRow]) -> [Figures; 3] {
    let reported: Vec<&Figures> = rows.iter().filter(|r| r.reported).map(|r| &r.figures).collect();
    let int = |pick: Pick| spread(reported.iter().map(|f| pick(f)), |a, b| a / 2 + b / 2 + (a % 2 + b % 2) / 2);
    let float = |pick: fn(&Figures) -> Option<f64>| spread(reported.iter().map(|f| pick(f)), |a, b| (a + b) / 2.0);
    let columns = [
        int(|f| f.torch_allocated_peak),
        int(|f| f.torch_reserved_peak),
        int(|f| f.nvml_process_peak),
        int(|f| f.host_rss_peak),
        int(|f| f.ooms),
    ];
    let duration = float(|f| f.duration_s);
    [0, 1, 2].map(|i| Figures {
        torch_allocated_peak: columns[0][i],
        torch_reserved_peak: columns[1][i],
        nvml_process_peak: columns[2][i],
        host_rss_peak: columns[3][i],
        ooms: columns[4][i],
        duration_s: duration[i],
    })
}

fn is_cuda_oom(error: &str) -> bool {
    error.contains("OutOfMemoryError") || (error.contains("CUDA") && error.contains("out of memory"))
}

/// The line that says how a rank ran out of memory: what it asked for, where torch peaked.
fn oom_line(rank: u32, report: &Report, error: Option<&str>) -> String {
    let gpu = main_gpu(report);
    let requested = error.and_then(|e| parse_oom_message(e).0);
    let count: u64 = report.gpus.iter().filter_map(|g| g.num_ooms).sum();
    let mut line = format!("rank {rank} ran out of memory");
    if let Some(gpu) = gpu {
        line.push_str(&format!(" on cuda:{}", gpu.torch_index));
    }
    if count > 0 {
        line.push_str(&format!(" ({count} OOM{})", if count == 1 { "" } else { "s" }));
    }
    let mut facts = Vec::new();
    if let Some(requested) = requested {
        facts.push(format!("tried to allocate {}", bytes(requested)));
    }
    if let Some(gpu) = gpu {
        if let (Some(allocated), Some(reserved)) = (gpu.torch_allocated, gpu.torch_reserved) {
            facts.push(format!(
                "torch peaked at {} allocated, {} reserved, of {}",
                bytes(allocated.peak),
                bytes(reserved.peak),
                bytes(gpu.total)
            ));
        }
    }
    if !facts.is_empty() {
        line.push_str(": ");
        line.push_str(&facts.join("; "));
    }
    line
}

impl Gathered {
    pub(super) fn new(
        header: Header,
        records: Vec<Option<Record>>,
        earlier_run: Vec<bool>,
        timeout: Duration,
        waited: Duration,
        store: &str,
    ) -> Gathered {
        let rows: Vec<RankRow> = records
            .iter()
            .enumerate()
            .map(|(rank, record)| match record {
                Some(record) => RankRow {
                    rank: rank as u32,
                    reported: true,
                    host: record.report.rank.hostname.clone(),
                    gpu: main_gpu(&record.report).map(|g| format!("cuda:{} = NVML {}", g.torch_index, g.nvml_index)),
                    figures: figures(&record.report),
                },
                None => {
                    RankRow { rank: rank as u32, reported: false, host: None, gpu: None, figures: Figures::default() }
                }
            })
            .collect();
        let [min, median, max] = summary(&rows);
        let mut gathered = Gathered {
            name: header.name,
            world_size: header.world_size,
            run: header.run,
            store: store.to_string(),
            timeout_s: timeout.as_secs_f64(),
            waited_s: waited.as_secs_f64(),
            rows,
            min,
            median,
            max,
            flags: Vec::new(),
            errors: records.iter().map(|r| r.as_ref().and_then(|r| r.error.clone())).collect(),
            reports: records.into_iter().map(|r| r.map(|r| r.report)).collect(),
        };
        gathered.flags = gathered.compute_flags(&earlier_run);
        gathered
    }

    /// Ranks that never reported within the timeout.
    pub fn missing(&self) -> Vec<u32> {
        self.rows.iter().filter(|r| !r.reported).map(|r| r.rank).collect()
    }

    pub fn flags(&self) -> &[String] {
        &self.flags
    }

    fn compute_flags(&self, earlier_run: &[bool]) -> Vec<String> {
        let mut flags = Vec::new();
        let missing = self.missing();
        let (stale, silent): (Vec<u32>, Vec<u32>) = missing.iter().partition(|r| earlier_run[**r as usize]);
        if !silent.is_empty() {
            flags.push(format!(
                "{} missing: no report of {:?} within {:.1} s (died, hung, or has not finished the experiment)",
                plural(&silent),
                self.name,
                self.timeout_s
            ));
        }
        if !stale.is_empty() {
            flags.push(format!(
                "{} missing: the latest report of {:?} is from an earlier run; none from this run within {:.1} s",
                plural(&stale),
                self.name,
                self.timeout_s
            ));
        }
        for (rank, report) in self.reports.iter().enumerate() {
            let Some(report) = report else { continue };
            let rank = rank as u32;
            let error = self.errors[rank as usize].as_deref();
            let ooms = self.rows[rank as usize].figures.ooms.unwrap_or(0);
            if ooms > 0 || error.is_some_and(is_cuda_oom) {
                flags.push(oom_line(rank, report, error));
            } else if let Some(error) = error {
                flags.push(format!("rank {rank} raised {error}"));
            }
            let over: Vec<String> = PEAKS
                .iter()
                .filter_map(|(what, pick)| {
                    let (value, median) = (pick(&self.rows[rank as usize].figures)?, pick(&self.median)?);
                    let over = value.checked_sub(median)?;
                    (over >= OVER_MEDIAN_FLOOR && over as f64 > median as f64 * OVER_MEDIAN).then(|| {
                        let share = if median > 0 {
                            format!("+{:.0}%", over as f64 / median as f64 * 100.0)
                        } else {
                            "above none".into()
                        };
                        format!("{what} {} ({share}; median {})", bytes(value), bytes(median))
                    })
                })
                .collect();
            if !over.is_empty() {
                flags.push(format!("rank {rank} peaked more than 10% over the median: {}", over.join(", ")));
            }
        }
        flags
    }

    pub fn grid(&self) -> Grid {
        let dash = || "—".to_string();
        let size = |v: Option<u64>| v.map(bytes).unwrap_or_else(dash);
        let cells = |f: &Figures| {
            vec![
                size(f.torch_allocated_peak),
                size(f.torch_reserved_peak),
                size(f.nvml_process_peak),
                size(f.host_rss_peak),
                f.ooms.map(|n| n.to_string()).unwrap_or_else(dash),
                f.duration_s.map(|s| format!("{s:.1} s")).unwrap_or_else(dash),
            ]
        };
        let mut rows: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|row| {
                let mut cells_of_row = vec![
                    row.rank.to_string(),
                    if row.reported { row.host.clone().unwrap_or_else(dash) } else { "missing".into() },
                    row.gpu.clone().unwrap_or_else(dash),
                ];
                cells_of_row.extend(cells(&row.figures));
                cells_of_row
            })
            .collect();
        if self.rows.iter().any(|r| r.reported) {
            for (label, figures) in [("min", &self.min), ("median", &self.median), ("max", &self.max)] {
                let mut row = vec![label.to_string(), String::new(), String::new()];
                row.extend(cells(figures));
                rows.push(row);
            }
        }
        let reported = self.rows.iter().filter(|r| r.reported).count();
        Grid {
            title: format!("gpuexp · {} · {reported} of {} ranks reported", self.name, self.world_size),
            lines: vec![format!("from {} in {:.2} s", self.store, self.waited_s)],
            header: [
                "rank",
                "host",
                "GPU",
                "torch allocated peak",
                "torch reserved peak",
                "NVML process peak",
                "host RSS peak",
                "OOMs",
                "duration",
            ]
            .map(String::from)
            .to_vec(),
            rows,
            notes: self.flags.iter().map(|f| format!("flag: {f}")).collect(),
            compact: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::rank_report;
    use super::*;
    use crate::snapshot::testing::{gpu, host, torch, GIB};
    use crate::snapshot::{GpuReading, TorchStats};

    const MIB: u64 = 1 << 20;

    /// A rank's report of a GPU experiment whose torch allocated peak is `peak`.
    fn gpu_report(rank: u32, world_size: u32, peak: u64, ooms: u64) -> Report {
        // Torch's count is the process's: the scope's OOMs are those since its start.
        let reading = |allocated: u64, ooms: u64| GpuReading {
            torch: Some(TorchStats { num_ooms: ooms, ..torch(allocated, allocated, allocated, allocated) }),
            process_used: Some(allocated + 500 * MIB),
            ..gpu(0, "GPU-aaaa")
        };
        let start = host(0.0, GIB, GIB).with_gpu(reading(0, 0));
        let end = host(3.0, GIB, GIB).with_gpu(reading(0, ooms));
        let peaks = move |g: &crate::snapshot::Gauge| match g {
            crate::snapshot::Gauge::TorchAllocated(_) | crate::snapshot::Gauge::TorchReserved(_) => Some(peak),
            _ => None,
        };
        let span = crate::report::Span { start: &start, before_teardown: &end, end: Some(&end) };
        let mut report = Report::build("train", true, span, peaks, crate::report::Details::default());
        report.rank = rank_report("train", rank, world_size, 0).rank;
        report
    }

    fn gathered(reports: Vec<Option<Report>>, errors: Vec<Option<&str>>) -> Gathered {
        let header = Header { name: "train".into(), run: None, world_size: reports.len() as u32, rank: 0 };
        let n = reports.len();
        let records = reports
            .into_iter()
            .zip(errors)
            .map(|(r, e)| r.map(|report| Record { run: None, error: e.map(String::from), report }))
            .collect();
        Gathered::new(header, records, vec![false; n], Duration::from_secs(10), Duration::from_millis(30), "memory")
    }

    #[test]
    fn medians_of_even_and_odd_counts() {
        let odd = spread([Some(3u64), None, Some(1), Some(2)].into_iter(), |a, b| a / 2 + b / 2);
        assert_eq!(odd, [Some(1), Some(2), Some(3)]);
        let even = spread([Some(1.0), Some(4.0)].into_iter(), |a, b| (a + b) / 2.0);
        assert_eq!(even, [Some(1.0), Some(2.5), Some(4.0)]);
        assert_eq!(spread::<u64>([None].into_iter(), |a, _| a), [None, None, None]);
    }

    #[test]
    fn rows_carry_each_ranks_exact_figures_then_min_median_max() {
        let g =
            gathered((0..3).map(|r| Some(gpu_report(r, 3, (r as u64 + 1) * GIB, 0))).collect(), vec![None, None, None]);
        let peaks: Vec<Option<u64>> = g.rows.iter().map(|r| r.figures.torch_allocated_peak).collect();
        assert_eq!(peaks, vec![Some(GIB), Some(2 * GIB), Some(3 * GIB)]);
        assert_eq!(g.rows[1].gpu.as_deref(), Some("cuda:0 = NVML 0"));
        assert_eq!(g.rows[1].host.as_deref(), Some("node-a"));
        assert_eq!((g.min.torch_allocated_peak, g.median.torch_allocated_peak), (Some(GIB), Some(2 * GIB)));
        // NVML saw the context alone (500 MiB) at start and end; no sampler ran.
        assert_eq!(g.max.nvml_process_peak, Some(500 * MIB));
        let text = g.grid().to_text();
        assert!(text.contains("gpuexp · train · 3 of 3 ranks reported"), "{text}");
        assert!(text.contains("│ median ") && text.contains("3.00 GiB"), "{text}");
        // Rank 2 is 50% over the median of 2 GiB; rank 1 is the median.
        assert_eq!(g.flags.len(), 1, "{:?}", g.flags);
        assert!(g.flags[0].starts_with("rank 2 peaked more than 10% over the median: torch allocated 3.00 GiB (+50%"));
    }

    #[test]
    fn an_oom_is_flagged_with_its_diagnosis_and_a_raise_with_its_error() {
        let error =
            "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 80 GiB";
        let g = gathered(
            vec![Some(gpu_report(0, 3, GIB, 0)), Some(gpu_report(1, 3, GIB, 1)), Some(gpu_report(2, 3, GIB, 0))],
            vec![None, Some(error), Some("RuntimeError: boom")],
        );
        assert!(g.flags.contains(&"rank 1 ran out of memory on cuda:0 (1 OOM): tried to allocate 2.00 GiB; torch peaked at 1.00 GiB allocated, 1.00 GiB reserved, of 80.00 GiB".to_string()), "{:?}", g.flags);
        assert!(g.flags.contains(&"rank 2 raised RuntimeError: boom".to_string()), "{:?}", g.flags);
        assert_eq!(g.to_owned().errors[2].as_deref(), Some("RuntimeError: boom"));
    }

    #[test]
    fn missing_ranks_get_a_row_and_one_flag_with_ranges() {
        let mut reports: Vec<Option<Report>> = (0..8).map(|r| Some(rank_report("train", r, 8, GIB))).collect();
        for r in [2, 3, 4, 7] {
            reports[r] = None;
        }
        let g = gathered(reports, vec![None; 8]);
        assert_eq!(g.missing(), vec![2, 3, 4, 7]);
        assert_eq!(g.flags, vec!["ranks 2–4, 7 missing: no report of \"train\" within 10.0 s (died, hung, or has not finished the experiment)"]);
        let text = g.grid().to_text();
        assert!(text.lines().any(|l| l.starts_with("│ 3 ") && l.contains("┆ missing ┆")), "{text}");
        assert!(text.contains("4 of 8 ranks reported") && text.contains("flag: ranks 2–4, 7 missing"), "{text}");
        let json = serde_json::to_value(&g).unwrap();
        assert!(json["reports"][2].is_null() && json["reports"][0]["rank"] == 0);
        assert_eq!(json["rows"][0]["host_rss_peak"], GIB);
    }

    #[test]
    fn small_differences_above_an_empty_median_are_not_flagged() {
        let mut reports: Vec<Option<Report>> = (0..3).map(|r| Some(rank_report("t", r, 3, 100 * MIB))).collect();
        reports[2] = Some(rank_report("t", 2, 3, 100 * MIB + 512 * 1024)); // 0.5% and under 1 MiB
        assert!(gathered(reports, vec![None; 3]).flags.is_empty());
    }
}
