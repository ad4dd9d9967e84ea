//! `memory_allocated` over the trace, stacked by the sites largest at the peak, downsampled to at
//! most `MAX_POINTS` points (each the highest moment of its stretch, so no peak is lost), as
//! data for a matplotlib Figure and as an inline SVG that fetches nothing and takes its colours
//! from the notebook's theme.

use std::collections::HashMap;

use serde::Serialize;

use super::block::Block;
use super::parse::StackId;
use super::replay::{Peak, Replay};
use super::sites::{Attribution, SiteKey};
use crate::error::Result;
use crate::grid::escape;
use crate::units::bytes;

pub const MAX_POINTS: usize = 600;

/// One site's bytes at each point; the last series is every other site.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TimelineSeries {
    pub label: String,
    pub y: Vec<u64>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Timeline {
    pub device: usize,
    /// Seconds since the first event, or the event's index when the trace has no times.
    pub x: Vec<f64>,
    pub x_label: String,
    /// The event each point shows.
    pub event: Vec<usize>,
    /// `memory_allocated` at each point: the series stacked.
    pub total: Vec<u64>,
    /// Stacked bottom to top, largest at the peak first.
    pub series: Vec<TimelineSeries>,
    pub peak: Peak,
    /// The point that is the peak.
    pub peak_point: Option<usize>,
}

/// Which events to show: each stretch's highest, and the peak itself.
fn sample(allocated: &[u64], peak: Option<usize>) -> Vec<usize> {
    let n = allocated.len();
    if n <= MAX_POINTS {
        return (0..n).collect();
    }
    let stretch = n.div_ceil(MAX_POINTS - 1);
    let mut points: Vec<usize> = (0..n)
        .step_by(stretch)
        .map(|start| {
            (start..(start + stretch).min(n))
                .max_by_key(|&i| (allocated[i], std::cmp::Reverse(i)))
                .expect("a stretch is not empty")
        })
        .collect();
    points.extend(peak);
    points.sort_unstable();
    points.dedup();
    points
}

/// Site keys by what `Attribution::key` reads of a block: its stack and, for one allocated in
/// the trace, that event's context. A trace has millions of blocks and a few thousand stacks,
/// and a key costs a walk of the stack's frames with substring tests.
#[derive(Default)]
struct KeyCache(HashMap<(StackId, Option<StackId>), SiteKey>);

impl KeyCache {
    fn key(&mut self, attribution: &Attribution, replay: &Replay, block: &Block) -> SiteKey {
        let context = block.alloc_event.map(|event| replay.context[event]);
        *self.0.entry((block.stack, context)).or_insert_with(|| attribution.key(replay, block))
    }
}

/// The timeline of `replay`, stacked by its `top` largest sites at the peak.
pub fn timeline(replay: &Replay, attribution: &Attribution, top: usize) -> Timeline {
    super::unstoppable(|keep_going| timeline_checked(replay, attribution, top, keep_going))
}

