//! Reports: what a scope consumed, reclaimed and peaked at, as JSON, a text table
//! (comfy-table) and an HTML table built from the same cells.

use comfy_table::{presets, CellAlignment, ContentArrangement, Table};
use serde::{Deserialize, Serialize};

use crate::snapshot::{Gauge, GpuReading, Snapshot};

/// One gauge over a scope. consumed = before_teardown − start; reclaimed = before_teardown − end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Metric {
    pub start: u64,
    pub before_teardown: u64,
    /// None while the scope is open.
    pub end: Option<u64>,
    pub peak: u64,
    pub consumed: i64,
    pub reclaimed: Option<i64>,
}

impl Metric {
    fn new(start: u64, before_teardown: u64, end: Option<u64>, peak: u64) -> Metric {
        let peak = peak.max(start).max(before_teardown);
        Metric {
            start,
            before_teardown,
            end,
            peak,
            consumed: before_teardown as i64 - start as i64,
            reclaimed: end.map(|end| before_teardown as i64 - end as i64),
        }
    }

    /// Reclaimed as a share of consumed, when something was consumed.
    pub fn reclaimed_share(&self) -> Option<f64> {
        match (self.reclaimed, self.consumed) {
            (Some(reclaimed), consumed) if consumed > 0 => Some(reclaimed as f64 / consumed as f64),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostReport {
    pub rss: Metric,
    pub available: u64,
    pub total: u64,
    pub cgroup_limit: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuReport {
    pub torch_index: u32,
    pub nvml_index: u32,
    pub uuid: String,
    pub name: String,
    pub total: u64,
    pub torch_allocated: Option<Metric>,
    pub torch_reserved: Option<Metric>,
    pub process_used: Option<Metric>,
    /// None when NVML could not read the device during the scope.
    pub device_used: Option<Metric>,
    pub num_ooms: Option<u64>,
    /// What this process's descendants (ranks, DataLoader workers) held on the GPU, as NVML lists them.
    #[serde(default)]
    pub children_used: Option<Metric>,
}

/// What teardown did to names and hidden references.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Names {
    /// Names the scope created, deleted.
    pub deleted: Vec<String>,
    /// Names that existed before the scope and were bound to new objects in it, deleted.
    pub rebound: Vec<String>,
    /// Names the scope created or rebound that were left alone (keep(), modules).
    pub kept: Vec<String>,
    /// Hidden references dropped: Out entries, `_`, the stored last exception.
    pub cleared: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub name: String,
    /// "gpu" or "cpu" (a Cow so that reports published by other ranks read back).
    pub kind: std::borrow::Cow<'static, str>,
    pub finished: bool,
    pub started_at: String,
    pub finished_at: Option<String>,
    pub duration_s: f64,
    #[serde(flatten)]
    pub names: Names,
    pub host: HostReport,
    pub gpus: Vec<GpuReport>,
    pub notes: Vec<String>,
    /// The cell log of the cells that ran while the scope was open (not published to other ranks).
    #[serde(skip_deserializing)]
    pub cells: Vec<CellRecord>,
    /// Where memory the scope created did not come back: what still holds it.
    pub still_held: Vec<Holders>,
    /// Bytes torch could allocate on each GPU while the scope was open (`limit=`).
    pub limit: Option<u64>,
    /// The samples of its timeline (`timeline=True`; not published to other ranks).
    #[serde(skip_deserializing)]
    pub timeline: Vec<crate::monitor::Sample>,
    /// rank, local_rank, world_size and hostname, as top-level keys, in a rank of a distributed run.
    #[serde(flatten)]
    pub rank: crate::ranks::RankIdentity,
    /// Descendant processes still holding GPU memory when the scope finished: never ended by gpuexp.
    #[serde(default)]
    pub child_processes: Vec<crate::snapshot::children::ChildProcess>,
}

/// The snapshots a report is built from; `end` is None while the scope is open.
pub struct Span<'a> {
    pub start: &'a Snapshot,
    pub before_teardown: &'a Snapshot,
    pub end: Option<&'a Snapshot>,
}

impl Report {
    pub fn build(name: &str, gpu: bool, span: Span, peak: impl Fn(&Gauge) -> Option<u64>, names: Names) -> Report {
        let Span { start, before_teardown: before, end } = span;
        // `read` says whether a snapshot has the figure's source at all (a GPU NVML failed to
        // read is absent): no source means unknown, never zero. A source that reports None
        // (torch not imported yet) means nothing was allocated, which is zero.
        let metric = |gauge: Gauge, read: &dyn Fn(&Snapshot) -> bool, value: &dyn Fn(&Snapshot) -> Option<u64>| {
            if !read(start) || !read(before) {
                return None;
            }
            let (s, b) = (value(start), value(before));
            if s.is_none() && b.is_none() {
                return None;
            }
            let e = end.filter(|e| read(e)).map(|e| value(e).unwrap_or(0));
            Some(Metric::new(s.unwrap_or(0), b.unwrap_or(0), e, peak(&gauge).unwrap_or(0).max(e.unwrap_or(0))))
        };
        let host = HostReport {
            rss: metric(Gauge::HostRss, &|_| true, &|s| Some(s.host.rss)).expect("host RSS is always read"),
            available: end.unwrap_or(before).host.available,
            total: before.host.total,
            cgroup_limit: before.host.cgroup_limit,
        };
        let gpus = start
            .gpus
            .iter()
            .map(|first| {
                let uuid = first.uuid.clone();
                let read = |s: &Snapshot| s.gpu(&uuid).is_some();
                let field = |pick: fn(&GpuReading) -> Option<u64>| {
                    let uuid = uuid.clone();
                    move |s: &Snapshot| s.gpu(&uuid).and_then(pick)
                };
                let gpu_metric =
                    |gauge: Gauge, pick: fn(&GpuReading) -> Option<u64>| metric(gauge, &read, &field(pick));
                let torch_allocated = gpu_metric(Gauge::TorchAllocated(uuid.clone()), |g| g.torch.map(|t| t.allocated));
                let torch_reserved = gpu_metric(Gauge::TorchReserved(uuid.clone()), |g| g.torch.map(|t| t.reserved));
                // A figure that was unavailable at any point makes the whole row unavailable.
                let process_known = [Some(start), Some(before), end]
                    .into_iter()
                    .flatten()
                    .all(|s| s.gpu(&uuid).is_some_and(|g| g.process_used.is_some()));
                let process_used =
                    process_known.then(|| gpu_metric(Gauge::ProcessUsed(uuid.clone()), |g| g.process_used)).flatten();
                let device_used = gpu_metric(Gauge::DeviceUsed(uuid.clone()), |g| Some(g.device_used));
                let children_used = gpu_metric(Gauge::ChildrenUsed(uuid.clone()), |g| Some(g.children_used));
                GpuReport {
                    torch_index: first.torch_index,
                    nvml_index: first.nvml_index,
                    uuid: uuid.clone(),
                    name: first.name.clone(),
                    total: first.total,
                    torch_allocated,
                    torch_reserved,
                    process_used,
                    device_used,
                    num_ooms: end.unwrap_or(before).gpu(&uuid).and_then(|g| g.torch).map(|t| t.num_ooms),
                    children_used,
                }
            })
            .collect();
        let mut notes: Vec<String> = Vec::new();
        for note in start.notes.iter().chain(&before.notes).chain(end.into_iter().flat_map(|e| &e.notes)) {
            if !notes.contains(note) {
                notes.push(note.clone());
            }
        }
        let finished_at = end.map(|e| e.taken_at);
        Report {
            name: name.to_string(),
            kind: if gpu { "gpu" } else { "cpu" }.into(),
            finished: end.is_some(),
            started_at: rfc3339(start.taken_at),
            finished_at: finished_at.map(rfc3339),
            duration_s: finished_at.unwrap_or(before.taken_at) - start.taken_at,
            names,
            host,
            gpus,
            notes,
            cells: Vec::new(),
            still_held: Vec::new(),
            limit: None,
            timeline: Vec::new(),
            rank: Default::default(),
            child_processes: Vec::new(),
        }
    }

    pub fn grid(&self) -> Grid {
        let state = if self.finished { "finished" } else { "running" };
        let mut lines = Vec::new();
        let list = |label: &str, names: &[String], lines: &mut Vec<String>| {
            if !names.is_empty() {
                lines.push(format!("{label}: {}", names.join(", ")));
            }
        };
        if self.finished {
            list("deleted", &self.names.deleted, &mut lines);
            list("rebound (deleted)", &self.names.rebound, &mut lines);
            list("kept", &self.names.kept, &mut lines);
            list("cleared", &self.names.cleared, &mut lines);
            if self.names.deleted.is_empty() && self.names.rebound.is_empty() {
                lines.push("deleted: nothing".into());
            }
        }
        lines.extend(self.gpus.iter().map(|g| device_line(g.torch_index, g.nvml_index, &g.name, &g.uuid, g.total)));
        if let Some(limit) = self.limit {
            lines.push(format!("limit: torch could allocate {} per GPU (a smaller card, rehearsed)", bytes(limit)));
        }
        for held in &self.still_held {
            let named: Vec<String> =
                held.holders.iter().take(5).map(|h| format!("{} ({})", h.path, bytes(h.bytes))).collect();
            let mut line = format!("still held on {}: {}", held.device, named.join(", "));
            if held.unreachable > 0 {
                line.push_str(&format!("; {} with no reachable referrer", bytes(held.unreachable)));
            }
            lines.push(line);
        }
        lines.extend(self.rank.line());
        lines.extend(crate::snapshot::children::still_holding_lines(&self.child_processes));
        let finished = self.finished;
        let mut rows = vec![metric_row("host RSS".into(), &self.host.rss, finished)];
        for gpu in &self.gpus {
            let label = |what: &str| format!("cuda:{} {what}", gpu.torch_index);
            let rows_of = [
                ("torch allocated", &gpu.torch_allocated),
                ("torch reserved", &gpu.torch_reserved),
                ("NVML process", &gpu.process_used),
                ("NVML device", &gpu.device_used),
            ];
            for (what, metric) in rows_of {
                match metric {
                    Some(m) => rows.push(metric_row(label(what), m, finished)),
                    // Torch rows are absent without torch; NVML rows say they could not be read.
                    None if what.starts_with("NVML") => rows.push(unavailable_row(label(what))),
                    None => {}
                }
            }
            // Shown once a descendant held memory there: a notebook that launches no ranks keeps its table.
            if let Some(children) = gpu.children_used.as_ref().filter(|m| m.peak > 0) {
                rows.push(metric_row(label("child processes"), children, finished));
            }
        }
        Grid {
            title: format!("gpuexp · {} · {state} · {:.1} s", self.name, self.duration_s),
            lines,
            header: [
                "memory",
                "start",
                "peak",
                "consumed",
                "reclaimed",
                "share",
                if self.finished { "end" } else { "now" },
            ]
            .map(String::from)
            .to_vec(),
            rows,
            notes: prefixed("note", &self.notes),
            compact: false,
        }
    }
}

/// How a GPU is introduced above a table: both of its indices, so nobody confuses them.
fn device_line(torch_index: u32, nvml_index: u32, name: &str, uuid: &str, total: u64) -> String {
    format!("cuda:{torch_index} = NVML {nvml_index} · {name} · {uuid} · {} total", bytes(total))
}

fn metric_row(label: String, m: &Metric, finished: bool) -> Vec<String> {
    let dash = || "—".to_string();
    let last = match m.end {
        Some(end) => bytes(end),
        None if finished => "n/a".into(),
        None => bytes(m.before_teardown),
    };
    vec![
        label,
        bytes(m.start),
        bytes(m.peak),
        signed_bytes(m.consumed),
        m.reclaimed.map(signed_bytes).unwrap_or_else(dash),
        m.reclaimed_share().map(|s| format!("{:.1}%", s * 100.0)).unwrap_or_else(dash),
        last,
    ]
}

fn unavailable_row(label: String) -> Vec<String> {
    let mut row = vec![label];
    row.extend(std::iter::repeat_n("n/a".to_string(), 6));
    row
}

/// Sizes in binary units, two decimals: what a person reads against `nvidia-smi` and torch.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    // Compare after rounding to two decimals, so 1 MiB − 1 B reads "1.00 MiB", not "1024.00 KiB".
    while value >= 1023.995 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

pub fn signed_bytes(n: i64) -> String {
    match n {
        0 => "0 B".into(),
        n if n > 0 => format!("+{}", bytes(n as u64)),
        n => format!("-{}", bytes(n.unsigned_abs())),
    }
}

/// The cells of a table, rendered to text and to HTML from the same strings so that both
/// always show the same figures.
pub struct Grid {
    pub title: String,
    pub lines: Vec<String>,
    pub header: Vec<String>,
    pub rows: Vec<Vec<String>>,
    /// Lines under the table, shown as they are ("note: …", "hint: …").
    pub notes: Vec<String>,
    /// Without borders: the per-cell log sits under every cell and must stay small.
    pub compact: bool,
}

impl Grid {
    pub fn to_text(&self) -> String {
        let mut table = Table::new();
        table
            .load_style(if self.compact { presets::NOTHING } else { presets::UTF8_FULL_CONDENSED })
            .set_content_arrangement(ContentArrangement::Disabled)
            .set_header(&self.header);
        for row in &self.rows {
            table.add_row(row);
        }
        for column in table.column_iter_mut().skip(1) {
            column.set_cell_alignment(CellAlignment::Right);
        }
        let mut out = String::new();
        out.push_str(&self.title);
        out.push('\n');
        for line in &self.lines {
            out.push_str(line);
            out.push('\n');
        }
        out.push_str(&table.to_string());
        for note in &self.notes {
            out.push('\n');
            out.push_str(note);
        }
        out
    }

    pub fn to_html(&self) -> String {
        let mut out = String::from(if self.compact {
            "<div class=\"gpuexp\" style=\"font-size:smaller\">"
        } else {
            "<div class=\"gpuexp\">"
        });
        out.push_str(&format!("<b>{}</b><br>", escape(&self.title)));
        for line in &self.lines {
            out.push_str(&format!("<span>{}</span><br>", escape(line)));
        }
        out.push_str("<table><thead><tr>");
        for (i, head) in self.header.iter().enumerate() {
            out.push_str(&format!("<th style=\"text-align:{}\">{}</th>", align(i), escape(head)));
        }
        out.push_str("</tr></thead><tbody>");
        for row in &self.rows {
            out.push_str("<tr>");
            for (i, cell) in row.iter().enumerate() {
                out.push_str(&format!("<td style=\"text-align:{}\">{}</td>", align(i), escape(cell)));
            }
            out.push_str("</tr>");
        }
        out.push_str("</tbody></table>");
        for note in &self.notes {
            out.push_str(&format!("<small>{}</small><br>", escape(note)));
        }
        out.push_str("</div>");
        out
    }
}

/// One figure over one cell: how it moved, and how high it went above where the cell began.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
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

    fn moved(&self) -> bool {
        self.consumed != 0 || self.peak_above_start != 0
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
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
        [self.torch_allocated, self.torch_reserved, self.process_used].iter().flatten().any(CellMetric::moved)
    }
}

/// What one notebook cell did to memory.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CellRecord {
    pub execution_count: u64,
    pub started_at: String,
    pub wall_s: f64,
    pub host: CellMetric,
    pub gpus: Vec<CellGpu>,
    pub notes: Vec<String>,
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
            started_at: rfc3339(start.taken_at),
            wall_s: end.taken_at - start.taken_at,
            host: metric(Gauge::HostRss, &|s| Some(s.host.rss)).expect("host RSS is always read"),
            gpus,
            notes,
        }
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
            notes: prefixed("note", &self.notes),
            compact: true,
        }
    }
}

