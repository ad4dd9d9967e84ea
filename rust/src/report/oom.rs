//! A CUDA out-of-memory error, diagnosed: what the failed allocation asked for, what the device
//! had, what gpuexp freed, and hints a person can act on.

use serde::Serialize;

use crate::grid::{prefixed, Grid};
use crate::recorder::{LiveBlocks, SinceStep};
use crate::trace::{OomSites, SiteNamer, SiteRule, Stacks};
use crate::training::Position;
use crate::units::bytes;

use super::{creep::held_line, Creep, Holder, OomMessage};

/// Another process on a GPU, as NVML lists it.
/// Bytes torch's allocator counts, in all and by pool (blocks of 1 MiB or less are the small
/// pool's).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PoolBytes {
    pub all: u64,
    pub large_pool: u64,
    pub small_pool: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OtherProcess {
    pub pid: u32,
    pub name: String,
    pub used: Option<u64>,
}

/// What a CUDA out-of-memory error asked for, what the device had, and what gpuexp freed.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OomDiagnosis {
    pub message: String,
    pub torch_index: Option<u32>,
    /// Bytes the failed allocation asked for, from torch's message.
    pub requested: Option<u64>,
    pub total: Option<u64>,
    /// Where the "at the error" figures (the `_before` ones) come from.
    pub at_error_source: FiguresSource,
    /// The per-process cap `set_per_process_memory_fraction` set, where one is.
    pub allowed: Option<u64>,
    pub free_before: Option<u64>,
    pub free_after: Option<u64>,
    pub torch_allocated_before: Option<u64>,
    pub torch_allocated_after: Option<u64>,
    pub torch_reserved_before: Option<u64>,
    /// Torch's allocated and reserved bytes by pool at the failure, where the observer read them.
    pub torch_pools_before: Option<TorchPools>,
    pub process_used_before: Option<u64>,
    pub others: Vec<OtherProcess>,
    pub hints: Vec<String>,
    pub cleared: Vec<String>,
    /// Where the training run that raised it stood, when a framework's callback measured it.
    pub training: Option<Position>,
    /// The failed line and what was live then, where torch's allocation history was recording
    /// with stacks (a traced experiment or cell, or the user's own recording).
    pub sites: Option<OomSites>,
    /// The failed line and module from the exception's traceback (no recording needed).
    pub failed_line: Option<FailedLine>,
    /// What grew since the last completed step.
    pub since_step: SinceStep,
    /// The blocks live at the failure by size, where the record had no stacks.
    pub live_blocks: Option<LiveBlocks>,
    /// What caused it: a creep where the recorder's levels show one, else what the figures at
    /// the failure say.
    pub cause: Option<OomCause>,
    /// Secondary causes the figures show beside a creep (a creep can end in fragmentation).
    pub also: Vec<OomCause>,
    /// How memory crept before the failure, where it did.
    pub creep: Option<Creep>,
    /// The largest holders on the device after the rescue, where it still held at least half
    /// of the budget (what remains is held by the user's names), largest first.
    pub held_after: Vec<Holder>,
    /// Why the holder search named nothing where it was due (it raised).
    pub holder_search: Option<String>,
}

/// Where the table's "at the error" figures come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FiguresSource {
    /// gpuexp's out-of-memory observer, called by torch inside the allocator before it raised.
    Observer,
    /// Torch's message (no observer ran: gpuexp was not active yet, or another allocator raised).
    Message,
    /// The device read after the exception unwound: the failing step's temporaries are cached
    /// by then, so "reserved, unallocated" overstates fragmentation.
    #[default]
    AfterUnwind,
}

impl FiguresSource {
    fn header(self) -> &'static str {
        match self {
            FiguresSource::Observer => "at the error (torch's OOM observer)",
            FiguresSource::Message => "at the error (torch's message)",
            FiguresSource::AfterUnwind => "at the error (read after the unwind)",
        }
    }
}

