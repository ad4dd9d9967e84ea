//! What a sampled trace's report says about its sampling: how the peak's sites were found
//! (directly, mapped from a sampled step, or not at all) and what the stacks cost the run.

use serde::Serialize;

use super::block::{Block, SiteSource};
use super::marks::Recorded;
use super::replay::Replay;
use crate::units::bytes;

/// How the sites of a window's peak were found, where gpuexp's sampling recorded the trace.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Sampling {
    /// Steps in the window: the stretches between step ends that allocated (the one running at
    /// its end too).
    pub steps: usize,
    /// Of them, those recorded with Python stacks.
    pub with_stacks: usize,
    /// Bytes live at the peak whose site is their own stack's (or their phase's).
    pub direct_bytes: u64,
    /// Bytes live at the peak whose site is a sampled step's block's.
    pub mapped_bytes: u64,
    /// Bytes live at the peak made in a step without stacks, with no block to map them to.
    pub unattributed_bytes: u64,
    /// The steps (numbered from 1 at the window's opening; 0: before it) the mapped sites come from.
    pub sites_from_steps: Vec<usize>,
    /// What the stacks measured on this run, where steps of both kinds were timed.
    pub cost: Option<StackCost>,
}

/// What recording Python stacks cost this run, from its own step marks: the median step with
/// stacks against the median step without (each step's time is from its end to the next one's;
/// the stretch from the opening to the first step end is left out, it may hold setup).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct StackCost {
    /// A step with stacks over one without: 0.25 is 25% longer.
    pub per_sampled_step: f64,
    /// The sampled steps' extra time as a share of the timed steps' total.
    pub of_the_run: f64,
}

impl StackCost {
    pub(crate) fn measure(durations: &[(i64, bool)]) -> Option<StackCost> {
        let median = |stacks: bool| {
            let mut of: Vec<i64> = durations.iter().filter(|(_, s)| *s == stacks).map(|(d, _)| *d).collect();
            of.sort_unstable();
            (!of.is_empty()).then(|| of[of.len() / 2] as f64)
        };
        let (with, without) = (median(true)?, median(false)?);
        if without <= 0.0 {
            return None;
        }
        let extra: f64 = durations.iter().filter(|(_, s)| *s).map(|(d, _)| (*d as f64 - without).max(0.0)).sum();
        let total: f64 = durations.iter().map(|(d, _)| *d as f64).sum();
        Some(StackCost { per_sampled_step: with / without - 1.0, of_the_run: extra / total })
    }

    fn describe(&self) -> String {
        format!(
            "; measured on this run, a step with stacks took {:+.0}% and the sampled steps {:+.1}% of the run              (torch's history without stacks on every step is not in this figure: bench/RESULTS.md)",
            self.per_sampled_step * 100.0,
            self.of_the_run * 100.0
        )
    }
}

impl Sampling {
    /// Python stacks on every step of the window: nothing was mapped.
    pub fn full(&self) -> bool {
        self.with_stacks == self.steps
    }

    /// One line for the report's notes.
    pub fn describe(&self) -> String {
        if self.full() {
            return match self.steps {
                0 | 1 => "attribution: full, Python stacks on every allocation".to_string(),
                n => format!("attribution: full, Python stacks on all {n} steps"),
            };
        }
        let from = match self.sites_from_steps.as_slice() {
            [] => String::new(),
            [step] => format!(" from step {step}"),
            steps => format!(" from steps {}", steps.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")),
        };
        format!(
            "attribution sampled: Python stacks on {} of {} steps, the others recorded without stacks (every size \
             exact); at the peak {} attributed directly, {} mapped{from} by order of allocation and size, {} \
             unattributed (gpuexp.config(trace_sampling=False): stacks on every step){}",
            self.with_stacks,
            self.steps,
            bytes(self.direct_bytes),
            bytes(self.mapped_bytes),
            bytes(self.unattributed_bytes),
            self.cost.map(|cost| cost.describe()).unwrap_or_default()
        )
    }
}

/// The sampling of the window from `since_us` on and where the sites of `live` (its peak's
/// blocks) came from; None where the trace holds no step mark of gpuexp's.
pub fn summary(replay: &Replay, since_us: i64, live: &[&Block]) -> Option<Sampling> {
    let spans = &replay.steps;
    if spans.is_empty() {
        return None;
    }
    // A stretch that allocated nothing (after the last step end, say) is no step.
    let mut allocated = vec![false; spans.len()];
    for event in replay.blocks.iter().filter_map(|block| block.alloc_event) {
        let span = spans.partition_point(|span| span.first_event <= event);
        if let Some(span) = span.checked_sub(1).filter(|&span| event < spans[span].end_event) {
            allocated[span] = true;
        }
    }
    // A step is in the window when it ends after the opening.
    let in_window: Vec<usize> = (0..spans.len())
        .filter(|&i| spans[i].recorded != Recorded::Outside && allocated[i])
        .filter(|&i| spans.get(i + 1).is_none_or(|next| next.start_us > since_us))
        .collect();
    let number = |span: usize| in_window.iter().position(|&i| i == span).map_or(0, |p| p + 1);
    let mut sampling = Sampling {
        steps: in_window.len(),
        with_stacks: in_window.iter().filter(|&&i| spans[i].recorded == Recorded::Stacks).count(),
        direct_bytes: 0,
        mapped_bytes: 0,
        unattributed_bytes: 0,
        sites_from_steps: Vec::new(),
        cost: None,
    };
    // Each step's time runs to the next step end; the last has none, the first may hold setup.
    let timed: Vec<(i64, bool)> = (in_window.iter().skip(1))
        .filter_map(|&i| Some((spans.get(i + 1)?.start_us - spans[i].start_us, spans[i].recorded == Recorded::Stacks)))
        .collect();
    sampling.cost = StackCost::measure(&timed);
    for block in live {
        match block.sites {
            SiteSource::Own => sampling.direct_bytes += block.bytes,
            SiteSource::Unattributed => sampling.unattributed_bytes += block.bytes,
            SiteSource::Mapped { step } => {
                sampling.mapped_bytes += block.bytes;
                sampling.sites_from_steps.push(number(step as usize));
            }
        }
    }
    sampling.sites_from_steps.sort_unstable();
    sampling.sites_from_steps.dedup();
    Some(sampling)
}