fn prefixed(label: &str, lines: &[String]) -> Vec<String> {
    lines.iter().map(|line| format!("{label}: {line}")).collect()
}

fn align(column: usize) -> &'static str {
    if column == 0 {
        "left"
    } else {
        "right"
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// The current state, as `gpuexp.snapshot()` and a new experiment show it.
pub fn snapshot_grid(snapshot: &Snapshot, title: &str) -> Grid {
    let host = &snapshot.host;
    let mut rows = vec![vec!["host RSS".into(), bytes(host.rss), "—".into(), "—".into()]];
    rows.push(vec![
        "host system".into(),
        bytes(host.total - host.available.min(host.total)),
        bytes(host.available),
        bytes(host.total),
    ]);
    if let Some(limit) = host.cgroup_limit {
        rows.push(vec!["host cgroup limit".into(), "—".into(), "—".into(), bytes(limit)]);
    }
    let mut lines = Vec::new();
    for gpu in &snapshot.gpus {
        lines.push(device_line(gpu.torch_index, gpu.nvml_index, &gpu.name, &gpu.uuid, gpu.total));
        let label = |what: &str| format!("cuda:{} {what}", gpu.torch_index);
        if let Some(t) = gpu.torch {
            rows.push(vec![label("torch allocated"), bytes(t.allocated), "—".into(), "—".into()]);
            rows.push(vec![label("torch reserved"), bytes(t.reserved), "—".into(), "—".into()]);
        }
        let process = gpu.process_used.map(bytes).unwrap_or_else(|| "n/a".into());
        rows.push(vec![label("NVML process"), process, "—".into(), "—".into()]);
        rows.push(vec![label("NVML device"), bytes(gpu.device_used), bytes(gpu.free), bytes(gpu.total)]);
    }
    Grid {
        title: format!("gpuexp · {title} · {}", rfc3339(snapshot.taken_at)),
        lines,
        // Host "available" (capped by the cgroup) and NVML "free": what a new allocation can get.
        header: ["memory", "used", "available", "total"].map(String::from).to_vec(),
        rows,
        notes: prefixed("note", &snapshot.notes),
        compact: false,
    }
}

/// UTC time as RFC 3339, without pulling in a date crate for one format.
pub fn rfc3339(unix_seconds: f64) -> String {
    let secs = unix_seconds.floor() as i64;
    let millis = ((unix_seconds - secs as f64) * 1000.0).round().min(999.0) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's days-to-civil algorithm.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::snapshot::testing::{gpu, host, torch, GIB};
    use crate::snapshot::TorchStats;

    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;

    fn finished(
        name: &str,
        start: &Snapshot,
        before: &Snapshot,
        end: &Snapshot,
        peaks: &HashMap<Gauge, u64>,
    ) -> Report {
        let span = Span { start, before_teardown: before, end: Some(end) };
        Report::build(name, true, span, |g| peaks.get(g).copied(), Names::default())
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
        assert_eq!(
            (rss.start, rss.before_teardown, rss.end, rss.peak),
            (100 * MIB, 400 * MIB, Some(150 * MIB), 600 * MIB)
        );
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
        let report = Report::build("c", false, span, |_| None, Names::default());
        assert_eq!(report.kind, "cpu");
    }

    #[test]
    fn gpu_rows_are_matched_by_uuid_when_the_gpu_order_changes() {
        let (a, b) = ("GPU-aaaa", "GPU-bbbb");
        let start = host(0.0, 0, 0)
            .with_gpu(with_torch(with_used(gpu(0, a), GIB, Some(0)), 0, 0))
            .with_gpu(with_torch(with_used(gpu(1, b), 2 * GIB, Some(0)), 0, 0));
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
    fn num_ooms_is_read_at_the_end() {
        let uuid = "GPU-aaaa";
        let ooms = |n: u64| GpuReading { torch: Some(TorchStats { num_ooms: n, ..torch(0, 0, 0, 0) }), ..gpu(0, uuid) };
        let at = |t: f64, n: u64| host(t, 0, 0).with_gpu(ooms(n));
        let report = finished("x", &at(0.0, 1), &at(1.0, 2), &at(2.0, 3), &no_peaks());
        assert_eq!(report.gpus[0].num_ooms, Some(3));
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
        let live = Report::build("x", true, span, |_| None, Names::default());
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
        let report = Report::build("live", true, span, |_| None, Names::default());
        assert!(!report.finished);
        assert_eq!(report.finished_at, None);
        assert_eq!(report.duration_s, 3.0);
        assert_eq!(report.host.available, 50 * GIB);
        assert_eq!(report.host.rss.end, None);
        assert_eq!(report.host.rss.reclaimed, None);
        assert_eq!(report.host.rss.consumed, (200 * MIB) as i64);
        let row = &report.gpus[0];
        for m in [
            row.torch_allocated.unwrap(),
            row.torch_reserved.unwrap(),
            row.process_used.unwrap(),
            row.device_used.unwrap(),
        ] {
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

    // --- bytes ----------------------------------------------------------------------------

    #[test]
    fn bytes_are_shown_in_binary_units_with_two_decimals() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1), "1 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(KIB), "1.00 KiB");
        assert_eq!(bytes(MIB + MIB / 2), "1.50 MiB");
        assert_eq!(bytes(GIB), "1.00 GiB");
        assert_eq!(bytes(80 * GIB), "80.00 GiB");
        assert_eq!(bytes(1 << 40), "1.00 TiB");
        assert_eq!(bytes(1 << 50), "1.00 PiB");
    }

    #[test]
    fn huge_sizes_stay_in_the_largest_unit() {
        assert_eq!(bytes(1 << 60), "1024.00 PiB");
        assert_eq!(bytes(u64::MAX), "16384.00 PiB");
    }

    #[test]
    fn a_size_that_rounds_up_to_the_next_unit_is_shown_in_that_unit() {
        assert_eq!(bytes(MIB - 1), "1.00 MiB");
        assert_eq!(bytes(GIB - 1), "1.00 GiB");
    }

    #[test]
    fn signed_bytes_show_the_direction() {
        assert_eq!(signed_bytes(0), "0 B");
        assert_eq!(signed_bytes(1023), "+1023 B");
        assert_eq!(signed_bytes(-1023), "-1023 B");
        assert_eq!(signed_bytes(GIB as i64), "+1.00 GiB");
        assert_eq!(signed_bytes(-((MIB + MIB / 2) as i64)), "-1.50 MiB");
        assert_eq!(signed_bytes(i64::MAX), "+8192.00 PiB");
        assert_eq!(signed_bytes(i64::MIN), "-8192.00 PiB");
    }

    // --- rfc3339 --------------------------------------------------------------------------

    #[test]
    fn rfc3339_formats_utc_with_milliseconds() {
        assert_eq!(rfc3339(0.0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_700_000_000.25), "2023-11-14T22:13:20.250Z");
        assert_eq!(rfc3339(1_700_000_000.0 + 0.001), "2023-11-14T22:13:20.001Z");
        assert_eq!(rfc3339(253_402_300_799.0), "9999-12-31T23:59:59.000Z");
    }

    #[test]
    fn rfc3339_handles_leap_days_and_century_years() {
        assert_eq!(rfc3339(1_709_164_800.0), "2024-02-29T00:00:00.000Z");
        assert_eq!(rfc3339(1_709_251_199.5), "2024-02-29T23:59:59.500Z");
        assert_eq!(rfc3339(1_709_251_200.0), "2024-03-01T00:00:00.000Z");
        // 2000 is a leap year (divisible by 400), 2100 is not (divisible by 100).
        assert_eq!(rfc3339(951_782_400.0), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339(4_107_542_400.0 - 86_400.0), "2100-02-28T00:00:00.000Z");
        assert_eq!(rfc3339(4_107_542_400.0), "2100-03-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_704_067_199.0), "2023-12-31T23:59:59.000Z");
    }

    #[test]
    fn rfc3339_before_the_epoch_counts_backwards() {
        assert_eq!(rfc3339(-1.0), "1969-12-31T23:59:59.000Z");
        assert_eq!(rfc3339(-0.5), "1969-12-31T23:59:59.500Z");
    }

    #[test]
    fn rfc3339_never_shows_a_thousandth_millisecond() {
        let shown = rfc3339(1_700_000_000.999_9);
        assert!(shown.ends_with(".999Z") || shown == "2023-11-14T22:13:21.000Z", "{shown}");
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
        };
        let span = Span { start: &start, before_teardown: &before, end: Some(&end) };
        Report::build("train <big> & \"fast\"", true, span, |g| peaks.get(g).copied(), names)
    }

    fn live_report() -> Report {
        let start = host(0.0, 100 * MIB, 100 * MIB).with_gpu(with_torch(gpu(0, "GPU-aaaa"), 0, 0));
        let now = host(2.0, 200 * MIB, 200 * MIB).with_gpu(with_torch(gpu(0, "GPU-aaaa"), GIB, GIB));
        let span = Span { start: &start, before_teardown: &now, end: None };
        let names = Names { deleted: vec!["never shown while running".into()], ..Names::default() };
        Report::build("live", true, span, |_| None, names)
    }

    /// The cells of the comfy-table box in `text`, header first.
    fn text_cells(text: &str) -> Vec<Vec<String>> {
        text.lines()
            .filter(|line| line.starts_with('│'))
            .map(|line| line.trim_matches('│').split(['│', '┆']).map(|cell| cell.trim().to_string()).collect())
            .collect()
    }

    fn unescape(html: &str) -> String {
        html.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", "\"").replace("&amp;", "&")
    }

    /// The cells of every `<tr>` in `html`, header first, unescaped.
    fn html_cells(html: &str) -> Vec<Vec<String>> {
        html.split("<tr>")
            .skip(1)
            .map(|row| {
                let row = &row[..row.find("</tr>").expect("every row is closed")];
                // Each piece after "<td" or "<th" is ` style="...">CELL</td>`.
                row.split('<')
                    .filter(|piece| ["td ", "th ", "td>", "th>"].iter().any(|tag| piece.starts_with(tag)))
                    .map(|piece| unescape(&piece[piece.find('>').expect("a tag ends") + 1..]))
                    .collect()
            })
            .collect()
    }

    fn expected_cells(grid: &Grid) -> Vec<Vec<String>> {
        std::iter::once(grid.header.clone()).chain(grid.rows.iter().cloned()).collect()
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
        let identifies_gpu_b = |l: &String| {
            l.starts_with("cuda:1 = NVML 1 · ") && l.contains("GPU-bbbb") && l.ends_with("80.00 GiB total")
        };
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
        let report = Report::build("n", false, Span { start: &s, before_teardown: &s, end: Some(&s) }, |_| None, names);
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
    fn json_has_the_documented_schema() {
        let json: serde_json::Value =
            serde_json::from_str(&serde_json::to_string_pretty(&rich_report()).unwrap()).expect("valid JSON");
        let names = ["deleted", "rebound", "kept", "cleared"];
        for key in ["name", "started_at", "finished_at", "duration_s", "host", "gpus", "notes"].into_iter().chain(names)
        {
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
        let json: serde_json::Value =
            serde_json::from_str(&serde_json::to_string_pretty(&live_report()).unwrap()).unwrap();
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
}

/// Another process on a GPU, as NVML lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OtherProcess {
    pub pid: u32,
    pub name: String,
    pub used: Option<u64>,
}

/// What a CUDA out-of-memory error asked for, what the device had, and what gpuexp freed.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OomDiagnosis {
    pub message: String,
    pub torch_index: Option<u32>,
    /// Bytes the failed allocation asked for, from torch's message.
    pub requested: Option<u64>,
    pub total: Option<u64>,
    pub free_before: Option<u64>,
    pub free_after: Option<u64>,
    pub torch_allocated_before: Option<u64>,
    pub torch_allocated_after: Option<u64>,
    pub torch_reserved_before: Option<u64>,
    pub process_used_before: Option<u64>,
    pub others: Vec<OtherProcess>,
    pub hints: Vec<String>,
    pub cleared: Vec<String>,
}

/// Reads "Tried to allocate 2.00 GiB" and "GPU 0 has a total capacity" from torch's message.
pub fn parse_oom_message(message: &str) -> (Option<u64>, Option<u32>) {
    let requested = message.split("Tried to allocate ").nth(1).and_then(|rest| {
        let mut words = rest.split_whitespace();
        let number: f64 = words.next()?.parse().ok()?;
        let unit = words.next()?.trim_end_matches(['.', ';', ',', ')']);
        let scale = match unit {
            "B" | "bytes" => 1.0,
            "KiB" => 1024.0,
            "MiB" => 1024.0 * 1024.0,
            "GiB" => 1024.0 * 1024.0 * 1024.0,
            "TiB" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
            _ => return None,
        };
        Some((number * scale).round() as u64)
    });
    // "GPU 0 has a total capacity" (torch 2) or "(GPU 1; 79.19 GiB total capacity" (torch 1).
    let device = message.split("GPU ").nth(1).and_then(|rest| {
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().ok()
    });
    (requested, device)
}

impl OomDiagnosis {
    /// Suggestions a person can act on, from the figures. The batch-size factor assumes
    /// memory grows linearly with the batch, as it nearly does for most models.
    pub fn hints(&self) -> Vec<String> {
        let mut hints = Vec::new();
        let freed = self.torch_allocated_before.zip(self.torch_allocated_after).map(|(b, a)| b.saturating_sub(a));
        if let (Some(requested), Some(freed), Some(free)) = (self.requested, freed, self.free_after) {
            let needed = freed + requested;
            if needed > 0 {
                let factor = free as f64 / needed as f64;
                if factor < 1.0 {
                    hints.push(format!(
                        "the failed step needed about {} ({} it held + {} more); {} is free now: \
                         a batch about {:.2}× the size should fit (memory grows about linearly with the batch)",
                        bytes(needed),
                        bytes(freed),
                        bytes(requested),
                        bytes(free),
                        (factor * 0.95).max(0.0)
                    ));
                } else {
                    hints.push(format!(
                        "{} is free now, more than the step needed ({}): running it again may fit",
                        bytes(free),
                        bytes(needed)
                    ));
                }
            }
        }
        if let (Some(reserved), Some(allocated), Some(requested)) =
            (self.torch_reserved_before, self.torch_allocated_before, self.requested)
        {
            let cached = reserved.saturating_sub(allocated);
            if cached >= requested && requested > 0 {
                hints.push(format!(
                    "torch held {} reserved but unallocated, more than the request: fragmentation. \
                     Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the first CUDA allocation (a new kernel)",
                    bytes(cached)
                ));
            }
        }
        let others: u64 = self.others.iter().filter_map(|p| p.used).sum();
        if let Some(total) = self.total {
            if others > total / 10 {
                hints.push(format!("other processes hold {} of this GPU: stop them or use another GPU", bytes(others)));
            }
        }
        hints
    }

    pub fn grid(&self) -> Grid {
        let opt = |v: Option<u64>| v.map(bytes).unwrap_or_else(|| "n/a".into());
        let non_torch = self.process_used_before.zip(self.torch_reserved_before).map(|(p, r)| p.saturating_sub(r));
        let fragmentation =
            self.torch_reserved_before.zip(self.torch_allocated_before).map(|(r, a)| r.saturating_sub(a));
        let mut rows = vec![
            vec!["requested".to_string(), opt(self.requested), "—".into()],
            vec!["device total".into(), opt(self.total), "—".into()],
            vec!["device free".into(), opt(self.free_before), opt(self.free_after)],
            vec!["torch allocated".into(), opt(self.torch_allocated_before), opt(self.torch_allocated_after)],
            vec!["torch reserved, unallocated".into(), opt(fragmentation), "—".into()],
            vec!["this process, not torch (context, libraries)".into(), opt(non_torch), "—".into()],
        ];
        for other in &self.others {
            rows.push(vec![format!("process {} ({})", other.pid, other.name), opt(other.used), "—".into()]);
        }
        let mut lines = Vec::new();
        if !self.cleared.is_empty() {
            lines.push(format!("cleared: {}", self.cleared.join(", ")));
        }
        let device = self.torch_index.map(|i| format!("cuda:{i}")).unwrap_or_else(|| "the GPU".into());
        Grid {
            title: format!("gpuexp · CUDA out of memory on {device} · rescued"),
            lines,
            header: ["memory", "at the error", "after the rescue"].map(String::from).to_vec(),
            rows,
            notes: prefixed("hint", &self.hints),
            compact: false,
        }
    }
}

#[cfg(test)]
mod oom_tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn torch_messages_of_both_generations_are_read() {
        let new = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB";
        assert_eq!(parse_oom_message(new), (Some(2 * GIB), Some(0)));
        let old = "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 1; 79.19 GiB total capacity";
        assert_eq!(parse_oom_message(old), (Some(20 << 20), Some(1)));
        assert_eq!(parse_oom_message("CUDA error: out of memory"), (None, None));
        assert_eq!(parse_oom_message("Tried to allocate lots of GPU memory"), (None, None));
    }

    fn diagnosis() -> OomDiagnosis {
        OomDiagnosis {
            message: String::new(),
            torch_index: Some(0),
            requested: Some(2 * GIB),
            total: Some(80 * GIB),
            free_before: Some(GIB),
            free_after: Some(6 * GIB),
            torch_allocated_before: Some(70 * GIB),
            torch_allocated_after: Some(62 * GIB),
            torch_reserved_before: Some(71 * GIB), // 1 GiB cached: less than the request
            process_used_before: Some(73 * GIB),
            others: Vec::new(),
            hints: Vec::new(),
            cleared: Vec::new(),
        }
    }

    #[test]
    fn the_batch_factor_is_what_is_free_over_what_the_step_needed() {
        // The step held 8 GiB and asked for 2 more; 6 GiB is free after the rescue.
        let hints = diagnosis().hints();
        assert!(hints[0].contains("10.00 GiB") && hints[0].contains(&format!("{:.2}×", 0.6 * 0.95)), "{hints:?}");
    }

    #[test]
    fn fragmentation_and_other_processes_get_their_hints() {
        let mut d = diagnosis();
        d.torch_reserved_before = Some(75 * GIB); // 5 GiB cached, more than the 2 GiB asked for
        d.others = vec![OtherProcess { pid: 7, name: "python".into(), used: Some(20 * GIB) }];
        let hints = d.hints();
        assert!(hints.iter().any(|h| h.contains("expandable_segments")), "{hints:?}");
        assert!(hints.iter().any(|h| h.contains("other processes hold 20.00 GiB")), "{hints:?}");
        assert!(!diagnosis().hints().iter().any(|h| h.contains("expandable_segments")));
    }

    #[test]
    fn the_table_says_what_it_cleared_and_hints() {
        let mut d = diagnosis();
        d.cleared = vec!["frames of the failed call".into()];
        d.hints = d.hints();
        let text = d.grid().to_text();
        assert!(
            text.contains("cleared: frames of the failed call") && text.contains("hint: the failed step"),
            "{text}"
        );
    }
}

/// One object that keeps memory alive, and the way to it from something a person recognises.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    /// How to reach it: `cache[0]`, `model.encoder.layers.3.weight`, `Out[12]`, …
    pub path: String,
    pub bytes: u64,
    /// "cuda:0", "cpu".
    pub device: String,
    /// "tensor", "ndarray".
    pub kind: String,
    pub shape: String,
}

