//! The per-cell log's record: what one notebook cell did to memory, and the compact table shown
//! under it.

use serde::{Deserialize, Serialize};

use crate::grid::{prefixed, Grid};
use crate::snapshot::{Gauge, GpuReading, Snapshot};
use crate::trace::CellPeakSite;
use crate::units::{bytes, signed_bytes};

/// One figure over one cell: how it moved, and how high it went above where the cell began.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CellMetric {
    pub start: u64,
    pub end: u64,
    pub peak: u64,
    pub consumed: i64,
    pub peak_above_start: u64,
}

impl CellMetric {
    fn new(start: u64, end: u64, peak: u64) -> CellMetric {
        let peak = peak.max(start).max(end);
        CellMetric { start, end, peak, consumed: end as i64 - start as i64, peak_above_start: peak - start }
    }

    /// Whether the figure moved by at least `min_change` bytes: its Δ either way, or how far it
    /// rose above where the cell began.
    fn moved_by(&self, min_change: u64) -> bool {
        self.consumed.unsigned_abs() >= min_change || self.peak_above_start >= min_change
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CellGpu {
    pub torch_index: u32,
    pub uuid: String,
    pub torch_allocated: Option<CellMetric>,
    pub torch_reserved: Option<CellMetric>,
    pub process_used: Option<CellMetric>,
}

impl CellGpu {
    /// Whether the cell did anything on this GPU (only those are shown, unless all are asked for).
    pub fn touched(&self) -> bool {
        self.figures().any(|m| m.moved_by(1))
    }

    fn figures(&self) -> impl Iterator<Item = &CellMetric> {
        [&self.torch_allocated, &self.torch_reserved, &self.process_used].into_iter().flatten()
    }
}

/// What one notebook cell did to memory.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CellRecord {
    pub execution_count: u64,
    /// Seconds since the Unix epoch; formatted only when written out, not for every cell.
    #[serde(
        serialize_with = "crate::units::serialize_rfc3339",
        deserialize_with = "crate::units::deserialize_rfc3339"
    )]
    pub started_at: f64,
    pub wall_s: f64,
    pub host: CellMetric,
    pub gpus: Vec<CellGpu>,
    pub notes: Vec<String>,
    /// With the trace on: for each GPU whose torch peak moved, the line most of it came from.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub peak_sites: Vec<CellPeakSite>,
}

impl CellRecord {
    pub fn build(
        execution_count: u64,
        start: &Snapshot,
        end: &Snapshot,
        peak: impl Fn(&Gauge) -> Option<u64>,
        mut notes: Vec<String>,
    ) -> CellRecord {
        let metric = |gauge: Gauge, value: &dyn Fn(&Snapshot) -> Option<u64>| -> Option<CellMetric> {
            let (s, e) = (value(start)?, value(end)?);
            Some(CellMetric::new(s, e, peak(&gauge).unwrap_or(0)))
        };
        let gpus = end
            .gpus
            .iter()
            .filter(|g| start.gpu(&g.uuid).is_some())
            .map(|gpu| {
                let uuid = gpu.uuid.clone();
                let field = |pick: fn(&GpuReading) -> Option<u64>| {
                    let uuid = uuid.clone();
                    move |s: &Snapshot| s.gpu(&uuid).and_then(pick)
                };
                let torch_reset_outside = start
                    .gpu(&uuid)
                    .and_then(|g| g.torch)
                    .zip(gpu.torch)
                    .is_some_and(|(before, after)| after.peak_allocated < before.allocated);
                if torch_reset_outside {
                    notes.push(format!(
                        "cuda:{}: torch's peak counters were reset behind gpuexp's back during this cell; its torch peaks are lower bounds",
                        gpu.torch_index
                    ));
                }
                CellGpu {
                    torch_index: gpu.torch_index,
                    uuid: uuid.clone(),
                    torch_allocated: metric(Gauge::TorchAllocated(uuid.clone()), &field(|g| g.torch.map(|t| t.allocated))),
                    torch_reserved: metric(Gauge::TorchReserved(uuid.clone()), &field(|g| g.torch.map(|t| t.reserved))),
                    process_used: metric(Gauge::ProcessUsed(uuid.clone()), &field(|g| g.process_used)),
                }
            })
            .collect();
        CellRecord {
            execution_count,
            started_at: start.taken_at,
            wall_s: end.taken_at - start.taken_at,
            host: metric(Gauge::HostRss, &|s| Some(s.host.rss)).expect("host RSS is always read"),
            gpus,
            notes,
            peak_sites: Vec::new(),
        }
    }

