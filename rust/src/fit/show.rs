//! `fit`'s answer as tables (text and HTML from the same cells) and the code of each option.

use super::{FitReport, Ranked};
use crate::estimate::Category;
use crate::grid::{escape, prefixed, Grid};
use crate::units::bytes;

/// Several tables, then the code that applies each option.
pub struct View {
    pub grids: Vec<Grid>,
    /// (the option's rank and title, its code).
    pub code: Vec<(String, String)>,
}

impl View {
    pub fn to_text(&self) -> String {
        let mut parts: Vec<String> = self.grids.iter().map(Grid::to_text).collect();
        if !self.code.is_empty() {
            let mut apply = String::from("how to apply each:");
            for (title, code) in &self.code {
                apply.push_str(&format!("\n{title}\n"));
                for line in code.lines() {
                    // A blank line stays blank: no trailing spaces for a pasted block to carry.
                    let indent = if line.is_empty() { "" } else { "    " };
                    apply.push_str(&format!("{indent}{line}\n"));
                }
            }
            parts.push(apply.trim_end().to_string());
        }
        parts.join("\n\n")
    }

    pub fn to_html(&self) -> String {
        let mut out: String = self.grids.iter().map(Grid::to_html).collect();
        if !self.code.is_empty() {
            out.push_str("<div class=\"gpuexp\"><b>how to apply each</b>");
            for (title, code) in &self.code {
                out.push_str(&format!("<br><span>{}</span><pre>{}</pre>", escape(title), escape(code)));
            }
            out.push_str("</div>");
        }
        out
    }
}

fn percent(part: f64, whole: f64) -> String {
    if whole == 0.0 {
        "—".into()
    } else {
        format!("{:.1}%", 100.0 * part / whole)
    }
}

fn option_cell(option: Option<u64>) -> String {
    option.map(bytes).unwrap_or_else(|| "—".into())
}

impl FitReport {
    /// The verdict line: the peak against the budget.
    pub fn verdict(&self) -> String {
        let gpu = self.device != "cpu";
        let (held, figure) = if gpu { ("allocated", "torch allocated") } else { ("in RSS", "host RSS") };
        let peak = format!("predicted peak: +{} {figure} above the {} {held} now", bytes(self.peak), bytes(self.now));
        match (&self.budget, self.short) {
            (Some(budget), Some(0)) => format!(
                "{peak}; it fits the budget of {} ({}), {} to spare",
                bytes(budget.bytes),
                budget.against,
                bytes(budget.bytes - self.peak)
            ),
            (Some(budget), Some(short)) => {
                format!("{peak}; the budget is {} ({}): {} short", bytes(budget.bytes), budget.against, bytes(short))
            }
            _ => format!("{peak}; no budget is known (NVML can't be read): pass limit=\"24GiB\""),
        }
    }

    pub fn view(&self) -> View {
        let mut grids = vec![self.why_grid()];
        if !self.blocks.is_empty() {
            grids.push(self.blocks_grid());
        }
        grids.push(self.options_grid());
        if let Some(verified) = &self.verified {
            grids.push(verified_grid(verified));
        }
        let code = self
            .options
            .iter()
            .enumerate()
            .filter(|(_, o)| o.refused.is_none())
            .map(|(i, o)| (format!("{}. {}:", i + 1, o.title), o.code.clone()))
            .collect();
        View { grids, code }
    }

    fn why_grid(&self) -> Grid {
        let rows = Category::ALL
            .iter()
            .filter(|c| self.categories.get(**c) > 0)
            .map(|c| {
                vec![
                    c.label().to_string(),
                    bytes(self.categories.get(*c)),
                    percent(self.categories.get(*c) as f64, self.categories.total() as f64),
                ]
            })
            .collect();
        Grid {
            title: format!("gpuexp · fit · step({}) on {}", self.batch_size, self.device),
            lines: vec![
                self.verdict(),
                format!(
                    "{} estimates under fake tensors in {:.2} s; nothing was allocated on the device",
                    self.estimates, self.seconds
                ),
            ],
            header: ["at the peak", "size", "share"].map(String::from).to_vec(),
            rows,
            notes: Vec::new(),
            compact: false,
        }
    }

    fn blocks_grid(&self) -> Grid {
        let rows = self
            .blocks
            .iter()
            .map(|b| {
                vec![
                    format!("{} ({})", b.path, b.class),
                    bytes(b.saved),
                    bytes(b.parameters),
                    percent(b.forward_flops, self.step_flops),
                ]
            })
            .collect();
        Grid {
            title: "saved for backward, by module: what each keeps alive from its forward to its backward".into(),
            lines: Vec::new(),
            header: ["module", "saved", "parameters", "forward FLOPs of the step"].map(String::from).to_vec(),
            rows,
            notes: Vec::new(),
            compact: false,
        }
    }