/// What holds memory on a device (or on the host), largest first.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Holders {
    pub device: String,
    pub holders: Vec<Holder>,
    /// Live tensors no root reaches (only C++ or an uncollected cycle refers to them).
    pub unreachable: u64,
    /// Allocated by torch with no Python tensor at all: saved for backward, CUDA graph pools, workspaces.
    pub no_python_tensor: Option<u64>,
    /// Reserved by torch's allocator but not allocated: its cache, and fragmentation.
    pub cached: Option<u64>,
    pub objects_visited: u64,
    pub seconds: f64,
}

impl Holders {
    pub fn grid(&self, title: &str) -> Grid {
        let mut rows: Vec<Vec<String>> = self
            .holders
            .iter()
            .map(|h| vec![h.path.clone(), bytes(h.bytes), format!("{} {} {}", h.kind, h.shape, h.device)])
            .collect();
        let mut extra = |label: &str, value: Option<u64>, what: &str| {
            if let Some(value) = value.filter(|v| *v > 0) {
                rows.push(vec![label.to_string(), bytes(value), what.to_string()]);
            }
        };
        extra("(no reachable referrer)", Some(self.unreachable), "live tensors only C++ or a cycle holds");
        extra("(no Python tensor)", self.no_python_tensor, "saved for backward, CUDA graph pools, workspaces");
        extra("(reserved, unallocated)", self.cached, "torch's cache and fragmentation: empty_cache() frees it");
        Grid {
            title: format!("gpuexp · {title} · {}", self.device),
            lines: Vec::new(),
            header: ["held by", "size", "what"].map(String::from).to_vec(),
            rows,
            notes: vec![format!("{} objects visited in {:.2} s", self.objects_visited, self.seconds)],
            compact: false,
        }
    }
}