/// Torch's allocated and reserved bytes by pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct TorchPools {
    pub allocated: PoolBytes,
    pub reserved: PoolBytes,
}

/// What the figures at the failure say caused an out-of-memory error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OomCause {
    /// Torch held more reserved but unallocated than the request: no free block could serve it.
    Fragmentation,
    /// Other processes held more than a tenth of the device.
    OtherProcess,
    /// The step needed more than the device (or the memory fraction's cap) had.
    StepTooBig,
    /// Memory kept a little on every iteration filled the device (`creep`).
    Creep,
}

/// The line whose allocation failed, read from the exception's traceback: the innermost frame
/// of the user's code, and the `nn.Module` whose forward was running innermost.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FailedLine {
    /// `In [7], line 3` or `train.py:41`.
    pub label: String,
    pub source: Option<String>,
    /// `model.blocks.3.fc1 (Linear)`.
    pub module: Option<String>,
    /// How many layers one pass of the model runs through the numbered containers on the
    /// module's path (24 for `model.blocks.3.fc1` in 24 blocks): a single forward repeats the
    /// same allocations once per layer, so fewer repetitions than this are no loop's iterations.
    #[serde(skip)]
    pub pass_layers: Option<u64>,
}

impl FailedLine {
    /// From the traceback's frames (file, line, function), innermost first.
    pub fn from_frames(
        frames: &[(String, u32, String)],
        module: Option<String>,
        pass_layers: Option<u64>,
        rule: &SiteRule,
        namer: &dyn SiteNamer,
    ) -> Option<FailedLine> {
        let mut stacks = Stacks::default();
        let ids: Vec<u32> = frames.iter().map(|(file, line, name)| stacks.intern_frame(file, *line, name)).collect();
        let stack = stacks.intern_stack(&ids);
        let frame = rule.user_frame(&stacks, stack)?;
        let label = namer.label(frame.filename, frame.line);
        Some(FailedLine { label, source: namer.source(frame.filename, frame.line), module, pass_layers })
    }

    /// `In [7], line 3 `y = self.fc(x)` in model.fc (Linear), asking 4.00 GiB`
    fn describe(&self, requested: Option<u64>) -> String {
        let source = self.source.as_deref().map(|s| format!(" `{s}`")).unwrap_or_default();
        let module = self.module.as_deref().map(|m| format!(" in {m}")).unwrap_or_default();
        let asking = requested.map(|r| format!(", asking {}", bytes(r))).unwrap_or_default();
        format!("{}{source}{module}{asking}", self.label)
    }
}

/// Reads "Tried to allocate 2.00 GiB" and "GPU 0 has a total capacity" from torch's message.
pub fn parse_oom_message(message: &str) -> (Option<u64>, Option<u32>) {
    let parsed = OomMessage::parse(message);
    (parsed.requested, parsed.device)
}

impl OomDiagnosis {
    /// Reserved by torch but unallocated at the failure.
    fn reserved_unallocated(&self) -> Option<u64> {
        self.torch_reserved_before.zip(self.torch_allocated_before).map(|(r, a)| r.saturating_sub(a))
    }

    /// Whether other processes held more than a tenth of the device.
    /// Whether other processes are why it failed: they held more than a tenth of the device,
    /// and the device itself refused (it had less free than the request, which would have fit
    /// without them), not the memory fraction's cap (torch counts its reserved bytes against it).
    fn crowded(&self) -> bool {
        let others: u64 = self.others.iter().filter_map(|p| p.used).sum();
        let Some(requested) = self.requested else { return false };
        let capped = self
            .allowed
            .zip(self.torch_reserved_before)
            .is_some_and(|(allowed, reserved)| reserved.saturating_add(requested) > allowed);
        let device_refused = self.free_before.is_none_or(|free| free < requested && free + others >= requested);
        self.total.is_some_and(|total| others > total / 10) && device_refused && !capped
    }

