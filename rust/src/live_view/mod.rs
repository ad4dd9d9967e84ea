//! The live view of a running cell: for each GPU in use, torch allocated, torch reserved and
//! NVML's figure for this process against the device's total (or the experiment's `limit`),
//! each with its peak so far; and host RSS. Drawn as HTML bars in Jupyter (the theme's
//! colours), as one line in a terminal; [`schedule`] says when.

pub mod schedule;

use crate::grid::{escape, Grid};
use crate::report::{CellMetric, CellRecord};
use crate::snapshot::Snapshot;
use crate::units::bytes;

/// One figure: where it is, how high it went during the cell, and what it is measured against.
#[derive(Clone, Debug, PartialEq)]
pub struct Bar {
    pub label: String,
    /// The label in the one-line view, where room is short.
    pub short: String,
    pub now: u64,
    pub peak: u64,
    /// The whole the figure fills, and what that whole is ("total", "limit", "RAM").
    pub of: Option<(u64, &'static str)>,
}

impl Bar {
    fn share(&self, value: u64) -> Option<f64> {
        self.of.filter(|(whole, _)| *whole > 0).map(|(whole, _)| (value as f64 / whole as f64).min(1.0) * 100.0)
    }

    fn of_text(&self) -> String {
        self.of.map(|(whole, what)| format!("{} {what}", bytes(whole))).unwrap_or_else(|| "—".into())
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct LiveView {
    pub elapsed_s: f64,
    /// One line per GPU shown: which device it is.
    pub devices: Vec<String>,
    pub bars: Vec<Bar>,
}

impl LiveView {
    /// The view of a running cell from `record` (its figures from its start to `now`, with the
    /// cell's peaks). GPUs shown are those in use (torch or NVML holds memory of this process
    /// there) or that the cell touched, or all with `all_gpus`. Torch's figures are measured
    /// against `limit_on(torch index)` where an experiment set one, else the device's total.
    pub fn build(
        record: &CellRecord,
        now: &Snapshot,
        limit_on: impl Fn(u32) -> Option<u64>,
        all_gpus: bool,
    ) -> LiveView {
        let mut devices = Vec::new();
        let mut bars = Vec::new();
        for gpu in &record.gpus {
            let Some(reading) = now.gpu(&gpu.uuid) else { continue };
            let in_use = reading.torch.is_some_and(|t| t.reserved > 0) || reading.process_used.is_some_and(|p| p > 0);
            if !(all_gpus || in_use || gpu.touched()) {
                continue;
            }
            let device = format!("cuda:{}", gpu.torch_index);
            let limit = limit_on(gpu.torch_index);
            let torch_whole = limit.map(|l| (l, "limit")).unwrap_or((reading.total, "total"));
            devices.push(match limit {
                Some(l) => format!("{device} · {} · {} total · limit {}", reading.name, bytes(reading.total), bytes(l)),
                None => format!("{device} · {} · {} total", reading.name, bytes(reading.total)),
            });
            let figures = [
                ("torch allocated", "allocated", &gpu.torch_allocated, torch_whole),
                ("torch reserved", "reserved", &gpu.torch_reserved, torch_whole),
                ("NVML process", "NVML", &gpu.process_used, (reading.total, "total")),
            ];
            for (what, short, metric, whole) in figures {
                if let Some(m) = metric {
                    bars.push(bar(format!("{device} {what}"), format!("{device} {short}"), m, Some(whole)));
                }
            }
        }
        let ram = now.host.cgroup_limit.map(|l| (l, "limit")).unwrap_or((now.host.total, "RAM"));
        bars.push(bar("host RSS".into(), "host RSS".into(), &record.host, Some(ram).filter(|(w, _)| *w > 0)));
        LiveView { elapsed_s: record.wall_s, devices, bars }
    }

    fn title(&self) -> String {
        format!("gpuexp · cell running · {:.1} s", self.elapsed_s)
    }

    /// The same figures as a text table, for frontends without HTML.
    pub fn grid(&self) -> Grid {
        Grid {
            title: self.title(),
            lines: self.devices.clone(),
            header: ["memory", "now", "peak so far", "of"].map(String::from).to_vec(),
            rows: self.bars.iter().map(|b| vec![b.label.clone(), bytes(b.now), bytes(b.peak), b.of_text()]).collect(),
            notes: Vec::new(),
            compact: true,
        }
    }

    /// A table with a bar per figure: the part filled is where it is now, the mark its peak.
    /// Colours are JupyterLab's theme variables, so the view reads in any theme.
    pub fn to_html(&self) -> String {
        let mut out = String::from("<div class=\"gpuexp gpuexp-live\" style=\"font-size:smaller\">");
        out.push_str(&format!("<b>{}</b><br>", escape(&self.title())));
        for line in &self.devices {
            out.push_str(&format!("<span>{}</span><br>", escape(line)));
        }
        out.push_str("<table><thead><tr>");
        for (head, align) in
            [("memory", "left"), ("", "left"), ("now", "right"), ("peak so far", "right"), ("of", "right")]
        {
            out.push_str(&format!("<th style=\"text-align:{align}\">{head}</th>"));
        }
        out.push_str("</tr></thead><tbody>");
        for b in &self.bars {
            out.push_str(&format!(
                "<tr><td style=\"text-align:left\">{}</td><td style=\"text-align:left\">{}</td>\
                 <td style=\"text-align:right\">{}</td><td style=\"text-align:right\">{}</td>\
                 <td style=\"text-align:right\">{}</td></tr>",
                escape(&b.label),
                bar_html(b),
                bytes(b.now),
                bytes(b.peak),
                escape(&b.of_text())
            ));
        }
        out.push_str("</tbody></table></div>");
        out
    }

    /// One line for a terminal, cut to `width` characters.
    pub fn to_line(&self, width: usize) -> String {
        let mut parts = vec![format!("gpuexp · {:.1} s", self.elapsed_s)];
        for b in &self.bars {
            let of = b.of.map(|(whole, _)| format!(" of {}", bytes(whole))).unwrap_or_default();
            parts.push(format!("{} {}{of} (peak {})", b.short, bytes(b.now), bytes(b.peak)));
        }
        let line = parts.join(" · ");
        if line.chars().count() <= width {
            return line;
        }
        let mut cut: String = line.chars().take(width.saturating_sub(1)).collect();
        cut.push('…');
        cut
    }
}

fn bar(label: String, short: String, m: &CellMetric, of: Option<(u64, &'static str)>) -> Bar {
    Bar { label, short, now: m.end, peak: m.peak, of }
}

fn bar_html(b: &Bar) -> String {
    let (Some(now), Some(peak)) = (b.share(b.now), b.share(b.peak)) else { return String::new() };
    let title = format!("{} now, peak {} so far, of {}", bytes(b.now), bytes(b.peak), b.of_text());
    format!(
        "<div title=\"{}\" style=\"position:relative;width:10em;height:0.8em;border-radius:2px;\
         background:var(--jp-layout-color3)\"><div style=\"width:{now:.1}%;height:100%;border-radius:2px;\
         background:var(--jp-brand-color1)\"></div><div style=\"position:absolute;top:0;left:calc({peak:.1}% - 2px);\
         width:2px;height:100%;background:var(--jp-warn-color0)\"></div></div>",
        escape(&title)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grid::testing::{expected_cells, html_cells};
    use crate::snapshot::testing::{gpu, host, torch, GIB};
    use crate::snapshot::GpuReading;

    fn with_torch(reading: GpuReading, allocated: u64, reserved: u64) -> GpuReading {
        GpuReading { torch: Some(torch(allocated, reserved, allocated, reserved)), ..reading }
    }

    /// Three seconds into a cell: cuda:0 went from 1 to 3 GiB allocated (peak 5 GiB); cuda:1
    /// holds nothing of this process.
    fn view(limit: Option<u64>, all_gpus: bool) -> (LiveView, Snapshot) {
        let idle = || GpuReading { process_used: Some(0), ..gpu(1, "GPU-bbbb") };
        let start = host(10.0, GIB, GIB).with_gpu(with_torch(gpu(0, "GPU-aaaa"), GIB, 2 * GIB)).with_gpu(idle());
        let busy = GpuReading { process_used: Some(4 * GIB), ..with_torch(gpu(0, "GPU-aaaa"), 3 * GIB, 4 * GIB) };
        let now = host(13.0, 2 * GIB, 2 * GIB).with_gpu(busy).with_gpu(idle());
        let peak = |g: &crate::snapshot::Gauge| {
            matches!(g, crate::snapshot::Gauge::TorchAllocated(u) if u == "GPU-aaaa").then_some(5 * GIB)
        };
        let record = CellRecord::build(0, &start, &now, peak, Vec::new());
        (LiveView::build(&record, &now, |i| limit.filter(|_| i == 0), all_gpus), now)
    }

    #[test]
    fn each_gpu_in_use_has_torch_and_nvml_bars_against_its_total_and_host_rss_comes_last() {
        let (live, _) = view(None, false);
        let labels: Vec<&str> = live.bars.iter().map(|b| b.label.as_str()).collect();
        assert_eq!(labels, ["cuda:0 torch allocated", "cuda:0 torch reserved", "cuda:0 NVML process", "host RSS"]);
        let allocated = &live.bars[0];
        assert_eq!((allocated.now, allocated.peak, allocated.of), (3 * GIB, 5 * GIB, Some((80 * GIB, "total"))));
        assert_eq!(live.bars[3].of, Some((128 * GIB, "RAM")));
        assert_eq!(live.devices, ["cuda:0 · NVIDIA H100 80GB HBM3 · 80.00 GiB total"]);
        assert_eq!(live.elapsed_s, 3.0);
        assert_eq!(view(None, true).0.bars[3].label, "cuda:1 NVML process", "every GPU when all are asked for");
    }

    #[test]
    fn torch_figures_are_measured_against_the_limit_where_one_is_set() {
        let (live, _) = view(Some(24 * GIB), false);
        assert_eq!(live.bars[0].of, Some((24 * GIB, "limit")));
        assert_eq!(live.bars[1].of, Some((24 * GIB, "limit")));
        assert_eq!(live.bars[2].of, Some((80 * GIB, "total")), "NVML counts more than torch: the device is its whole");
        assert!(live.devices[0].ends_with("limit 24.00 GiB"), "{:?}", live.devices);
    }

    #[test]
    fn the_html_has_a_bar_per_figure_in_theme_colours_and_the_text_the_same_figures() {
        let (live, _) = view(None, false);
        let html = live.to_html();
        assert_eq!(html.matches("var(--jp-brand-color1)").count(), live.bars.len());
        assert!(!html.contains('#') && !html.contains("rgb"), "no hard-coded colour: {html}");
        // 3 GiB of 80 GiB is 3.75% filled; the 5 GiB peak is marked at 6.25%.
        assert!(html.contains("width:3.8%") && html.contains("left:calc(6.2% - 2px)"), "{html}");
        let cells: Vec<Vec<String>> = html_cells(&html)
            .into_iter()
            .map(|row| row.into_iter().enumerate().filter(|(i, _)| *i != 1).map(|(_, c)| c).collect())
            .collect();
        assert_eq!(cells, expected_cells(&live.grid()), "the HTML shows the text table's figures");
        assert!(live.grid().to_text().contains("cuda:0 torch allocated  3.00 GiB"), "{}", live.grid().to_text());
    }

    #[test]
    fn the_line_fits_the_terminal() {
        let (live, _) = view(None, false);
        let line = live.to_line(400);
        assert!(line.starts_with("gpuexp · 3.0 s · cuda:0 allocated 3.00 GiB of 80.00 GiB (peak 5.00 GiB)"), "{line}");
        assert!(line.ends_with("host RSS 2.00 GiB of 128.00 GiB (peak 2.00 GiB)"), "{line}");
        let short = live.to_line(40);
        assert_eq!(short.chars().count(), 40);
        assert!(short.ends_with('…'));
    }
}