/// Renders an object path from its edges, the way a person writes it: module children,
/// parameters and buffers as dotted names (`model.encoder.layers.3.weight`).
pub fn render_path(edges: &[PathEdge]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < edges.len() {
        match (&edges[i], edges.get(i + 1)) {
            (PathEdge::Attr(a), Some(PathEdge::Key(k)))
                if matches!(a.as_str(), "_modules" | "_parameters" | "_buffers") =>
            {
                out.push('.');
                out.push_str(k.trim_matches('\''));
                i += 2;
                continue;
            }
            (PathEdge::Root(name), _) => out.push_str(name),
            (PathEdge::Attr(a), _) => {
                out.push('.');
                out.push_str(a);
            }
            (PathEdge::Key(k), _) => out.push_str(&format!("[{k}]")),
            (PathEdge::Index(n), _) => out.push_str(&format!("[{n}]")),
            (PathEdge::Closure(name), _) => out.push_str(&format!(" (closure cell {name})")),
            (PathEdge::Frame(name), _) => out.push_str(&format!(" → {name}")),
            (PathEdge::Local(name), _) => out.push_str(&format!(" → local {name}")),
        }
        i += 1;
    }
    out
}

/// One step from an object to something it refers to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PathEdge {
    /// Where a path starts: a notebook name, `Out[3]`, `mymod.CACHE`, a traceback frame.
    Root(String),
    Attr(String),
    /// A dict key, already written as a person would (`'exp_avg'`, `model.0.weight`).
    Key(String),
    Index(usize),
    Closure(String),
    /// A frame of a traceback: "step(), line 3".
    Frame(String),
    Local(String),
}

