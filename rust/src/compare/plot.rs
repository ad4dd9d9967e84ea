//! The peaks of compared experiments against one numeric param, the levels they must stay under
//! (each device's total, the `limit`), and a line fitted through the layer that meets that level
//! first, extrapolated to the largest value of the param that fits.

use serde::Serialize;

use super::{Comparison, Row, GPU_LAYERS};
use crate::units::bytes;

/// One layer's peak at each value of the param, in order of the param.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Series {
    pub label: String,
    pub x: Vec<f64>,
    pub y: Vec<u64>,
}

/// A level drawn across the plot: a device's total, a limit.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Level {
    pub label: String,
    pub y: u64,
}

/// A least-squares line `peak = intercept + slope × x` through one layer's peaks.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Fit {
    pub layer: String,
    pub intercept: f64,
    pub slope: f64,
    /// The level the layer must stay under.
    pub budget: u64,
    /// The largest value of the param whose fitted peak stays under the budget (whole when the
    /// param's values are); None when the peak does not grow with it.
    pub largest: Option<f64>,
    pub label: String,
    /// Where the line is drawn: from the smallest value measured to the largest that fits
    /// (at most four times the largest measured).
    pub x: [f64; 2],
    pub y: [f64; 2],
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plot {
    pub x: String,
    pub title: String,
    pub series: Vec<Series>,
    pub levels: Vec<Level>,
    pub fit: Option<Fit>,
    pub notes: Vec<String>,
}

impl Comparison {
    /// The plot of every layer's peak against param `x`, or against the one numeric param that
    /// varies when `x` is None.
    pub fn plot(&self, x: Option<&str>) -> Result<Plot, String> {
        let x = self.x_param(x)?;
        let mut notes = Vec::new();
        let mut points: Vec<(f64, &Row)> = Vec::new();
        for row in &self.rows {
            match row.params.get(&x).and_then(|p| p.number()) {
                Some(value) => points.push((value, row)),
                None => notes.push(format!("{} is left out: it has no number for {x}", row.name)),
            }
        }
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        let series_of = |label: String, pick: &dyn Fn(&Row) -> Option<u64>| -> Option<Series> {
            let (xs, ys): (Vec<f64>, Vec<u64>) = points.iter().filter_map(|(v, row)| Some((*v, pick(row)?))).unzip();
            (!xs.is_empty()).then_some(Series { label, x: xs, y: ys })
        };
        let mut series: Vec<Series> =
            series_of("host RSS".into(), &|row| Some(row.host.rss.peak)).into_iter().collect();
        let gpus: std::collections::BTreeSet<u32> =
            points.iter().flat_map(|(_, row)| row.gpus.iter().map(|g| g.torch_index)).collect();
        for index in &gpus {
            for layer in &GPU_LAYERS[..3] {
                let label = format!("cuda:{index} {}", layer.plotted);
                series.extend(series_of(label, &|row| row.gpu(*index).and_then(layer.pick).map(|m| m.peak)));
            }
        }
        let levels = levels(&points, &gpus);
        let fit = fit(&points, &gpus, &series, &x);
        if let Some(Fit { largest: Some(largest), x: [_, drawn_to], .. }) = &fit {
            if largest > drawn_to {
                notes.push(format!("the fit is drawn to {x} = {drawn_to}; it reaches the budget at {x} = {largest}"));
            }
        }
        Ok(Plot { title: format!("gpuexp · peaks against {x}"), x, series, levels, fit, notes })
    }

    /// The param to plot against: `wanted` if some experiment gives a number for it, else the
    /// only numeric param that varies.
    fn x_param(&self, wanted: Option<&str>) -> Result<String, String> {
        let keys = self.param_keys();
        let values = |key: &str| -> Vec<f64> {
            self.rows.iter().filter_map(|r| r.params.get(key).and_then(|p| p.number())).collect()
        };
        let numeric: Vec<&String> = keys.iter().filter(|k| !values(k).is_empty()).collect();
        if let Some(wanted) = wanted {
            return match numeric.iter().find(|k| k.as_str() == wanted) {
                Some(key) => Ok(key.to_string()),
                None => Err(format!(
                    "plot(x={wanted:?}): no experiment has a number for {wanted:?}; the numeric params are {numeric:?}"
                )),
            };
        }
        let varying: Vec<&String> = numeric
            .into_iter()
            .filter(|k| {
                let v = values(k);
                v.iter().any(|x| *x != v[0])
            })
            .collect();
        match varying.as_slice() {
            [one] => Ok(one.to_string()),
            [] => Err("no numeric param varies across these experiments: name them like \"bs=64\", or give \
                       GPUExperiment(..., params={\"bs\": 64}), then plot again"
                .into()),
            several => Err(format!(
                "several params vary ({}): pick the one to plot against, e.g. plot(x={:?})",
                several.iter().map(|k| k.as_str()).collect::<Vec<_>>().join(", "),
                several[0]
            )),
        }
    }
}