    /// The GPUs whose torch peak rose by at least `min_change` above where the cell began, with
    /// that rise: the cells whose block the trace explains.
    pub fn torch_peaks_moved(&self, min_change: u64) -> Vec<(u32, u64)> {
        self.gpus
            .iter()
            .filter_map(|gpu| {
                let rise = gpu.torch_allocated?.peak_above_start;
                (rise >= min_change.max(1)).then_some((gpu.torch_index, rise))
            })
            .collect()
    }

    /// Whether the block is worth showing under its cell: some figure moved by at least
    /// `min_change` bytes (its Δ, or its peak above start), or the record has a note to tell.
    /// A cell that only read or printed something stays quiet.
    pub fn moved_by(&self, min_change: u64) -> bool {
        !self.notes.is_empty()
            || self.host.moved_by(min_change)
            || self.gpus.iter().flat_map(CellGpu::figures).any(|m| m.moved_by(min_change))
    }

    /// The compact block shown under a cell; GPUs the cell never touched are left out unless `all_gpus`.
    pub fn grid(&self, all_gpus: bool) -> Grid {
        let row = |label: String, m: &CellMetric| {
            vec![label, signed_bytes(m.consumed), format!("+{}", bytes(m.peak_above_start)), bytes(m.end)]
        };
        let mut rows = vec![row("host RSS".into(), &self.host)];
        for gpu in self.gpus.iter().filter(|g| all_gpus || g.touched()) {
            let figures = [
                ("torch allocated", &gpu.torch_allocated),
                ("torch reserved", &gpu.torch_reserved),
                ("NVML process", &gpu.process_used),
            ];
            for (what, metric) in figures {
                if let Some(m) = metric {
                    rows.push(row(format!("cuda:{} {what}", gpu.torch_index), m));
                }
            }
        }
        Grid {
            title: format!("gpuexp · cell [{}] · {:.3} s", self.execution_count, self.wall_s),
            lines: Vec::new(),
            header: ["memory", "Δ", "peak above start", "now"].map(String::from).to_vec(),
            rows,
            notes: self.peak_sites.iter().map(CellPeakSite::line).chain(prefixed("note", &self.notes)).collect(),
            compact: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::testing::{gpu, host, torch, GIB};

    fn with_torch(reading: GpuReading, allocated: u64, peak_allocated: u64) -> GpuReading {
        GpuReading { torch: Some(torch(allocated, allocated, peak_allocated, allocated)), ..reading }
    }

    /// A cell that allocated 2 GiB on cuda:0 (peaking at 3 GiB) and left cuda:1 alone.
    fn record() -> CellRecord {
        let start = host(10.0, GIB, GIB).with_gpu(with_torch(gpu(0, "GPU-aaaa"), GIB, GIB)).with_gpu(with_torch(
            gpu(1, "GPU-bbbb"),
            0,
            0,
        ));
        let end = host(11.5, GIB, GIB).with_gpu(with_torch(gpu(0, "GPU-aaaa"), 3 * GIB, 3 * GIB)).with_gpu(with_torch(
            gpu(1, "GPU-bbbb"),
            0,
            0,
        ));
        let peak = |g: &Gauge| matches!(g, Gauge::TorchAllocated(uuid) if uuid == "GPU-aaaa").then_some(4 * GIB);
        CellRecord::build(7, &start, &end, peak, Vec::new())
    }

    #[test]
    fn a_cell_metric_measures_from_where_the_cell_began() {
        let allocated = record().gpus[0].torch_allocated.unwrap();
        assert_eq!(
            (allocated.consumed, allocated.peak, allocated.peak_above_start),
            ((2 * GIB) as i64, 4 * GIB, 3 * GIB)
        );
        assert_eq!(CellMetric::new(5, 3, 0).peak, 5, "the peak is at least the start and the end");
    }

    #[test]
    fn only_gpus_the_cell_touched_are_shown_unless_all_are_asked_for() {
        let record = record();
        assert_eq!(record.gpus.iter().map(CellGpu::touched).collect::<Vec<_>>(), [true, false]);
        let shown = |all: bool| record.grid(all).rows.iter().map(|r| r[0].clone()).collect::<Vec<_>>();
        assert!(shown(false).iter().all(|label| !label.starts_with("cuda:1")), "{:?}", shown(false));
        assert!(shown(true).contains(&"cuda:1 torch allocated".to_string()), "{:?}", shown(true));
        let grid = record.grid(false);
        assert_eq!(grid.title, "gpuexp · cell [7] · 1.500 s");
        assert!(grid.compact);
        assert_eq!(grid.rows[1], ["cuda:0 torch allocated", "+2.00 GiB", "+3.00 GiB", "3.00 GiB"]);
    }

    #[test]
    fn a_block_shows_only_when_a_figure_moved_by_the_threshold() {
        const MIB: u64 = 1 << 20;
        let at = |t: f64, rss: u64, peak: u64| host(t, rss, peak);
        let quiet = CellRecord::build(1, &at(0.0, GIB, GIB), &at(0.1, GIB + 16 * 1024, GIB), |_| None, Vec::new());
        assert!(!quiet.moved_by(MIB), "+16 KiB is below 1 MiB");
        assert!(quiet.moved_by(16 * 1024) && quiet.moved_by(0));
        let freed = CellRecord::build(2, &at(0.0, GIB, GIB), &at(0.1, GIB - 2 * MIB, GIB), |_| None, Vec::new());
        assert!(freed.moved_by(MIB), "a fall counts as much as a rise");
        let spike = CellRecord::build(3, &at(0.0, GIB, GIB), &at(0.1, GIB, GIB), |_| Some(GIB + 3 * MIB), Vec::new());
        assert!(spike.moved_by(MIB) && !spike.moved_by(4 * MIB), "a peak above start counts though Δ is 0");
        assert!(record().moved_by(GIB), "a GPU figure counts: cuda:0 allocated +2 GiB");
        assert!(!record().moved_by(4 * GIB));
        let noted = CellRecord::build(4, &at(0.0, GIB, GIB), &at(0.1, GIB, GIB), |_| None, vec!["a note".into()]);
        assert!(noted.moved_by(MIB), "a note is always told");
    }

    #[test]
    fn a_traced_cell_s_block_names_the_top_site_of_each_gpu_whose_torch_peak_moved() {
        let mut record = record();
        assert_eq!(record.torch_peaks_moved(GIB), [(0, 3 * GIB)], "cuda:1 did not move");
        assert!(record.torch_peaks_moved(4 * GIB).is_empty(), "below the threshold");
        let quiet = record.grid(false).notes;
        assert!(quiet.is_empty(), "the trace off changes nothing: {quiet:?}");
        record.peak_sites.push(CellPeakSite {
            torch_index: 0,
            peak_above_start: 3 * GIB,
            label: "In [7], line 2".into(),
            source: None,
            bytes: 2 * GIB,
            share: 2.0 / 3.0,
        });
        record.notes.push("a note".into());
        assert_eq!(record.grid(false).notes, ["cuda:0 peak +3.00 GiB, 67% at In [7], line 2", "note: a note"]);
        let json = serde_json::to_value(&record).unwrap();
        assert_eq!(json["peak_sites"][0]["label"], "In [7], line 2");
        let back: CellRecord = serde_json::from_value(json).unwrap();
        assert_eq!(back.peak_sites, record.peak_sites);
    }

    #[test]
    fn peak_counters_reset_outside_gpuexp_are_noted() {
        let start = host(0.0, 0, 0).with_gpu(with_torch(gpu(0, "GPU-aaaa"), 2 * GIB, 2 * GIB));
        let end = host(1.0, 0, 0).with_gpu(with_torch(gpu(0, "GPU-aaaa"), 2 * GIB, GIB));
        let record = CellRecord::build(1, &start, &end, |_| None, vec!["earlier".into()]);
        assert_eq!(record.notes.len(), 2, "{:?}", record.notes);
        assert!(record.notes[1].starts_with("cuda:0: torch's peak counters were reset"), "{:?}", record.notes);
    }
}
