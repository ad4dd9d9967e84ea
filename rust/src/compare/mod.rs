//! Finished experiments side by side: what each varied (its params), how long it ran, the peak
//! of every layer, what it consumed and how much of that came back, and its out-of-memory
//! errors. As a table, as JSON in the reports' own shape, as columns for a data frame, and as
//! a plot of the peaks against a param with a fit ([`plot`]).

mod plot;

use std::collections::BTreeSet;
use std::sync::Arc;

use serde::Serialize;
use serde_json::Value;

pub use plot::{Fit, Level, Plot, Series};

use crate::grid::Grid;
use crate::report::{GpuReport, HostReport, Metric, Params, Report};
use crate::units::{bytes, signed_bytes};

/// One experiment: its name and params, and its report's figures in the report's JSON shape.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Row {
    pub name: String,
    pub params: Params,
    pub kind: String,
    pub finished: bool,
    pub duration_s: f64,
    pub host: HostReport,
    pub gpus: Vec<GpuReport>,
    pub limit: Option<u64>,
}

impl From<&Report> for Row {
    fn from(report: &Report) -> Row {
        Row {
            name: report.name.clone(),
            params: report.params.clone(),
            kind: report.kind.to_string(),
            finished: report.finished,
            duration_s: report.duration_s,
            host: report.host.clone(),
            gpus: report.gpus.clone(),
            limit: report.limit,
        }
    }
}

impl Row {
    /// What the "consumed" and "reclaimed" columns measure: the innermost layer the experiment
    /// has (torch allocated where torch ran, else NVML's process figure, else host RSS), summed
    /// over its GPUs. Returns the layer's name with its figures.
    fn consumed_reclaimed(&self) -> (&'static str, i64, Option<i64>) {
        let (layer, metrics) = GPU_LAYERS[..3]
            .iter()
            .filter(|layer| layer.json != "torch_reserved")
            .map(|layer| (layer.plotted, self.gpus.iter().filter_map(layer.pick).collect::<Vec<_>>()))
            .find(|(_, found)| !found.is_empty())
            .unwrap_or(("host RSS", vec![self.host.rss]));
        let consumed = metrics.iter().map(|m| m.consumed).sum();
        let reclaimed = metrics.iter().map(|m| m.reclaimed).sum::<Option<i64>>();
        (layer, consumed, reclaimed)
    }

    fn ooms(&self) -> Option<u64> {
        self.gpus.iter().map(|g| g.num_ooms).sum::<Option<u64>>().filter(|_| !self.gpus.is_empty())
    }

    fn gpu(&self, torch_index: u32) -> Option<&GpuReport> {
        self.gpus.iter().find(|g| g.torch_index == torch_index)
    }
}

/// A GPU layer: its name in a report's JSON, in a table column, in a plot, and its figure.
struct Layer {
    json: &'static str,
    column: &'static str,
    plotted: &'static str,
    pick: fn(&GpuReport) -> Option<Metric>,
}

/// The layers compared; the first three are plotted and have a peak column.
const GPU_LAYERS: [Layer; 4] = [
    Layer { json: "torch_allocated", column: "allocated", plotted: "torch allocated", pick: |g| g.torch_allocated },
    Layer { json: "torch_reserved", column: "reserved", plotted: "torch reserved", pick: |g| g.torch_reserved },
    Layer { json: "process_used", column: "NVML", plotted: "NVML process", pick: |g| g.process_used },
    Layer { json: "device_used", column: "NVML device", plotted: "NVML device", pick: |g| g.device_used },
];

/// Columns and rows for a data frame: one row per experiment, one column per param and figure.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Columns {
    pub columns: Vec<String>,
    pub rows: Vec<Vec<Value>>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Comparison {
    pub rows: Vec<Row>,
}