/// Each device's total (once per size), each limit, or without GPUs the host's memory.
fn levels(points: &[(f64, &Row)], gpus: &std::collections::BTreeSet<u32>) -> Vec<Level> {
    let mut levels: Vec<Level> = Vec::new();
    let mut add = |label: String, y: u64| {
        if y > 0 && !levels.iter().any(|l| l.y == y) {
            levels.push(Level { label, y });
        }
    };
    for index in gpus {
        if let Some(gpu) = points.iter().find_map(|(_, row)| row.gpu(*index)) {
            let label = if gpus.len() == 1 { "device total".to_string() } else { format!("cuda:{index} total") };
            add(format!("{label} ({})", bytes(gpu.total)), gpu.total);
        }
    }
    for limit in points.iter().filter_map(|(_, row)| row.limit) {
        add(format!("limit ({})", bytes(limit)), limit);
    }
    if gpus.is_empty() {
        if let Some((_, row)) = points.first() {
            let ram = row.host.cgroup_limit.unwrap_or(row.host.total);
            add(format!("host memory ({})", bytes(ram)), ram);
        }
    }
    levels
}

/// The line through the layer that meets a level first: torch reserved against a limit (the
/// limit caps torch's allocator), else NVML's process figure against the device's total (it
/// counts all the process holds there), else host RSS against the host's memory.
fn fit(points: &[(f64, &Row)], gpus: &std::collections::BTreeSet<u32>, series: &[Series], x: &str) -> Option<Fit> {
    let find = |label: &str| series.iter().find(|s| s.label == label && distinct(&s.x) >= 2);
    let first = gpus.iter().next();
    let limit = points.iter().filter_map(|(_, row)| row.limit).min();
    let (layer, budget, whole) = match (first, limit) {
        (Some(index), Some(limit)) => (find(&format!("cuda:{index} torch reserved"))?, limit, "limit"),
        (Some(index), None) => {
            let total = points.iter().find_map(|(_, row)| row.gpu(*index))?.total;
            let layer =
                find(&format!("cuda:{index} NVML process")).or_else(|| find(&format!("cuda:{index} torch reserved")));
            (layer?, total, "total")
        }
        (None, _) => {
            let host = &points.first()?.1.host;
            (find("host RSS")?, host.cgroup_limit.unwrap_or(host.total), "host memory")
        }
    };
    let (intercept, slope) = least_squares(&layer.x, &layer.y)?;
    let whole_numbers = layer.x.iter().all(|v| v.fract() == 0.0);
    let largest = (slope > 0.0).then(|| {
        let at = (budget as f64 - intercept) / slope;
        if whole_numbers {
            at.floor()
        } else {
            at
        }
    });
    let (low, high) = (layer.x[0], layer.x[layer.x.len() - 1]);
    let drawn_to = largest.map_or(high, |l| l.clamp(high, high * 4.0));
    let label = match largest {
        Some(l) => format!("fit of {}: fits up to {x} = {l} ({} {whole})", layer.label, bytes(budget)),
        None => format!("fit of {}: does not grow with {x}", layer.label),
    };
    Some(Fit {
        layer: layer.label.clone(),
        intercept,
        slope,
        budget,
        largest,
        label,
        x: [low, drawn_to],
        y: [intercept + slope * low, intercept + slope * drawn_to],
    })
}

fn distinct(xs: &[f64]) -> usize {
    let mut seen: Vec<f64> = Vec::new();
    for x in xs {
        if !seen.contains(x) {
            seen.push(*x);
        }
    }
    seen.len()
}

/// (intercept, slope) of the least-squares line through the points; None without two distinct x.
fn least_squares(xs: &[f64], ys: &[u64]) -> Option<(f64, f64)> {
    let n = xs.len() as f64;
    let mean_x = xs.iter().sum::<f64>() / n;
    let mean_y = ys.iter().map(|y| *y as f64).sum::<f64>() / n;
    let spread: f64 = xs.iter().map(|x| (x - mean_x).powi(2)).sum();
    if spread == 0.0 {
        return None;
    }
    let slope = xs.iter().zip(ys).map(|(x, y)| (x - mean_x) * (*y as f64 - mean_y)).sum::<f64>() / spread;
    Some((mean_y - slope * mean_x, slope))
}