    fn options_grid(&self) -> Grid {
        let rows = self.options.iter().enumerate().map(|(i, o)| option_row(i, o)).collect();
        let mut notes = Vec::new();
        for option in self.options.iter().filter(|o| o.refused.is_some()) {
            notes.push(format!(
                "{}: no estimate: {}",
                option.option.label(),
                option.refused.clone().unwrap_or_default()
            ));
        }
        if self.options.iter().any(|o| o.option == super::Choice::Autocast && o.peak.is_some()) {
            notes.push(
                "autocast: bfloat16 keeps float32's range with 8 bits of mantissa (about 3 significant digits); \
                 weights, gradients and optimizer state stay float32 and no loss scaling is needed; compare a few \
                 steps' loss with float32's"
                    .into(),
            );
        }
        if self.options.iter().any(|o| o.option == super::Choice::Accumulate && o.peak.is_some()) {
            notes.push(format!(
                "accumulation: the same effective batch of {}; the gradients stay between micro-batches, and are in its peak",
                self.batch_size
            ));
        }
        // Said once: where the smaller batch is an option, its row gives it.
        if let Some(batch) =
            self.largest_batch.filter(|_| !self.options.iter().any(|o| o.option == super::Choice::SmallerBatch))
        {
            notes.push(format!("the largest batch that fits as the step is: about {batch}"));
        }
        notes.extend(prefixed("hint", &self.hints));
        notes.extend(prefixed("note", &self.notes));
        Grid {
            title: "what would make it fit, ranked by what each saves".into(),
            lines: Vec::new(),
            header: ["#", "option", "peak", "saves", "fits", "cost"].map(String::from).to_vec(),
            rows,
            notes,
            compact: false,
        }
    }
}

fn option_row(index: usize, option: &Ranked) -> Vec<String> {
    let fits = match option.fits {
        Some(true) => "yes",
        Some(false) => "no",
        None => "—",
    };
    let cost = if option.refused.is_some() { "can't be estimated (below)".to_string() } else { option.cost.clone() };
    vec![
        (index + 1).to_string(),
        option.title.clone(),
        option_cell(option.peak),
        option_cell(option.saves),
        fits.into(),
        cost,
    ]
}

/// How the recompute was predicted, and what the real steps measured of it.
fn recompute_line(recompute: &super::Recompute, measured: Option<f64>) -> String {
    let ms = |seconds: f64| format!("{:.1} ms", seconds * 1000.0);
    let mut line = if recompute.timed {
        let flops = recompute.by_flops.map(|s| format!("; by their share of the step's FLOPs, {}", ms(s)));
        format!(
            "recompute predicted {}: the checkpointed blocks' forwards to their last saved tensor, timed in the step as it is{}",
            ms(recompute.seconds),
            flops.unwrap_or_default()
        )
    } else {
        format!("recompute predicted {}: the blocks' share of the step's FLOPs, of its time", ms(recompute.seconds))
    };
    if let Some(measured) = measured {
        line.push_str(&format!("; measured {} (the step's time less the step as it is)", ms(measured)));
    }
    line
}

fn verified_grid(verified: &super::Verified) -> Grid {
    let seconds = |s: Option<f64>| s.map(|s| format!("{:.3} s", s)).unwrap_or_else(|| "—".into());
    let mut rows = vec![vec![
        "peak, torch allocated".into(),
        bytes(verified.predicted_peak),
        bytes(verified.measured_peak),
        option_cell(verified.baseline_peak),
    ]];
    rows.push(vec![
        "step time".into(),
        seconds(verified.predicted_seconds),
        seconds(verified.seconds),
        seconds(verified.baseline_seconds),
    ]);
    let error =
        (verified.measured_peak as f64 - verified.predicted_peak as f64) / verified.predicted_peak.max(1) as f64;
    let mut lines = vec![format!("the measured peak is {:+.1}% off the prediction", error * 100.0)];
    if let Some(recompute) = &verified.recompute {
        lines.push(recompute_line(recompute, verified.seconds.zip(verified.baseline_seconds).map(|(s, b)| s - b)));
    }
    if let Some(first) = &verified.widened {
        lines.push(format!(
            "the first plan ({} block{}) ran out of memory in its real step with {} reserved but unallocated \
             (fragmentation, which fake tensors can't see): fit widened it to save that much more, and this \
             is the wider plan",
            first.paths.len(),
            if first.paths.len() == 1 { "" } else { "s" },
            bytes(first.stranded)
        ));
    }
    if let Some(failed) = &verified.error {
        lines.push(format!("the real step failed: {failed}"));
        if let Some(stranded) = verified.stranded.filter(|s| *s > 0) {
            lines.push(format!(
                "{} was reserved but unallocated as it ran out: fragmentation. \
                 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set before CUDA starts (a new kernel), \
                 may be the fix",
                bytes(stranded)
            ));
        }
    }
    Grid {
        title: format!("verified: {} in one real step", verified.option.label()),
        lines,
        header: ["", "predicted", "measured", "the step as it is"].map(String::from).to_vec(),
        rows,
        notes: Vec::new(),
        compact: false,
    }
}