    /// What the step can have after the rescue: the device's free memory, within the memory
    /// fraction's cap where one is set (torch counts its reserved bytes against the cap).
    fn room_after(&self) -> Option<u64> {
        let free = self.free_after?;
        Some(match (self.allowed, self.torch_allocated_after) {
            (Some(allowed), Some(allocated)) => free.min(allowed.saturating_sub(allocated)),
            _ => free,
        })
    }

    /// The cause: a creep where memory crept, else what the figures at the failure say.
    pub fn cause(&self) -> Option<OomCause> {
        match self.creep {
            Some(_) => Some(OomCause::Creep),
            None => self.figures_cause(),
        }
    }

    /// Beside a creep, fragmentation or another process where the figures show it.
    pub fn also(&self) -> Vec<OomCause> {
        let secondary = self.figures_cause().filter(|c| matches!(c, OomCause::Fragmentation | OomCause::OtherProcess));
        self.creep.and(secondary).into_iter().collect()
    }

    /// The cause from the figures at the failure: fragmentation where torch held more reserved
    /// but unallocated than the request, else another process where others held more than a
    /// tenth of the device, else a step too big for what it had.
    fn figures_cause(&self) -> Option<OomCause> {
        let requested = self.requested.filter(|&r| r > 0)?;
        if self.reserved_unallocated().is_some_and(|cached| cached >= requested) {
            Some(OomCause::Fragmentation)
        } else if self.crowded() {
            Some(OomCause::OtherProcess)
        } else {
            self.torch_allocated_before.map(|_| OomCause::StepTooBig)
        }
    }

    /// Suggestions a person can act on, from the figures. What the failed step held plus what
    /// it asked for is only a lower bound of its need (it failed before asking for the rest), so
    /// it is said as "at least", a batch factor from it is an upper bound, and a rerun is
    /// suggested only where a rerun removes the cause: fragmentation, or another process. Where
    /// memory crept, the fix for the creep replaces what is said of the step's size.
    pub fn hints(&self) -> Vec<String> {
        let mut hints: Vec<String> = self.creep.iter().map(|c| c.hint(self.held_after.first())).collect();
        let cached = self.reserved_unallocated();
        let cause = self.figures_cause();
        let fragmented = cause == Some(OomCause::Fragmentation);
        let others: u64 = self.others.iter().filter_map(|p| p.used).sum();
        let crowded = self.crowded();
        let freed = self.torch_allocated_before.zip(self.torch_allocated_after).map(|(b, a)| b.saturating_sub(a));
        let sized = self.requested.zip(freed).zip(self.room_after()).filter(|_| self.creep.is_none());
        if let Some(((requested, freed), free)) = sized {
            let at_least = freed + requested;
            let free_now = match self.allowed {
                Some(allowed) => {
                    format!("{} is free now under the {} the memory fraction allows", bytes(free), bytes(allowed))
                }
                None => format!("{} is free now", bytes(free)),
            };
            if at_least > 0 {
                let factor = free as f64 / at_least as f64;
                if factor < 1.0 {
                    hints.push(format!(
                        "the failed step needed at least {} ({} it held + {} more, before it failed); {free_now}: \
                         a batch of at most about {:.2}× the size could fit (memory grows about linearly with the batch; \
                         the step may need more than this lower bound)",
                        bytes(at_least),
                        bytes(freed),
                        bytes(requested),
                        (factor * 0.95).max(0.0)
                    ));
                } else if fragmented || crowded {
                    hints.push(format!(
                        "{free_now}, more than the at least {} the step held and asked for, and the cause is \
                         one a rerun can remove ({}): running it again may fit",
                        bytes(at_least),
                        if fragmented { "fragmentation" } else { "another process's memory" }
                    ));
                } else {
                    hints.push(format!(
                        "the failed step needed at least {} ({} it held + {} more); {free_now}, but that is a \
                         lower bound: the step failed before asking for the rest, so running it again as it is may \
                         fail the same way. Make the step smaller (batch, sequence length) or see what grew above",
                        bytes(at_least),
                        bytes(freed),
                        bytes(requested),
                    ));
                }
            }
        }
        if let (true, Some(cached)) = (fragmented, cached) {
            hints.push(format!(
                "torch held {} reserved but unallocated, more than the request: fragmentation. \
                 Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the first CUDA allocation (a new kernel)",
                bytes(cached)
            ));
        }
        if crowded {
            hints.push(format!("other processes hold {} of this GPU: stop them or use another GPU", bytes(others)));
        }
        // A model's forward was running, or a training run's step: fit can say what to change
        // (not of a creep: no change to the step stops it).
        let in_a_model = self.training.is_some() || self.failed_line.as_ref().is_some_and(|line| line.module.is_some());
        if self.creep.is_none() && in_a_model {
            hints.push(
                "next: gpuexp.fit(step, batch_size) predicts, without running it, what makes the step fit \
                 (checkpointing, autocast, accumulation), ranked, with the code (docs/fit.md)"
                    .into(),
            );
        }
        hints
    }