#[cfg(test)]
mod holder_tests {
    use super::*;

    fn path(edges: Vec<PathEdge>) -> String {
        render_path(&edges)
    }

    #[test]
    fn module_children_and_parameters_read_as_dotted_names() {
        use PathEdge::*;
        let edges = vec![
            Root("model".into()),
            Attr("_modules".into()),
            Key("'encoder'".into()),
            Attr("_modules".into()),
            Key("'layers'".into()),
            Attr("_modules".into()),
            Key("'3'".into()),
            Attr("_parameters".into()),
            Key("'weight'".into()),
        ];
        assert_eq!(path(edges), "model.encoder.layers.3.weight");
    }

    #[test]
    fn containers_closures_and_frames() {
        use PathEdge::*;
        assert_eq!(path(vec![Root("cache".into()), Index(0)]), "cache[0]");
        assert_eq!(
            path(vec![Root("opt".into()), Attr("state".into()), Key("model.0.weight".into()), Key("'exp_avg'".into())]),
            "opt.state[model.0.weight]['exp_avg']"
        );
        assert_eq!(path(vec![Root("fn".into()), Closure("buf".into())]), "fn (closure cell buf)");
        assert_eq!(
            path(vec![Root("traceback: step, line 3".into()), Local("held".into())]),
            "traceback: step, line 3 → local held"
        );
    }

    #[test]
    fn the_table_lists_holders_then_memory_without_referrers() {
        let holders = Holders {
            device: "cuda:0".into(),
            holders: vec![Holder {
                path: "cache[0]".into(),
                bytes: 1 << 30,
                device: "cuda:0".into(),
                kind: "tensor".into(),
                shape: "[1073741824]".into(),
            }],
            unreachable: 0,
            no_python_tensor: Some(64 << 20),
            cached: Some(0),
            objects_visited: 10,
            seconds: 0.01,
        };
        let text = holders.grid("holders").to_text();
        assert!(
            text.contains("cache[0]") && text.contains("1.00 GiB") && text.contains("(no Python tensor)"),
            "{text}"
        );
        assert!(!text.contains("(reserved, unallocated)") && !text.contains("(no reachable referrer)"), "{text}");
    }
}