impl Comparison {
    pub fn of<'a>(reports: impl IntoIterator<Item = &'a Report>) -> Comparison {
        Comparison { rows: reports.into_iter().map(Row::from).collect() }
    }

    /// Every param key, in the order the experiments first give them.
    pub fn param_keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = Vec::new();
        for row in &self.rows {
            for (key, _) in &row.params.0 {
                if !keys.contains(key) {
                    keys.push(key.clone());
                }
            }
        }
        keys
    }

    /// Torch indices of every GPU some experiment measured.
    fn gpu_indices(&self) -> BTreeSet<u32> {
        self.rows.iter().flat_map(|r| r.gpus.iter().map(|g| g.torch_index)).collect()
    }

    pub fn grid(&self) -> Grid {
        let keys = self.param_keys();
        let gpus = self.gpu_indices();
        let mut header = vec!["experiment".to_string()];
        header.extend(keys.iter().cloned());
        header.extend(["duration".into(), "host RSS peak".into()]);
        for index in &gpus {
            header.extend(GPU_LAYERS[..3].iter().map(|layer| format!("cuda:{index} {} peak", layer.column)));
        }
        header.extend(["consumed", "share reclaimed", "OOMs"].map(String::from));
        let dash = || "—".to_string();
        let rows = self
            .rows
            .iter()
            .map(|row| {
                let name = if row.finished { row.name.clone() } else { format!("{} (running)", row.name) };
                let mut cells = vec![name];
                cells.extend(keys.iter().map(|k| row.params.get(k).map(ToString::to_string).unwrap_or_else(dash)));
                cells.push(format!("{:.1} s", row.duration_s));
                cells.push(bytes(row.host.rss.peak));
                for index in &gpus {
                    for layer in &GPU_LAYERS[..3] {
                        cells.push(row.gpu(*index).and_then(layer.pick).map(|m| bytes(m.peak)).unwrap_or_else(dash));
                    }
                }
                let (_, consumed, reclaimed) = row.consumed_reclaimed();
                cells.push(signed_bytes(consumed));
                let share = reclaimed.filter(|_| consumed > 0).map(|r| r as f64 / consumed as f64);
                cells.push(share.map(|s| format!("{:.1}%", s * 100.0)).unwrap_or_else(dash));
                cells.push(row.ooms().map(|n| n.to_string()).unwrap_or_else(dash));
                cells
            })
            .collect();
        let mut layers: Vec<&str> = self.rows.iter().map(|r| r.consumed_reclaimed().0).collect();
        layers.sort_unstable();
        layers.dedup();
        let mut notes = vec![match layers.as_slice() {
            [one] => format!("note: consumed and reclaimed: {one}"),
            _ => "note: consumed and reclaimed: torch allocated where torch ran (all GPUs), else NVML process, \
                  else host RSS"
                .into(),
        }];
        if self.rows.is_empty() {
            notes = vec!["note: no finished experiments in this kernel yet".into()];
        } else if self.rows.iter().any(|r| !r.finished) {
            notes.push("note: a running experiment's figures are those so far".into());
        }
        let count = self.rows.len();
        Grid {
            title: format!("gpuexp · compare · {count} experiment{}", if count == 1 { "" } else { "s" }),
            lines: Vec::new(),
            header,
            rows,
            notes,
            compact: false,
        }
    }

    /// A row per experiment, a column per param (its value as given: numbers stay numbers) and
    /// per figure, named by its path in the report's JSON with the GPU's torch index
    /// (`host.rss.peak`, `cuda:0.torch_allocated.peak`).
    pub fn columns(&self) -> Columns {
        let keys = self.param_keys();
        let gpus = self.gpu_indices();
        let mut columns = vec!["name".to_string()];
        columns.extend(keys.iter().cloned());
        columns.extend(["finished", "duration_s"].map(String::from));
        let figures = ["peak", "consumed", "reclaimed"];
        columns.extend(figures.map(|f| format!("host.rss.{f}")));
        for index in &gpus {
            for layer in &GPU_LAYERS {
                columns.extend(figures.map(|f| format!("cuda:{index}.{}.{f}", layer.json)));
            }
            columns.push(format!("cuda:{index}.num_ooms"));
        }
        columns.push("limit".into());
        let metric_values = |m: Option<Metric>| -> [Value; 3] {
            match m {
                Some(m) => [m.peak.into(), m.consumed.into(), m.reclaimed.into()],
                None => [Value::Null, Value::Null, Value::Null],
            }
        };
        let rows = self
            .rows
            .iter()
            .map(|row| {
                let mut values: Vec<Value> = vec![row.name.clone().into()];
                values.extend(keys.iter().map(|k| {
                    row.params.get(k).map(|p| serde_json::to_value(p).expect("params serialise")).unwrap_or(Value::Null)
                }));
                values.extend([row.finished.into(), row.duration_s.into()]);
                values.extend(metric_values(Some(row.host.rss)));
                for index in &gpus {
                    let gpu = row.gpu(*index);
                    for layer in &GPU_LAYERS {
                        values.extend(metric_values(gpu.and_then(layer.pick)));
                    }
                    values.push(gpu.and_then(|g| g.num_ooms).into());
                }
                values.push(row.limit.into());
                values
            })
            .collect();
        Columns { columns, rows }
    }
}

/// The first and the last traced of `reports`, for `sites()`: why the last peaked higher (or
/// lower) than the first. Fewer than two traced is refused, saying how to trace them.
pub fn traced_ends(reports: &[Arc<Report>]) -> Result<(&Report, &Report), String> {
    let traced: Vec<&Report> = reports.iter().map(|r| r.as_ref()).filter(|r| !r.trace.is_empty()).collect();
    match traced[..] {
        [first, .., last] => Ok((first, last)),
        _ => Err(format!(
            "sites() compares two traced experiments and {} of these {} were traced: open them with \
             GPUExperiment(..., trace=True)",
            traced.len(),
            reports.len()
        )),
    }
}

#[cfg(test)]
pub(crate) mod tests;