    pub fn grid(&self) -> Grid {
        let opt = |v: Option<u64>| v.map(bytes).unwrap_or_else(|| "n/a".into());
        let non_torch = self.process_used_before.zip(self.torch_reserved_before).map(|(p, r)| p.saturating_sub(r));
        let fragmentation = self.reserved_unallocated();
        let mut rows = vec![
            vec!["requested".to_string(), opt(self.requested), "—".into()],
            vec!["device total".into(), opt(self.total), "—".into()],
        ];
        if let Some(allowed) = self.allowed {
            rows.push(vec!["allowed (memory fraction)".into(), bytes(allowed), "—".into()]);
        }
        rows.extend([
            vec!["device free".into(), opt(self.free_before), opt(self.free_after)],
            vec!["torch allocated".into(), opt(self.torch_allocated_before), opt(self.torch_allocated_after)],
            vec!["torch reserved, unallocated".into(), opt(fragmentation), "—".into()],
            vec!["this process, not torch (context, libraries)".into(), opt(non_torch), "—".into()],
        ]);
        for other in &self.others {
            rows.push(vec![format!("process {} ({})", other.pid, other.name), opt(other.used), "—".into()]);
        }
        let mut lines = Vec::new();
        if let Some(position) = &self.training {
            lines.push(format!("raised in training at {}", position.describe()));
        }
        match (&self.failed_line, &self.sites) {
            (Some(line), _) => lines.push(format!("failed at {}", line.describe(self.requested))),
            (None, Some(sites)) => lines.push(format!("failed at {}", sites.failed_at())),
            (None, None) => {}
        }
        lines.push(self.since_step.describe());
        if let Some(sites) = &self.sites {
            lines.extend(sites.live_then(3).map(|live| format!("live then: {live}")));
        }
        lines.extend(self.live_blocks.as_ref().map(LiveBlocks::describe));
        if !self.held_after.is_empty() {
            let held: Vec<String> = self.held_after.iter().map(held_line).collect();
            lines.push(format!("held after the rescue: {}", held.join("; ")));
        }
        lines.extend(self.holder_search.as_ref().map(|why| format!("the holder search was skipped: {why}")));
        if !self.cleared.is_empty() {
            lines.push(format!("cleared: {}", self.cleared.join(", ")));
        }
        let device = self.torch_index.map(|i| format!("cuda:{i}")).unwrap_or_else(|| "the GPU".into());
        Grid {
            title: format!("gpuexp · CUDA out of memory on {device} · rescued"),
            lines,
            header: ["memory", self.at_error_source.header(), "after the rescue"].map(String::from).to_vec(),
            rows,
            notes: prefixed("hint", &self.hints),
            compact: false,
        }
    }
}

#[cfg(test)]
#[path = "oom_tests.rs"]
mod tests;
