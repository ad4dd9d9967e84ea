//! A CUDA out-of-memory error, diagnosed: what the failed allocation asked for, what the device
//! had, what gpuexp freed, and hints a person can act on.

use serde::Serialize;

use crate::grid::{prefixed, Grid};
use crate::recorder::{LiveBlocks, SinceStep};
use crate::trace::{OomSites, SiteNamer, SiteRule, Stacks};
use crate::training::Position;
use crate::units::bytes;

use super::OomMessage;

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
    /// What the figures at the failure say caused it.
    pub cause: Option<OomCause>,
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
}

impl FailedLine {
    /// From the traceback's frames (file, line, function), innermost first.
    pub fn from_frames(
        frames: &[(String, u32, String)],
        module: Option<String>,
        rule: &SiteRule,
        namer: &dyn SiteNamer,
    ) -> Option<FailedLine> {
        let mut stacks = Stacks::default();
        let ids: Vec<u32> = frames.iter().map(|(file, line, name)| stacks.intern_frame(file, *line, name)).collect();
        let stack = stacks.intern_stack(&ids);
        let frame = rule.user_frame(&stacks, stack)?;
        let label = namer.label(frame.filename, frame.line);
        Some(FailedLine { label, source: namer.source(frame.filename, frame.line), module })
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
    fn crowded(&self) -> bool {
        let others: u64 = self.others.iter().filter_map(|p| p.used).sum();
        self.total.is_some_and(|total| others > total / 10)
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

    /// The cause, from the figures at the failure: fragmentation where torch held more reserved
    /// but unallocated than the request, else another process where others held more than a
    /// tenth of the device, else a step too big for what it had.
    pub fn cause(&self) -> Option<OomCause> {
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
    /// suggested only where a rerun removes the cause: fragmentation, or another process.
    pub fn hints(&self) -> Vec<String> {
        let mut hints = Vec::new();
        let cached = self.reserved_unallocated();
        let cause = self.cause();
        let fragmented = cause == Some(OomCause::Fragmentation);
        let others: u64 = self.others.iter().filter_map(|p| p.used).sum();
        let crowded = self.crowded();
        let freed = self.torch_allocated_before.zip(self.torch_allocated_after).map(|(b, a)| b.saturating_sub(a));
        if let (Some(requested), Some(freed), Some(free)) = (self.requested, freed, self.room_after()) {
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
        // A model's forward was running, or a training run's step: fit can say what to change.
        if self.training.is_some() || self.failed_line.as_ref().is_some_and(|line| line.module.is_some()) {
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
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn torch_messages_of_both_generations_are_read() {
        let new = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB";
        assert_eq!(parse_oom_message(new), (Some(2 * GIB), Some(0)));
        let old = "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 1; 79.19 GiB total capacity";
        assert_eq!(parse_oom_message(old), (Some(20 << 20), Some(1)));
        let small = "CUDA out of memory. Tried to allocate 512 bytes. GPU 2 has a total capacity of 79.19 GiB";
        assert_eq!(parse_oom_message(small), (Some(512), Some(2)));
        assert_eq!(parse_oom_message("CUDA error: out of memory"), (None, None));
        assert_eq!(parse_oom_message("Tried to allocate lots of GPU memory"), (None, None));
    }

    fn diagnosis() -> OomDiagnosis {
        OomDiagnosis {
            message: String::new(),
            torch_index: Some(0),
            requested: Some(2 * GIB),
            total: Some(80 * GIB),
            at_error_source: FiguresSource::Observer,
            allowed: None,
            free_before: Some(GIB),
            free_after: Some(6 * GIB),
            torch_allocated_before: Some(70 * GIB),
            torch_allocated_after: Some(62 * GIB),
            torch_reserved_before: Some(71 * GIB), // 1 GiB cached: less than the request
            torch_pools_before: None,
            process_used_before: Some(73 * GIB),
            others: Vec::new(),
            hints: Vec::new(),
            cleared: Vec::new(),
            training: None,
            sites: None,
            failed_line: None,
            since_step: SinceStep::NoStep,
            live_blocks: None,
            cause: None,
        }
    }

    #[test]
    fn a_lower_bound_is_said_as_at_least_and_a_rerun_is_suggested_only_where_it_removes_the_cause() {
        // The GPT-2 step of issue 29: it held 119.21 GiB and asked 4 more; 138.10 GiB is free
        // after the rescue, yet its logits alone needed about 250 GiB.
        let mut d = diagnosis();
        d.total = Some(141 * GIB);
        d.torch_allocated_before = Some(121 * GIB);
        d.torch_allocated_after = Some(2 * GIB);
        d.torch_reserved_before = Some(122 * GIB); // 1 GiB cached: less than the 2 GiB asked for
        d.requested = Some(4 * GIB);
        d.free_after = Some(138 * GIB);
        let hints = d.hints();
        assert!(hints[0].contains("at least 123.00 GiB") && hints[0].contains("lower bound"), "{hints:?}");
        assert!(!hints.iter().any(|h| h.contains("may fit")), "{hints:?}");
        // Fragmentation is a cause a rerun (with expandable segments) removes.
        d.torch_reserved_before = Some(130 * GIB);
        let hints = d.hints();
        assert!(hints[0].contains("running it again may fit") && hints[0].contains("fragmentation"), "{hints:?}");
        // The batch factor rests on the same lower bound: an upper bound on the batch.
        let hints = diagnosis().hints();
        assert!(hints[0].contains("needed at least 10.00 GiB") && hints[0].contains("at most about"), "{hints:?}");
    }

    #[test]
    fn the_traceback_names_the_users_line_and_the_innermost_module() {
        use crate::trace::PlainNamer;
        let frames = vec![
            ("/venv/lib/python3.12/site-packages/torch/nn/modules/linear.py".to_string(), 125, "forward".to_string()),
            ("/venv/lib/python3.12/site-packages/torch/nn/modules/module.py".to_string(), 1775, "_call_impl".into()),
            ("/home/u/model.py".to_string(), 14, "forward".to_string()),
            ("/home/u/train.py".to_string(), 3, "<module>".to_string()),
        ];
        let module = Some("model.blocks.3.fc1 (Linear)".to_string());
        let line = FailedLine::from_frames(&frames, module, &SiteRule::default(), &PlainNamer::default())
            .expect("a user frame");
        assert_eq!(line.label, "/home/u/model.py:14");
        let mut d = diagnosis();
        d.failed_line = Some(line);
        let text = d.grid().to_text();
        assert!(
            text.contains("failed at /home/u/model.py:14 in model.blocks.3.fc1 (Linear), asking 2.00 GiB"),
            "{text}"
        );
        assert!(text.contains("none completed"), "{text}");
        assert!(FailedLine::from_frames(&frames[..2], None, &SiteRule::default(), &PlainNamer::default()).is_none());
    }

    #[test]
    fn the_batch_factor_is_what_is_free_over_what_the_step_needed() {
        // The step held 8 GiB and asked for 2 more; 6 GiB is free after the rescue.
        let hints = diagnosis().hints();
        assert!(hints[0].contains("10.00 GiB") && hints[0].contains(&format!("{:.2}×", 0.6 * 0.95)), "{hints:?}");
    }

    #[test]
    fn fragmentation_and_other_processes_get_their_hints() {
        let mut d = diagnosis();
        d.torch_reserved_before = Some(75 * GIB); // 5 GiB cached, more than the 2 GiB asked for
        d.others = vec![OtherProcess { pid: 7, name: "python".into(), used: Some(20 * GIB) }];
        let hints = d.hints();
        assert!(hints.iter().any(|h| h.contains("expandable_segments")), "{hints:?}");
        assert!(hints.iter().any(|h| h.contains("other processes hold 20.00 GiB")), "{hints:?}");
        assert!(!diagnosis().hints().iter().any(|h| h.contains("expandable_segments")));
    }

    #[test]
    fn an_oom_in_a_models_forward_or_a_training_step_points_to_fit() {
        assert!(!diagnosis().hints().iter().any(|h| h.contains("gpuexp.fit")));
        let mut d = diagnosis();
        d.failed_line =
            Some(FailedLine { label: "In [7], line 3".into(), source: None, module: Some("model.h.3 (Block)".into()) });
        assert!(
            d.hints().last().is_some_and(|h| h.starts_with("next: gpuexp.fit(step, batch_size)")),
            "{:?}",
            d.hints()
        );
        d.failed_line = None;
        d.training = Some(Position::default());
        assert!(d.hints().iter().any(|h| h.contains("gpuexp.fit")));
    }

    #[test]
    fn the_table_says_what_it_cleared_and_hints() {
        let mut d = diagnosis();
        d.cleared = vec!["frames of the failed call".into()];
        d.hints = d.hints();
        d.training = Some(Position { epoch: 1, step: 4, ..Position::default() });
        let text = d.grid().to_text();
        assert!(
            text.contains("cleared: frames of the failed call")
                && text.contains("hint: the failed step")
                && text.contains("raised in training at epoch 1, step 4"),
            "{text}"
        );
    }

    #[test]
    fn with_the_trace_on_the_diagnosis_names_the_failed_line_and_what_was_live() {
        use crate::trace::{Rest, Site, SiteRow, SiteTable};
        let row = |label: &str, bytes: u64, share: f64| SiteRow {
            label: label.into(),
            source: None,
            bytes,
            blocks: 1,
            share,
            stack: Default::default(),
        };
        let mut d = diagnosis();
        d.sites = Some(OomSites {
            event: 9,
            time_us: 0,
            requested: 1 << 50,
            device_free: 0,
            site: Site {
                label: "In [7], line 2".into(),
                source: Some("huge = alloc()".into()),
                stack: Default::default(),
            },
            live: SiteTable {
                total: 3 * GIB,
                sites: vec![row("In [6], line 1", 2 * GIB, 2.0 / 3.0), row("In [7], line 1", GIB, 1.0 / 3.0)],
                rest: Rest::default(),
                categories: Vec::new(),
                all: Vec::new(),
            },
        });
        let text = d.grid().to_text();
        assert!(text.contains("failed at In [7], line 2 `huge = alloc()`, asking 1.00 PiB"), "{text}");
        assert!(text.contains("live then: In [6], line 1 (2.00 GiB, 67%); In [7], line 1 (1.00 GiB, 33%)"), "{text}");
    }

    #[test]
    fn an_oom_in_the_trace_is_the_one_the_message_names_only_when_their_sizes_agree() {
        let oom = |requested: u64| OomSites {
            event: 0,
            time_us: 0,
            requested,
            device_free: 0,
            site: crate::trace::Site { label: String::new(), source: None, stack: Default::default() },
            live: crate::trace::SiteTable {
                total: 0,
                sites: Vec::new(),
                rest: crate::trace::Rest::default(),
                categories: Vec::new(),
                all: Vec::new(),
            },
        };
        const MIB: u64 = 1 << 20;
        // "Tried to allocate 2.00 MiB" for 512 bytes, "20.00 MiB" for 3 MiB, "10.35 GiB" for the
        // logits, "1024.00 TiB" for 2^50.
        assert!(oom(512).matches_message(2 * MIB));
        assert!(oom(3 * MIB).matches_message(20 * MIB));
        assert!(oom(11_113_000_000).matches_message(parse_oom_message("Tried to allocate 10.35 GiB.").0.unwrap()));
        assert!(oom(1 << 50).matches_message(1 << 50));
        // An older OOM of another size is not this one.
        assert!(!oom(4 * GIB).matches_message(2 * GIB));
        assert!(!oom(512).matches_message(20 * MIB));
    }
}
