//! A CUDA out-of-memory error, diagnosed: what the failed allocation asked for, what the device
//! had, what gpuexp freed, and hints a person can act on.

use serde::Serialize;

use crate::grid::{prefixed, Grid};
use crate::trace::OomSites;
use crate::training::Position;
use crate::units::{bytes, size_in_bytes};

/// Another process on a GPU, as NVML lists it.
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
    pub free_before: Option<u64>,
    pub free_after: Option<u64>,
    pub torch_allocated_before: Option<u64>,
    pub torch_allocated_after: Option<u64>,
    pub torch_reserved_before: Option<u64>,
    pub process_used_before: Option<u64>,
    pub others: Vec<OtherProcess>,
    pub hints: Vec<String>,
    pub cleared: Vec<String>,
    /// Where the training run that raised it stood, when a framework's callback measured it.
    pub training: Option<Position>,
    /// The failed line and what was live then, where torch's allocation history was recording.
    pub sites: Option<OomSites>,
}

/// Reads "Tried to allocate 2.00 GiB" and "GPU 0 has a total capacity" from torch's message.
pub fn parse_oom_message(message: &str) -> (Option<u64>, Option<u32>) {
    let requested = message.split("Tried to allocate ").nth(1).and_then(|rest| {
        let mut words = rest.split_whitespace();
        let number = words.next()?;
        let unit = words.next()?.trim_end_matches(['.', ';', ',', ')']);
        size_in_bytes(number, unit).map(|n| n.round() as u64)
    });
    // "GPU 0 has a total capacity" (torch 2) or "(GPU 1; 79.19 GiB total capacity" (torch 1).
    let device = message.split("GPU ").nth(1).and_then(|rest| {
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().ok()
    });
    (requested, device)
}

impl OomDiagnosis {
    /// Suggestions a person can act on, from the figures. The batch-size factor assumes
    /// memory grows linearly with the batch, as it nearly does for most models.
    pub fn hints(&self) -> Vec<String> {
        let mut hints = Vec::new();
        let freed = self.torch_allocated_before.zip(self.torch_allocated_after).map(|(b, a)| b.saturating_sub(a));
        if let (Some(requested), Some(freed), Some(free)) = (self.requested, freed, self.free_after) {
            let needed = freed + requested;
            if needed > 0 {
                let factor = free as f64 / needed as f64;
                if factor < 1.0 {
                    hints.push(format!(
                        "the failed step needed about {} ({} it held + {} more); {} is free now: \
                         a batch about {:.2}× the size should fit (memory grows about linearly with the batch)",
                        bytes(needed),
                        bytes(freed),
                        bytes(requested),
                        bytes(free),
                        (factor * 0.95).max(0.0)
                    ));
                } else {
                    hints.push(format!(
                        "{} is free now, more than the step needed ({}): running it again may fit",
                        bytes(free),
                        bytes(needed)
                    ));
                }
            }
        }
        if let (Some(reserved), Some(allocated), Some(requested)) =
            (self.torch_reserved_before, self.torch_allocated_before, self.requested)
        {
            let cached = reserved.saturating_sub(allocated);
            if cached >= requested && requested > 0 {
                hints.push(format!(
                    "torch held {} reserved but unallocated, more than the request: fragmentation. \
                     Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the first CUDA allocation (a new kernel)",
                    bytes(cached)
                ));
            }
        }
        let others: u64 = self.others.iter().filter_map(|p| p.used).sum();
        if let Some(total) = self.total {
            if others > total / 10 {
                hints.push(format!("other processes hold {} of this GPU: stop them or use another GPU", bytes(others)));
            }
        }
        hints
    }

    pub fn grid(&self) -> Grid {
        let opt = |v: Option<u64>| v.map(bytes).unwrap_or_else(|| "n/a".into());
        let non_torch = self.process_used_before.zip(self.torch_reserved_before).map(|(p, r)| p.saturating_sub(r));
        let fragmentation =
            self.torch_reserved_before.zip(self.torch_allocated_before).map(|(r, a)| r.saturating_sub(a));
        let mut rows = vec![
            vec!["requested".to_string(), opt(self.requested), "—".into()],
            vec!["device total".into(), opt(self.total), "—".into()],
            vec!["device free".into(), opt(self.free_before), opt(self.free_after)],
            vec!["torch allocated".into(), opt(self.torch_allocated_before), opt(self.torch_allocated_after)],
            vec!["torch reserved, unallocated".into(), opt(fragmentation), "—".into()],
            vec!["this process, not torch (context, libraries)".into(), opt(non_torch), "—".into()],
        ];
        for other in &self.others {
            rows.push(vec![format!("process {} ({})", other.pid, other.name), opt(other.used), "—".into()]);
        }
        let mut lines = Vec::new();
        if let Some(position) = &self.training {
            lines.push(format!("raised in training at {}", position.describe()));
        }
        if let Some(sites) = &self.sites {
            lines.push(format!("failed at {}", sites.failed_at()));
            lines.extend(sites.live_then(3).map(|live| format!("live then: {live}")));
        }
        if !self.cleared.is_empty() {
            lines.push(format!("cleared: {}", self.cleared.join(", ")));
        }
        let device = self.torch_index.map(|i| format!("cuda:{i}")).unwrap_or_else(|| "the GPU".into());
        Grid {
            title: format!("gpuexp · CUDA out of memory on {device} · rescued"),
            lines,
            header: ["memory", "at the error", "after the rescue"].map(String::from).to_vec(),
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
            free_before: Some(GIB),
            free_after: Some(6 * GIB),
            torch_allocated_before: Some(70 * GIB),
            torch_allocated_after: Some(62 * GIB),
            torch_reserved_before: Some(71 * GIB), // 1 GiB cached: less than the request
            process_used_before: Some(73 * GIB),
            others: Vec::new(),
            hints: Vec::new(),
            cleared: Vec::new(),
            training: None,
            sites: None,
        }
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
            stack: Vec::new(),
        };
        let mut d = diagnosis();
        d.sites = Some(OomSites {
            event: 9,
            time_us: 0,
            requested: 1 << 50,
            device_free: 0,
            site: Site { label: "In [7], line 2".into(), source: Some("huge = alloc()".into()), stack: Vec::new() },
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
            site: crate::trace::Site { label: String::new(), source: None, stack: Vec::new() },
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
