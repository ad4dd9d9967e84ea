//! What to change so a step fits (`gpuexp.fit`): the step's predicted peak against the budget,
//! where its activations are by module, and the options (checkpointing, autocast, gradient
//! accumulation, the optimizer's loop, a smaller batch), each predicted under fake tensors,
//! ranked by what it saves, with its cost and the code that applies it.

pub mod blocks;
mod options;
mod show;

use serde::{Deserialize, Serialize};

use crate::estimate::{Categories, Rounding};
pub use blocks::{Block, ModuleSeen, Plan, Save};
pub use options::{accumulation, Accumulation, Choice, Recompute, Verified, Widened};

/// One answer of an estimate to "does it fit?", as `Estimate.to_dict()` has it.
#[derive(Clone, Debug, Deserialize)]
pub struct FitSeen {
    pub against: String,
    pub room: u64,
    pub needed: u64,
}

/// What the step may use for its peak, and what that figure is.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Budget {
    /// Bytes the peak may reach above what is allocated now.
    pub bytes: u64,
    /// "free memory" or "limit".
    pub against: String,
}

impl Budget {
    /// The tightest of the estimate's answers: each gives the room less what else it counts.
    pub fn tightest(fits: &[FitSeen], peak: u64) -> Option<Budget> {
        fits.iter()
            .map(|fit| Budget { bytes: (fit.room + peak).saturating_sub(fit.needed), against: fit.against.clone() })
            .min_by_key(|budget| budget.bytes)
    }
}

/// The model the step trains, as Python found it.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct ModelSeen {
    /// The name the step reaches it by (`model`), for the code shown.
    pub name: String,
    pub class: String,
    /// Its library's own switch for checkpointing every layer, where it has one
    /// (`model.gradient_checkpointing_enable()` in transformers).
    pub library_switch: Option<String>,
    /// The dtype of most of its parameters ("float32").
    pub dtype: String,
}

/// The optimizer the step steps, as Python found it.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct OptimizerSeen {
    pub name: String,
    pub class: String,
    /// Bytes of its state now (Adam: `exp_avg` and `exp_avg_sq`, twice the parameters).
    pub state_bytes: u64,
    pub parameter_bytes: u64,
    /// Whether it runs the `foreach` implementation (the default where it can).
    pub foreach: bool,
    /// Whether its class takes `fused=True`.
    pub fusable: bool,
}

/// An estimate of the step at another batch size.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Point {
    pub batch_size: u64,
    pub peak: u64,
    /// Gradients live at that peak: what accumulation would add is the rest of them.
    pub gradients_at_peak: u64,
}

/// An option as Python ran it under fake tensors: its peak, or why there is none.
#[derive(Clone, Debug, Deserialize)]
pub struct Run {
    pub option: Choice,
    pub peak: Option<u64>,
    /// Why it could not be estimated: `NoEstimate`'s message, naming the operator.
    pub error: Option<String>,
    /// The checkpointed blocks, for checkpointing.
    #[serde(default)]
    pub paths: Vec<String>,
    /// The micro-batch, for accumulation.
    pub micro_batch: Option<u64>,
    #[serde(default)]
    pub gradients_at_peak: u64,
}

/// Everything `fit` found, as Python gathered it.
#[derive(Clone, Debug, Deserialize)]
pub struct FitInput {
    pub batch_size: u64,
    pub device: String,
    pub now: u64,
    pub fits: Vec<FitSeen>,
    pub peak: u64,
    pub categories: Categories,
    pub modules: Vec<ModuleSeen>,
    pub saves: Vec<Save>,
    /// FLOPs of the whole step (forward, backward), as the flop counter counts them.
    pub step_flops: f64,
    pub model: Option<ModelSeen>,
    pub optimizer: Option<OptimizerSeen>,
    pub gradient_bytes: u64,
    pub half: Option<Point>,
    pub runs: Vec<Run>,
    /// Options not tried, and why ("the step runs in bfloat16 already").
    #[serde(default)]
    pub skipped: Vec<(Choice, String)>,
    /// Torch's reserved-but-unallocated bytes when the last out-of-memory error happened.
    pub last_oom_cached: Option<u64>,
    pub verified: Option<Verified>,
    pub estimates: u32,
    /// Filled in last, by the report's caller.
    #[serde(default)]
    pub seconds: f64,
    #[serde(default)]
    pub notes: Vec<String>,
}

