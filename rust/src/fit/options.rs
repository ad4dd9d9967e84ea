//! The options `fit` offers, each with its predicted peak, what it costs and how to apply it,
//! ranked by what it saves; and the two it derives from the line through two estimates: the
//! micro-batch of gradient accumulation, and the largest batch that fits as the step is.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{Budget, FitInput, Ranked, Run};
use crate::units::bytes;

/// What an option changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Choice {
    /// Activation checkpointing of some blocks.
    Checkpoint,
    /// `torch.autocast` to bfloat16.
    Autocast,
    /// k micro-batches of bs/k, one optimizer step.
    Accumulate,
    /// The optimizer's per-parameter loop instead of its `foreach` implementation.
    ForeachOff,
    /// The largest batch that fits as the step is.
    SmallerBatch,
}

impl Choice {
    pub fn label(self) -> &'static str {
        match self {
            Choice::Checkpoint => "activation checkpointing",
            Choice::Autocast => "autocast to bfloat16",
            Choice::Accumulate => "gradient accumulation",
            Choice::ForeachOff => "the optimizer's per-parameter loop",
            Choice::SmallerBatch => "a smaller batch",
        }
    }
}

/// One real step of an option next to its prediction (`fit(..., verify=True)`).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
pub struct Verified {
    pub option: Choice,
    pub predicted_peak: u64,
    pub measured_peak: u64,
    /// The step as it is, measured in the same run, where the runner measured it.
    pub baseline_peak: Option<u64>,
    pub seconds: Option<f64>,
    pub baseline_seconds: Option<f64>,
    /// Checkpointing: each block's forward time in the step as it is, from its start to its last
    /// save for backward (where checkpoint's recompute stops), `{path: seconds}`, timed by the
    /// runner with CUDA events.
    #[serde(default)]
    pub forward_seconds: BTreeMap<String, f64>,
    /// Checkpointing: what its recompute is predicted to cost (`Verified::predicted`).
    #[serde(default)]
    pub recompute: Option<Recompute>,
    /// The step time predicted: the step as it is plus the recompute.
    #[serde(default)]
    pub predicted_seconds: Option<f64>,
    /// What went wrong: an out-of-memory error of the real step, say.
    pub error: Option<String>,
    /// With an out-of-memory error: the bytes torch held reserved but unallocated as it ran
    /// out, which fragmentation strands and fake tensors can't see.
    #[serde(default)]
    pub stranded: Option<u64>,
    /// The checkpointed blocks that ran (checkpointing).
    #[serde(default)]
    pub paths: Vec<String>,
    /// The plan that ran out of memory first, where fit then widened it by what it stranded.
    #[serde(default)]
    pub widened: Option<Widened>,
}

/// The predicted cost of checkpointing's recompute: its blocks' forwards run again in the
/// backward.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
pub struct Recompute {
    pub seconds: f64,
    /// Whether `seconds` is the blocks' forwards as timed in the step as it is; if not, it is
    /// their FLOP share of the step's time.
    pub timed: bool,
    /// The FLOP share of the step's time, the prediction without running anything. It misses
    /// memory-bound norms and activations, and the matmuls checkpoint's early stop never reruns.
    pub by_flops: Option<f64>,
}

impl Verified {
    /// The core's prediction of the step time with the option, from the runner's measurements:
    /// for checkpointing, the step as it is plus its blocks' forwards as timed in it where every
    /// block was timed, else plus their FLOP share of its time.
    pub fn predicted(mut self, input: &FitInput) -> Verified {
        self.recompute = None;
        self.predicted_seconds = None;
        let Some(baseline) = self.baseline_seconds else {
            return self;
        };
        if self.option != Choice::Checkpoint || self.paths.is_empty() {
            return self;
        }
        let by_flops = recompute_share(input, &self.paths).map(|share| share * baseline);
        let timed: Option<f64> = self.paths.iter().map(|path| self.forward_seconds.get(path).copied()).sum();
        self.recompute = match (timed, by_flops) {
            (Some(seconds), _) => Some(Recompute { seconds, timed: true, by_flops }),
            (None, Some(seconds)) => Some(Recompute { seconds, timed: false, by_flops }),
            (None, None) => None,
        };
        self.predicted_seconds = self.recompute.as_ref().map(|r| baseline + r.seconds);
        self
    }
}

/// A checkpointing plan whose real step ran out of memory through fragmentation, and that fit
/// widened by the bytes it stranded.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
pub struct Widened {
    pub paths: Vec<String>,
    pub stranded: u64,
}

