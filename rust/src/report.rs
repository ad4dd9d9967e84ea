//! Reports: what a scope consumed, reclaimed and peaked at, as JSON, a text table
//! (comfy-table) and an HTML table built from the same cells.

use comfy_table::{presets, CellAlignment, ContentArrangement, Table};
use serde::Serialize;

use crate::snapshot::{Gauge, GpuReading, Snapshot};

/// One gauge over a scope. consumed = before_teardown − start; reclaimed = before_teardown − end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
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

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HostReport {
    pub rss: Metric,
    pub available: u64,
    pub total: u64,
    pub cgroup_limit: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GpuReport {
    pub torch_index: u32,
    pub nvml_index: u32,
    pub uuid: String,
    pub name: String,
    pub total: u64,
    pub torch_allocated: Option<Metric>,
    pub torch_reserved: Option<Metric>,
    pub process_used: Option<Metric>,
    pub device_used: Metric,
    pub num_ooms: Option<u64>,
}

/// What teardown did to names and hidden references.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
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

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    pub name: String,
    pub kind: &'static str,
    pub finished: bool,
    pub started_at: String,
    pub finished_at: Option<String>,
    pub duration_s: f64,
    #[serde(flatten)]
    pub names: Names,
    pub host: HostReport,
    pub gpus: Vec<GpuReport>,
    pub notes: Vec<String>,
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
        let metric = |gauge: Gauge, value: &dyn Fn(&Snapshot) -> Option<u64>| -> Option<Metric> {
            let (s, b) = (value(start), value(before));
            if s.is_none() && b.is_none() {
                return None;
            }
            let e = end.map(|e| value(e).unwrap_or(0));
            Some(Metric::new(s.unwrap_or(0), b.unwrap_or(0), e, peak(&gauge).unwrap_or(0).max(e.unwrap_or(0))))
        };
        let host = HostReport {
            rss: metric(Gauge::HostRss, &|s| Some(s.host.rss)).expect("host RSS is always read"),
            available: end.unwrap_or(before).host.available,
            total: before.host.total,
            cgroup_limit: before.host.cgroup_limit,
        };
        let gpus = start
            .gpus
            .iter()
            .map(|first| {
                let uuid = first.uuid.clone();
                let field = |pick: fn(&GpuReading) -> Option<u64>| {
                    let uuid = uuid.clone();
                    move |s: &Snapshot| s.gpu(&uuid).and_then(pick)
                };
                let torch_allocated = metric(Gauge::TorchAllocated(uuid.clone()), &field(|g| g.torch.map(|t| t.allocated)));
                let torch_reserved = metric(Gauge::TorchReserved(uuid.clone()), &field(|g| g.torch.map(|t| t.reserved)));
                // A figure that was unavailable at any point makes the whole row unavailable.
                let process_known = [Some(start), Some(before), end]
                    .into_iter()
                    .flatten()
                    .all(|s| s.gpu(&uuid).is_some_and(|g| g.process_used.is_some()));
                let process_used = process_known
                    .then(|| metric(Gauge::ProcessUsed(uuid.clone()), &field(|g| g.process_used)))
                    .flatten();
                let device_used = metric(Gauge::DeviceUsed(uuid.clone()), &field(|g| Some(g.device_used)))
                    .expect("device used is always read");
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
            kind: if gpu { "gpu" } else { "cpu" },
            finished: end.is_some(),
            started_at: rfc3339(start.taken_at),
            finished_at: finished_at.map(rfc3339),
            duration_s: finished_at.unwrap_or(before.taken_at) - start.taken_at,
            names,
            host,
            gpus,
            notes,
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a report always serialises")
    }

    fn grid(&self) -> Grid {
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
        lines.extend(self.gpus.iter().map(gpu_line));
        let mut rows = vec![metric_row("host RSS".into(), &self.host.rss)];
        for gpu in &self.gpus {
            let label = |what: &str| format!("cuda:{} {what}", gpu.torch_index);
            let rows_of = [
                ("torch allocated", &gpu.torch_allocated),
                ("torch reserved", &gpu.torch_reserved),
                ("NVML process", &gpu.process_used),
                ("NVML device", &Some(gpu.device_used)),
            ];
            for (what, metric) in rows_of {
                match metric {
                    Some(m) => rows.push(metric_row(label(what), m)),
                    None if what == "NVML process" => rows.push(unavailable_row(label(what))),
                    None => {}
                }
            }
        }
        Grid {
            title: format!("gpuexp · {} · {state} · {:.1} s", self.name, self.duration_s),
            lines,
            header: ["memory", "start", "peak", "consumed", "reclaimed", "share", if self.finished { "end" } else { "now" }]
                .map(String::from)
                .to_vec(),
            rows,
            notes: self.notes.clone(),
        }
    }

    pub fn to_text(&self) -> String {
        self.grid().to_text()
    }

    pub fn to_html(&self) -> String {
        self.grid().to_html()
    }
}

fn gpu_line(gpu: &GpuReport) -> String {
    format!(
        "cuda:{} = NVML {} · {} · {} · {} total",
        gpu.torch_index,
        gpu.nvml_index,
        gpu.name,
        gpu.uuid,
        bytes(gpu.total)
    )
}

fn metric_row(label: String, m: &Metric) -> Vec<String> {
    let dash = || "—".to_string();
    vec![
        label,
        bytes(m.start),
        bytes(m.peak),
        signed_bytes(m.consumed),
        m.reclaimed.map(signed_bytes).unwrap_or_else(dash),
        m.reclaimed_share().map(|s| format!("{:.1}%", s * 100.0)).unwrap_or_else(dash),
        bytes(m.end.unwrap_or(m.before_teardown)),
    ]
}

fn unavailable_row(label: String) -> Vec<String> {
    let mut row = vec![label];
    row.extend(std::iter::repeat("n/a".to_string()).take(6));
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
    while value >= 1024.0 && unit + 1 < UNITS.len() {
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
    pub notes: Vec<String>,
}

impl Grid {
    pub fn to_text(&self) -> String {
        let mut table = Table::new();
        table
            .load_style(presets::UTF8_FULL_CONDENSED)
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
            out.push_str("\nnote: ");
            out.push_str(note);
        }
        out
    }

    pub fn to_html(&self) -> String {
        let mut out = String::from("<div class=\"gpuexp\">");
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
            out.push_str(&format!("<small>note: {}</small><br>", escape(note)));
        }
        out.push_str("</div>");
        out
    }
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
    rows.push(vec!["host system".into(), bytes(host.total - host.available.min(host.total)), bytes(host.available), bytes(host.total)]);
    if let Some(limit) = host.cgroup_limit {
        rows.push(vec!["host cgroup limit".into(), "—".into(), "—".into(), bytes(limit)]);
    }
    let mut lines = Vec::new();
    for gpu in &snapshot.gpus {
        lines.push(format!("cuda:{} = NVML {} · {} · {}", gpu.torch_index, gpu.nvml_index, gpu.name, gpu.uuid));
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
        header: ["memory", "used", "free", "total"].map(String::from).to_vec(),
        rows,
        notes: snapshot.notes.clone(),
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
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}