impl FitInput {
    pub fn rounding(&self) -> Rounding {
        if self.device.starts_with("cuda") {
            Rounding::CudaCaching
        } else {
            Rounding::Exact
        }
    }

    pub fn budget(&self) -> Option<Budget> {
        Budget::tightest(&self.fits, self.peak)
    }

    /// Bytes the peak must come down by to fit (0 when it fits), None without a budget.
    pub fn need(&self) -> Option<u64> {
        self.budget().map(|budget| self.peak.saturating_sub(budget.bytes))
    }

    pub fn blocks(&self) -> Vec<Block> {
        blocks::blocks(&self.modules, &self.saves, self.rounding())
    }

    /// The checkpointing plan that saves what is needed, `more` bytes beyond it (what an
    /// earlier plan fell short by under fake tensors).
    pub fn checkpoint_plan(&self, more: u64) -> Plan {
        let blocks = self.blocks();
        let candidates = blocks::candidates(&self.modules, &blocks);
        // The plan aims 2% under the budget: its saving is a prediction from saved tensors.
        let need = self.need().filter(|need| *need > 0).map(|need| need + self.peak / 50 + more);
        blocks::plan(&blocks, &candidates, need)
    }
}

/// One option, ranked.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Ranked {
    pub option: Choice,
    /// What the option is, in words: "checkpoint 4 of 12 blocks (h.8, h.9, h.10, h.11)".
    pub title: String,
    /// The predicted peak with it; None where it could not be estimated.
    pub peak: Option<u64>,
    pub saves: Option<u64>,
    pub fits: Option<bool>,
    /// What it costs: recompute, numerics, steps.
    pub cost: String,
    /// How to apply it, ready to paste.
    pub code: String,
    /// Why it has no prediction, naming the operator.
    pub refused: Option<String>,
    /// The checkpointed blocks (checkpointing; empty otherwise).
    pub paths: Vec<String>,
    /// The blocks' forward FLOPs as a share of the step's (checkpointing).
    pub recompute_share: Option<f64>,
    /// The micro-batch (accumulation), or the batch (a smaller batch).
    pub batch_size: Option<u64>,
    /// The largest batch that fits with it (checkpointing, autocast, the optimizer's loop): the
    /// step's fixed part, with the option's bytes per sample.
    pub largest_batch: Option<u64>,
}

/// `gpuexp.fit`'s answer: why the step does not fit, and what would make it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FitReport {
    pub batch_size: u64,
    pub device: String,
    pub now: u64,
    pub peak: u64,
    pub budget: Option<Budget>,
    pub fits: Option<bool>,
    /// Bytes over the budget (0 when it fits).
    pub short: Option<u64>,
    pub categories: Categories,
    /// Modules by what they keep for backward, the largest first.
    pub blocks: Vec<Block>,
    pub step_flops: f64,
    pub options: Vec<Ranked>,
    /// The largest batch that fits as the step is, from the estimates' line.
    pub largest_batch: Option<u64>,
    /// Not ranked: what no estimate can predict (fragmentation).
    pub hints: Vec<String>,
    pub verified: Option<Verified>,
    pub estimates: u32,
    pub seconds: f64,
    pub notes: Vec<String>,
}

/// The most modules the table lists.
const MOST_BLOCKS: usize = 12;