/// `timeline`, asking `keep_going` every so many blocks and events whether to go on.
pub(super) fn timeline_checked(
    replay: &Replay,
    attribution: &Attribution,
    top: usize,
    keep_going: &mut dyn FnMut() -> Result<()>,
) -> Result<Timeline> {
    let live = replay.live_at_peak();
    let mut keys = KeyCache::default();
    let mut at_peak: HashMap<SiteKey, u64> = HashMap::new();
    for block in &live {
        *at_peak.entry(keys.key(attribution, replay, block)).or_default() += block.bytes;
    }
    let mut ranked: Vec<(SiteKey, u64)> = at_peak.into_iter().collect();
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    ranked.truncate(top);
    let series_of: HashMap<SiteKey, usize> = ranked.iter().enumerate().map(|(i, (key, _))| (*key, i)).collect();
    let other = ranked.len();
    // Per event, what each block adds or takes away, by series: one flat list ordered by
    // event (`first[e]..first[e + 1]` are event e's), not a vector per event, which for a
    // trace of millions of events cost more in allocations than the rest of the timeline.
    let events = replay.allocated.len();
    let mut starts = vec![0u64; other + 1];
    let mut stacks_of = vec![None; other];
    let mut block_series = Vec::with_capacity(replay.blocks.len());
    let mut first = vec![0u32; events + 1];
    for (n, block) in replay.blocks.iter().enumerate() {
        super::ask_every(n, keep_going)?;
        let key = keys.key(attribution, replay, block);
        let series = series_of.get(&key).copied().unwrap_or(other);
        if series < other && stacks_of[series].is_none() {
            stacks_of[series] = Some((key, block.stack));
        }
        match block.alloc_event {
            Some(event) => first[event + 1] += 1,
            None => starts[series] += block.bytes,
        }
        if let Some(event) = block.free_event {
            first[event + 1] += 1;
        }
        block_series.push(series as u32);
    }
    for event in 0..events {
        first[event + 1] += first[event];
    }
    let mut filled = first.clone();
    let mut changes = vec![(0u32, 0i64); first[events] as usize];
    for (block, &series) in replay.blocks.iter().zip(&block_series) {
        let moves = [(block.alloc_event, block.bytes as i64), (block.free_event, -(block.bytes as i64))];
        for (event, delta) in moves.into_iter().filter_map(|(event, delta)| Some((event?, delta))) {
            changes[filled[event] as usize] = (series, delta);
            filled[event] += 1;
        }
    }
    let points = sample(&replay.allocated, replay.peak.event);
    let mut values: Vec<Vec<u64>> = vec![Vec::with_capacity(points.len()); other + 1];
    let mut now: Vec<i64> = starts.iter().map(|&b| b as i64).collect();
    let mut next = points.iter().peekable();
    for event in 0..events {
        super::ask_every(event, keep_going)?;
        for &(series, delta) in &changes[first[event] as usize..first[event + 1] as usize] {
            now[series as usize] += delta;
        }
        if next.peek() == Some(&&event) {
            next.next();
            for (series, value) in now.iter().enumerate() {
                values[series].push((*value).max(0) as u64);
            }
        }
    }
    let first_time = replay.time_us.first().copied().unwrap_or(0);
    let timed = replay.time_us.iter().any(|&t| t != first_time);
    let x = points
        .iter()
        .map(|&event| if timed { (replay.time_us[event] - first_time) as f64 / 1e6 } else { event as f64 })
        .collect();
    let mut series: Vec<TimelineSeries> = stacks_of
        .into_iter()
        .zip(values.iter())
        .map(|(key_stack, y)| {
            let (key, _) = key_stack.expect("every ranked site has a block");
            TimelineSeries { label: attribution.label(replay, key).0, y: y.clone() }
        })
        .collect();
    series.push(TimelineSeries { label: "other sites".into(), y: values[other].clone() });
    Ok(Timeline {
        device: replay.device,
        x,
        x_label: if timed { "seconds" } else { "event" }.into(),
        total: points.iter().map(|&event| replay.allocated[event]).collect(),
        peak_point: replay.peak.event.and_then(|peak| points.iter().position(|&e| e == peak)),
        event: points,
        series,
        peak: replay.peak,
    })
}

/// Distinct theme colours: Jupyter's variables, with fallbacks that read on light and dark.
const COLOURS: [&str; 11] = [
    "var(--jp-brand-color1, #1f77b4)",
    "var(--jp-warn-color1, #ff7f0e)",
    "var(--jp-success-color1, #2ca02c)",
    "var(--jp-error-color1, #d62728)",
    "var(--jp-info-color1, #17becf)",
    "var(--jp-accent-color1, #9467bd)",
    "var(--jp-brand-color3, #aec7e8)",
    "var(--jp-warn-color3, #ffbb78)",
    "var(--jp-success-color3, #98df8a)",
    "var(--jp-error-color3, #ff9896)",
    "var(--jp-info-color3, #9edae5)",
];
const OTHER_COLOUR: &str = "var(--jp-layout-color4, #999)";