/// The line through the step's estimates at bs/2 and bs: (intercept, bytes per sample).
fn line(input: &FitInput) -> Option<(f64, f64)> {
    let half = input.half.as_ref()?;
    if half.batch_size >= input.batch_size {
        return None;
    }
    let slope = (input.peak as f64 - half.peak as f64) / (input.batch_size - half.batch_size) as f64;
    (slope > 0.0).then_some((half.peak as f64 - slope * half.batch_size as f64, slope))
}

fn on_line(input: &FitInput, batch: u64) -> Option<u64> {
    let (intercept, slope) = line(input)?;
    Some((intercept + slope * batch as f64).max(0.0) as u64)
}

/// The largest batch whose predicted peak is within `budget`.
pub fn largest_batch(input: &FitInput, budget: u64) -> Option<u64> {
    let (intercept, slope) = line(input)?;
    let batch = ((budget as f64 - intercept) / slope).floor();
    (batch >= 1.0).then_some(batch as u64)
}

/// The largest batch an option fits: the step's line keeps its fixed part, and the option's
/// peak at the batch gives its bytes per sample.
fn largest_with(input: &FitInput, peak: u64, budget: u64) -> Option<u64> {
    let (intercept, _) = line(input)?;
    let slope = (peak as f64 - intercept) / input.batch_size as f64;
    let batch = ((budget as f64 - intercept) / slope).floor();
    (slope > 0.0 && batch >= 1.0).then_some(batch as u64)
}

/// Gradient accumulation's plan: k micro-batches of `micro_batch`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Accumulation {
    pub k: u64,
    pub micro_batch: u64,
    /// The step's peak at the micro-batch: the estimate at bs/2, else the line through it.
    pub step_peak: u64,
    /// The gradients live at that peak (the estimate at bs/2's).
    pub gradients_at_peak: u64,
    /// The step's peak at the micro-batch (from the line) plus the gradients kept between them.
    pub predicted: u64,
}

/// The fewest micro-batches (k divides the batch) whose predicted peak fits; two where no
/// budget is known; None where no k fits.
pub fn accumulation(input: &FitInput) -> Option<Accumulation> {
    let kept_gradients = |gradients_at_peak: u64| input.gradient_bytes.saturating_sub(gradients_at_peak);
    let half = input.half.as_ref()?;
    let budget = input.budget().map(|b| b.bytes);
    (2..=input.batch_size).filter(|k| input.batch_size.is_multiple_of(*k)).find_map(|k| {
        let micro_batch = input.batch_size / k;
        let peak = if micro_batch == half.batch_size { Some(half.peak) } else { on_line(input, micro_batch) }?;
        let predicted = peak + kept_gradients(half.gradients_at_peak);
        let plan =
            Accumulation { k, micro_batch, step_peak: peak, gradients_at_peak: half.gradients_at_peak, predicted };
        budget.is_none_or(|b| predicted <= b).then_some(plan)
    })
}

/// The options, ranked: those with a prediction by what they save, the most first; those that
/// could not be estimated after, with why.
pub fn ranked(input: &FitInput, budget: Option<&Budget>) -> Vec<Ranked> {
    let mut options: Vec<Ranked> = input.runs.iter().map(|run| ranked_run(input, run, budget)).collect();
    if let Some(budget) = budget.filter(|b| input.peak > b.bytes) {
        if let Some(batch) = largest_batch(input, budget.bytes).filter(|b| *b < input.batch_size) {
            let peak = on_line(input, batch);
            options.push(Ranked {
                option: Choice::SmallerBatch,
                title: format!("batch size {batch}, the largest that fits as the step is"),
                saves: peak.map(|p| input.peak.saturating_sub(p)),
                fits: peak.map(|p| p <= budget.bytes),
                peak,
                cost: format!("{:.0}% of the samples per step", 100.0 * batch as f64 / input.batch_size as f64),
                code: format!("step({batch})"),
                refused: None,
                paths: Vec::new(),
                recompute_share: None,
                batch_size: Some(batch),
                largest_batch: Some(batch),
            });
        }
    }
    options.sort_by_key(|o| (o.peak.is_none(), std::cmp::Reverse(o.saves.unwrap_or(0))));
    options
}

fn ranked_run(input: &FitInput, run: &Run, budget: Option<&Budget>) -> Ranked {
    let (title, cost, code) = describe(input, run);
    let mut peak = run.peak;
    if run.option == Choice::Accumulate {
        // Each micro-batch after the first runs with the gradients of those before it.
        peak = peak.map(|p| p + input.gradient_bytes.saturating_sub(run.gradients_at_peak));
    }
    Ranked {
        option: run.option,
        title,
        saves: peak.map(|p| input.peak.saturating_sub(p)),
        fits: peak.zip(budget).map(|(p, b)| p <= b.bytes),
        peak,
        cost,
        code,
        refused: run.error.clone(),
        paths: run.paths.clone(),
        recompute_share: (run.option == Choice::Checkpoint).then(|| recompute_share(input, &run.paths)).flatten(),
        batch_size: run.micro_batch,
        largest_batch: (run.option != Choice::Accumulate)
            .then(|| budget.zip(peak).and_then(|(b, p)| largest_with(input, p, b.bytes)))
            .flatten(),
    }
}