/// The modules the table lists: the blocks a plan picks from, and the model's other children
/// that hold saved tensors (an embedding, a head), the largest first.
fn shown_blocks(input: &FitInput) -> Vec<Block> {
    let all = input.blocks();
    let candidates = blocks::candidates(&input.modules, &all);
    let related = |a: &str, b: &str| a == b || a.starts_with(&format!("{b}.")) || b.starts_with(&format!("{a}."));
    let others = all.iter().enumerate().filter(|(_, b)| {
        !b.path.is_empty()
            && !b.path.contains('.')
            && b.saved > 0
            && !candidates.iter().any(|&c| related(&all[c].path, &b.path))
    });
    let mut shown: Vec<Block> =
        candidates.iter().map(|&c| all[c].clone()).chain(others.map(|(_, b)| b.clone())).collect();
    shown.sort_by(|a, b| b.saved.cmp(&a.saved).then(a.path.cmp(&b.path)));
    shown.truncate(MOST_BLOCKS);
    shown
}

impl FitReport {
    pub fn new(input: &FitInput) -> FitReport {
        let budget = input.budget();
        let options = options::ranked(input, budget.as_ref());
        let largest_batch = budget.as_ref().and_then(|b| options::largest_batch(input, b.bytes));
        let blocks = shown_blocks(input);
        let mut hints = Vec::new();
        let short = budget.as_ref().map(|b| input.peak.saturating_sub(b.bytes));
        if let (Some(cached), Some(short)) = (input.last_oom_cached, short) {
            if short > 0 && cached > short {
                hints.push(format!(
                    "the last out-of-memory error left {} reserved but unallocated, more than the {} this step \
                     is short: fragmentation may be what fails. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, \
                     set before CUDA starts (a new kernel), may be the fix; fake tensors can't predict it",
                    crate::units::bytes(cached),
                    crate::units::bytes(short)
                ));
            }
        }
        FitReport {
            batch_size: input.batch_size,
            device: input.device.clone(),
            now: input.now,
            peak: input.peak,
            fits: short.map(|s| s == 0),
            budget,
            short,
            categories: input.categories,
            blocks,
            step_flops: input.step_flops,
            options,
            largest_batch,
            hints,
            verified: input.verified.clone().map(|verified| verified.predicted(input)),
            estimates: input.estimates,
            seconds: input.seconds,
            notes: input
                .skipped
                .iter()
                .map(|(choice, why)| format!("{}: not offered: {why}", choice.label()))
                .chain(input.notes.iter().cloned())
                .collect(),
        }
    }

    /// What `find_batch_size` says when its answer is below the batch wanted: which options
    /// raise the batch that fits, and to about what.
    pub fn raises(&self, answer: u64) -> Option<String> {
        let mut raised: Vec<(u64, &Ranked)> =
            self.options.iter().filter_map(|o| o.largest_batch.filter(|b| *b > answer).map(|b| (b, o))).collect();
        raised.sort_by_key(|(batch, _)| std::cmp::Reverse(*batch));
        let said: Vec<String> = raised
            .iter()
            .take(3)
            .map(|(batch, o)| format!("{} to about {batch} ({})", o.option.label(), o.title))
            .collect();
        let wanted = self.batch_size;
        if said.is_empty() {
            return Some(format!(
                "gpuexp.fit(step, {wanted}) found no option that raises the batch above {answer} on its own{}",
                if self.options.iter().any(|o| o.option == Choice::Accumulate) {
                    "; gradient accumulation reaches the effective batch (fit shows the code)"
                } else {
                    ""
                }
            ));
        }
        Some(format!("to reach {wanted}, gpuexp.fit(step, {wanted}) says: {}", said.join("; ")))
    }

    /// The first ranked option that fits, else the one that saves the most.
    pub fn best(&self) -> Option<&Ranked> {
        self.options.iter().find(|o| o.fits == Some(true)).or_else(|| self.options.iter().find(|o| o.peak.is_some()))
    }
}

#[cfg(test)]
mod tests;
