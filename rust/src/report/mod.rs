//! Reports: what a scope consumed, reclaimed and peaked at, as JSON and as a table (a [`Grid`](crate::grid::Grid)).
//! The rest of the report family lives beside it: the cell log's records, the OOM diagnosis,
//! what still holds memory, and the snapshot's table.

mod cell;
mod creep;
mod holders;
mod oom;
mod oom_message;
mod rank;
mod roles;
mod snapshot;
#[cfg(test)]
mod tests;
mod traced;

use serde::{Deserialize, Serialize};

pub use crate::params::{Param, Params};
pub use cell::{CellGpu, CellMetric, CellRecord};
pub use creep::{same_rises, Creep, CreptOver, RisingRuns};
#[cfg(test)]
pub(crate) use holders::test_tensor;
pub use holders::{render_path, Holder, Holders, PartlyRead, PathEdge};
pub use oom::{
    parse_oom_message, FailedLine, FiguresSource, OomCause, OomDiagnosis, OtherProcess, PoolBytes, TorchPools,
};
pub use oom_message::OomMessage;
pub use rank::{hostname, RankIdentity};
pub use roles::{Role, TensorRoles};
pub use snapshot::snapshot_grid;

use crate::grid::{prefixed, Grid};
use crate::monitor::Sample;
use crate::snapshot::{Gauge, GpuReading, Snapshot};
use crate::teardown::Names;
use crate::units::{bytes, rfc3339, signed_bytes};

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

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub name: String,
    /// What the experiment varied: `params=`, or the `key=value` pieces of its name.
    pub params: Params,
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
    #[serde(default)]
    pub cells: Vec<CellRecord>,
    /// Where memory the scope created did not come back: what still holds it.
    pub holders: Vec<Holders>,
    /// Bytes torch could allocate on each GPU while the scope was open (`limit=`).
    pub limit: Option<u64>,
    /// The timeline its monitor recorded (`monitor=True`; not published to other ranks).
    #[serde(default)]
    pub monitor: Vec<Sample>,
    /// rank, local_rank, world_size and hostname, as top-level keys, in a rank of a distributed run.
    #[serde(flatten)]
    pub rank: RankIdentity,
    /// Descendant processes still holding GPU memory when the scope finished: never ended by gpuexp.
    #[serde(default)]
    pub child_processes: Vec<crate::snapshot::children::ChildProcess>,
    /// With `trace=True`: each GPU's peak by source line, its timeline, what the scope left held
    /// and its OOMs (not published to other ranks).
    #[serde(default, skip_deserializing, skip_serializing_if = "Vec::is_empty")]
    pub trace: Vec<crate::trace::DeviceTrace>,
    /// With `trace="host"` or `"all"`: Python's allocations grown by source line (tracemalloc;
    /// not published to other ranks).
    #[serde(default, skip_deserializing, skip_serializing_if = "Option::is_none")]
    pub host_trace: Option<crate::trace::HostTrace>,
}

/// What a report holds beside its figures: what teardown did and what the scope recorded.
#[derive(Default)]
pub struct Details {
    pub names: Names,
    /// Steps that failed, after the snapshots' own notes.
    pub notes: Vec<String>,
    pub cells: Vec<CellRecord>,
    pub limit: Option<u64>,
    pub monitor: Vec<Sample>,
    /// `params=`; None: read from the name.
    pub params: Option<Params>,
}

/// The snapshots a report is built from; `end` is None while the scope is open.
pub struct Span<'a> {
    pub start: &'a Snapshot,
    pub before_teardown: &'a Snapshot,
    pub end: Option<&'a Snapshot>,
}

impl Report {
    /// The window of this traced experiment, opened at `opened_us`, for its `devices`: torch's
    /// own peak over it, saved with the snapshot, is the figure its replay meets.
    pub fn trace_window(&self, opened_us: i64, max_entries: Option<u64>, devices: &[u32]) -> crate::trace::WindowKey {
        let peaks = (self.gpus.iter())
            .filter(|gpu| devices.contains(&gpu.torch_index))
            .filter_map(|gpu| Some((gpu.torch_index, gpu.torch_allocated.as_ref()?.peak)))
            .collect();
        crate::trace::WindowKey { opened_us, max_entries, peaks }
    }

    pub fn build(name: &str, gpu: bool, span: Span, peak: impl Fn(&Gauge) -> Option<u64>, details: Details) -> Report {
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
                    // Torch counts for the whole process: the scope's are those since its start.
                    num_ooms: end
                        .unwrap_or(before)
                        .gpu(&uuid)
                        .and_then(|g| g.torch)
                        .map(|t| t.num_ooms.saturating_sub(first.torch.map_or(0, |s| s.num_ooms))),
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
        notes.extend(details.notes);
        let finished_at = end.map(|e| e.taken_at);
        Report {
            name: name.to_string(),
            params: details.params.unwrap_or_else(|| Params::from_name(name)),
            kind: if gpu { "gpu" } else { "cpu" }.into(),
            finished: end.is_some(),
            started_at: rfc3339(start.taken_at),
            finished_at: finished_at.map(rfc3339),
            duration_s: finished_at.unwrap_or(before.taken_at) - start.taken_at,
            names: details.names,
            host,
            gpus,
            notes,
            cells: details.cells,
            holders: Vec::new(),
            limit: details.limit,
            monitor: details.monitor,
            rank: Default::default(),
            child_processes: Vec::new(),
            trace: Vec::new(),
            host_trace: None,
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
            list("not deleted, still bound", &self.names.not_deleted, &mut lines);
            list("left, looks like IPython's", &self.names.left, &mut lines);
            if self.names.deleted.is_empty() && self.names.rebound.is_empty() {
                lines.push("deleted: nothing".into());
            }
        }
        lines.extend(self.gpus.iter().map(|g| device_line(g.torch_index, g.nvml_index, &g.name, &g.uuid, g.total)));
        if let Some(limit) = self.limit {
            lines.push(format!("limit: torch could allocate {} per GPU (a smaller card, rehearsed)", bytes(limit)));
        }
        for held in &self.holders {
            lines.push(self.holders_line(held));
            if let Some(roles) = held.roles {
                lines.push(format!("  that is {}", roles.summary()));
            }
        }
        lines.extend(self.trace_lines());
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

/// Below this a change is noise (allocator pages, the interpreter's own growth): tables show it as
/// about zero and give no share, so an experiment that did nothing doesn't read as a loss. The JSON
/// keeps the exact bytes.
const NOISE_FLOOR: i64 = 1 << 20;

fn change(bytes: i64) -> String {
    if bytes != 0 && bytes.abs() < NOISE_FLOOR {
        "≈ 0".into()
    } else {
        signed_bytes(bytes)
    }
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
        change(m.consumed),
        m.reclaimed.map(change).unwrap_or_else(dash),
        m.reclaimed_share()
            .filter(|_| m.consumed >= NOISE_FLOOR)
            .map(|s| format!("{:.1}%", s * 100.0))
            .unwrap_or_else(dash),
        last,
    ]
}

fn unavailable_row(label: String) -> Vec<String> {
    let mut row = vec![label];
    row.extend(std::iter::repeat_n("n/a".to_string(), 6));
    row
}