impl Timeline {
    /// An inline SVG: stacked areas, the peak marked, a legend; no script, nothing fetched.
    pub fn to_svg(&self) -> String {
        let (width, height, left, right, top, bottom) = (720.0, 260.0, 70.0, 10.0, 10.0, 30.0);
        let plot_w = width - left - right;
        let plot_h = height - top - bottom;
        let x_max = self.x.last().copied().unwrap_or(1.0).max(f64::MIN_POSITIVE);
        let x_min = self.x.first().copied().unwrap_or(0.0);
        let span = (x_max - x_min).max(f64::MIN_POSITIVE);
        let y_max = self.total.iter().copied().max().unwrap_or(0).max(1) as f64;
        let px = |x: f64| left + (x - x_min) / span * plot_w;
        let py = |y: f64| top + plot_h - y / y_max * plot_h;
        let legend_h = 16.0 * self.series.len() as f64;
        let mut out = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"gpuexp\" width=\"{width}\" height=\"{}\" \
             style=\"font:11px sans-serif;color:var(--jp-ui-font-color1, currentColor)\">",
            height + legend_h
        );
        let mut below = vec![0u64; self.x.len()];
        for (index, series) in self.series.iter().enumerate() {
            let colour = if index + 1 == self.series.len() { OTHER_COLOUR } else { COLOURS[index % COLOURS.len()] };
            let above: Vec<u64> = below.iter().zip(&series.y).map(|(b, y)| b + y).collect();
            let upper = self.x.iter().zip(&above).map(|(&x, &y)| format!("{:.1},{:.1}", px(x), py(y as f64)));
            let lower = self.x.iter().zip(&below).rev().map(|(&x, &y)| format!("{:.1},{:.1}", px(x), py(y as f64)));
            let points: Vec<String> = upper.chain(lower).collect();
            out.push_str(&format!(
                "<polygon points=\"{}\" fill=\"{colour}\" fill-opacity=\"0.85\" stroke=\"none\"><title>{}</title></polygon>",
                points.join(" "),
                escape(&series.label)
            ));
            let y = height + 16.0 * index as f64;
            out.push_str(&format!(
                "<rect x=\"{left}\" y=\"{:.1}\" width=\"10\" height=\"10\" fill=\"{colour}\"/>\
                 <text x=\"{:.1}\" y=\"{:.1}\" fill=\"currentColor\">{}</text>",
                y - 9.0,
                left + 14.0,
                y,
                escape(&series.label)
            ));
            below = above;
        }
        out.push_str(&format!(
            "<line x1=\"{left}\" y1=\"{0:.1}\" x2=\"{1:.1}\" y2=\"{0:.1}\" stroke=\"currentColor\"/>\
             <line x1=\"{left}\" y1=\"{top}\" x2=\"{left}\" y2=\"{0:.1}\" stroke=\"currentColor\"/>\
             <text x=\"{2:.1}\" y=\"{3:.1}\" text-anchor=\"end\" fill=\"currentColor\">{4}</text>\
             <text x=\"{2:.1}\" y=\"{0:.1}\" text-anchor=\"end\" fill=\"currentColor\">0</text>\
             <text x=\"{1:.1}\" y=\"{5:.1}\" text-anchor=\"end\" fill=\"currentColor\">{6}</text>",
            top + plot_h,
            left + plot_w,
            left - 4.0,
            top + 10.0,
            escape(&bytes(y_max as u64)),
            top + plot_h + 14.0,
            escape(&format!("{:.3} {}", x_max, self.x_label)),
        ));
        if let Some(point) = self.peak_point {
            let x = px(self.x[point]);
            out.push_str(&format!(
                "<line class=\"peak\" x1=\"{x:.1}\" y1=\"{top}\" x2=\"{x:.1}\" y2=\"{:.1}\" stroke=\"var(--jp-warn-color0, #e65100)\" \
                 stroke-dasharray=\"4 2\"/><text x=\"{:.1}\" y=\"{:.1}\" fill=\"var(--jp-warn-color0, #e65100)\">peak {}</text>",
                top + plot_h,
                x + 3.0,
                top + 10.0,
                escape(&bytes(self.peak.bytes))
            ));
        }
        out.push_str("</svg>");
        out
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("plain data serializes")
    }
}