/// The recompute share of checkpointing `paths`: their forward FLOPs against the step's.
pub fn recompute_share(input: &FitInput, paths: &[String]) -> Option<f64> {
    let flops: f64 = input.modules.iter().filter(|m| paths.contains(&m.path)).map(|m| m.forward_flops).sum();
    (input.step_flops > 0.0).then(|| flops / input.step_flops)
}

/// Title, cost and code of an option.
fn describe(input: &FitInput, run: &Run) -> (String, String, String) {
    let model = input.model.clone().unwrap_or_default();
    let model_name = if model.name.is_empty() { "model".to_string() } else { model.name };
    let device_type = input.device.split(':').next().unwrap_or("cuda").to_string();
    let bs = input.batch_size;
    match run.option {
        Choice::Checkpoint => {
            let blocks = super::blocks::candidates(&input.modules, &input.blocks()).len();
            let shown: Vec<&str> = run.paths.iter().take(6).map(String::as_str).collect();
            let more = if run.paths.len() > shown.len() { ", …" } else { "" };
            let title = format!("checkpoint {} of {blocks} blocks ({}{more})", run.paths.len(), shown.join(", "));
            let cost = match recompute_share(input, &run.paths) {
                Some(share) => format!("recomputes {:.0}% of the step's FLOPs (their forwards, again)", share * 100.0),
                None => "recomputes their forwards in backward (no FLOPs were counted)".into(),
            };
            let paths: Vec<String> = run.paths.iter().map(|p| format!("{p:?}")).collect();
            let mut code = format!(
                "import gpuexp\n\nwith gpuexp.checkpointed({model_name}, [{}]):\n    step({bs})",
                paths.join(", ")
            );
            if let Some(switch) = &model.library_switch {
                code.push_str(&format!("\n\n# or the library's own switch, for every layer:\n{switch}"));
            }
            (title, cost, code)
        }
        Choice::Autocast => (
            "autocast the step to bfloat16".into(),
            "numerics: 8 bits of mantissa in matmuls (below)".into(),
            format!("import torch\n\nwith torch.autocast({device_type:?}, dtype=torch.bfloat16):\n    step({bs})"),
        ),
        Choice::Accumulate => {
            let micro = run.micro_batch.unwrap_or(bs);
            let k = bs / micro.max(1);
            let optimizer = input.optimizer.as_ref().map(|o| o.name.clone()).unwrap_or_else(|| "opt".into());
            // Only a batch norm's statistics see the micro-batch instead of the batch.
            let norms = input.modules.iter().any(|m| m.class.contains("BatchNorm"));
            let seen = if norms { format!("; BatchNorm sees {micro} samples") } else { String::new() };
            (
                format!("accumulate gradients: {k} micro-batches of {micro}"),
                format!("{k}× the calls per optimizer step{seen}"),
                format!(
                    "{optimizer}.zero_grad(set_to_none=True)\nfor i in range({k}):\n    \
                     micro = slice(i * {micro}, (i + 1) * {micro})\n    \
                     loss = loss_fn({model_name}(x[micro]), y[micro]) / {k}\n    loss.backward()\n{optimizer}.step()"
                ),
            )
        }
        Choice::ForeachOff => {
            let optimizer = input.optimizer.clone();
            let (name, class) = optimizer.as_ref().map(|o| (o.name.clone(), o.class.clone())).unwrap_or_default();
            let state = optimizer
                .as_ref()
                .map(|o| {
                    format!(
                        "; state stays {} ({:.1}× the parameters)",
                        bytes(o.state_bytes),
                        o.state_bytes as f64 / o.parameter_bytes.max(1) as f64
                    )
                })
                .unwrap_or_default();
            let fused = if optimizer.is_some_and(|o| o.fusable) {
                format!("\n# or one fused kernel, no foreach temporaries and faster:\n# torch.optim.{class}(..., fused=True)")
            } else {
                String::new()
            };
            (
                format!("{class} without foreach temporaries (foreach=False)"),
                format!("a slower optimizer step{state}"),
                format!("for group in {name}.param_groups:\n    group[\"foreach\"] = False{fused}"),
            )
        }
        Choice::SmallerBatch => (format!("batch size {bs}"), String::new(), format!("step({bs})")),
    }
}
