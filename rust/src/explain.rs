//! How one device's memory adds up (`gpuexp.explain`): torch allocated split by what holds it,
//! torch's cache, what torch does not track, and the other processes on the device, in parts
//! that sum to NVML's figures exactly; the host's RSS split the same way for CPU tensors and
//! NumPy arrays. A residual is always labelled as one, and never shown negative.

use serde::Serialize;

use crate::grid::{prefixed, Grid};
use crate::report::{Holder, TensorRoles};
use crate::units::bytes;

/// A compute process on the same device, with what NVML says it holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OtherProcess {
    pub pid: u32,
    /// None where the driver withholds the figure.
    pub bytes: Option<u64>,
}

/// One GPU's figures as read at once: torch's allocator and NVML.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuFigures {
    pub torch_index: u32,
    pub nvml_index: u32,
    pub name: String,
    pub uuid: String,
    pub total: u64,
    pub allocated: u64,
    pub reserved: u64,
    /// Free parts of blocks that are partly in use (torch's inactive split bytes).
    pub fragmented: u64,
    /// None when NVML cannot tell (a PID namespace, a withheld figure).
    pub process_used: Option<u64>,
    pub device_used: u64,
    pub others: Vec<OtherProcess>,
    /// In a rank: how much the residual grew across its NCCL communicator's creation.
    pub nccl_grown: Option<u64>,
}

/// What was read on the device being explained.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reading {
    Gpu(GpuFigures),
    Host { rss: u64 },
}

/// What the walk found: tensors by role, and who holds the others.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Found {
    pub roles: TensorRoles,
    /// Holders of the other tensors, largest first.
    pub holders: Vec<Holder>,
    /// Bytes of other tensors that no name reaches (in `roles.other_tensors` too).
    pub unreachable: u64,
    pub objects_visited: u64,
    pub seconds: f64,
}

/// The categories of `explain()`, in bytes. None where the category does not exist on the
/// device (torch's cache on the host) or could not be read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Categories {
    pub parameters: u64,
    pub gradients: u64,
    pub optimizer_state: u64,
    pub buffers: u64,
    pub other_tensors: u64,
    /// Torch allocated that no Python tensor holds: saved for backward, workspaces, rounding.
    pub no_python_tensor: Option<u64>,
    /// Torch reserved less allocated.
    pub torch_cache: Option<u64>,
    /// The rest of NVML's figure for this process (of RSS on the host): context, kernels, libraries.
    pub not_torch: Option<u64>,
}

impl Categories {
    pub fn total(&self) -> u64 {
        self.parameters
            + self.gradients
            + self.optimizer_state
            + self.buffers
            + self.other_tensors
            + self.no_python_tensor.unwrap_or(0)
            + self.torch_cache.unwrap_or(0)
            + self.not_torch.unwrap_or(0)
    }
}

/// How the memory of one device adds up.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Explanation {
    /// "cuda:0" or "cpu".
    pub device: String,
    pub name: Option<String>,
    pub uuid: Option<String>,
    pub nvml_index: Option<u32>,
    pub total: Option<u64>,
    pub categories: Categories,
    pub torch_allocated: Option<u64>,
    pub torch_reserved: Option<u64>,
    /// The part of torch's cache in blocks that are partly in use (inactive split blocks).
    pub torch_cache_fragmented: Option<u64>,
    /// NCCL's part of `not_torch`, where it was measured (see `ranks::NcclShare`).
    pub not_torch_nccl: Option<u64>,
    /// What the categories add up to: NVML's figure for this process, or the host's RSS.
    pub process_used: Option<u64>,
    pub device_used: Option<u64>,
    pub other_processes: Vec<OtherProcess>,
    /// Used on the device but listed for no process (the driver's own, processes in other containers).
    pub unattributed: Option<u64>,
    /// Holders of the other tensors, largest first.
    pub holders: Vec<Holder>,
    pub unreachable: u64,
    pub notes: Vec<String>,
    pub objects_visited: u64,
    pub seconds: f64,
}

/// `total − parts` when the parts fit in it; otherwise zero, and a note that says by how much
/// they exceed it. A residual is never shown negative.
fn residual(total: u64, parts: u64, exceed: impl FnOnce(u64) -> String, notes: &mut Vec<String>) -> u64 {
    match total.checked_sub(parts) {
        Some(rest) => rest,
        None => {
            notes.push(exceed(parts - total));
            0
        }
    }
}

impl Explanation {
    pub fn new(device: &str, reading: Reading, found: Found) -> Explanation {
        let roles = found.roles;
        let mut notes = Vec::new();
        let mut explanation = Explanation {
            device: device.to_string(),
            name: None,
            uuid: None,
            nvml_index: None,
            total: None,
            categories: Categories {
                parameters: roles.parameters,
                gradients: roles.gradients,
                optimizer_state: roles.optimizer_state,
                buffers: roles.buffers,
                other_tensors: roles.other_tensors,
                ..Categories::default()
            },
            torch_allocated: None,
            torch_reserved: None,
            torch_cache_fragmented: None,
            not_torch_nccl: None,
            process_used: None,
            device_used: None,
            other_processes: Vec::new(),
            unattributed: None,
            holders: found.holders,
            unreachable: found.unreachable,
            notes: Vec::new(),
            objects_visited: found.objects_visited,
            seconds: found.seconds,
        };
        match reading {
            Reading::Host { rss } => {
                explanation.process_used = Some(rss);
                let not_tensors = residual(
                    rss,
                    roles.total(),
                    |over| {
                        format!(
                            "the tensors and arrays exceed the RSS by {}: memory allocated but never written \
                             (torch.empty, np.empty) is not resident yet",
                            bytes(over)
                        )
                    },
                    &mut notes,
                );
                explanation.categories.not_torch = Some(not_tensors);
            }
            Reading::Gpu(gpu) => {
                explanation.name = Some(gpu.name);
                explanation.uuid = Some(gpu.uuid);
                explanation.nvml_index = Some(gpu.nvml_index);
                explanation.total = Some(gpu.total);
                explanation.torch_allocated = Some(gpu.allocated);
                explanation.torch_reserved = Some(gpu.reserved);
                explanation.torch_cache_fragmented = Some(gpu.fragmented);
                explanation.device_used = Some(gpu.device_used);
                let no_python = residual(
                    gpu.allocated,
                    roles.total(),
                    |over| {
                        format!(
                            "the Python tensors exceed torch allocated by {}: some come from outside torch's \
                             allocator (DLPack, CUDA IPC)",
                            bytes(over)
                        )
                    },
                    &mut notes,
                );
                explanation.categories.no_python_tensor = Some(no_python);
                explanation.categories.torch_cache = Some(gpu.reserved.saturating_sub(gpu.allocated));
                match gpu.process_used {
                    Some(process) => {
                        let not_torch = residual(
                            process,
                            gpu.reserved,
                            |over| {
                                format!(
                                    "torch reserved exceeds NVML's figure for this process by {}: the parts \
                                     add up to more than NVML counts",
                                    bytes(over)
                                )
                            },
                            &mut notes,
                        );
                        explanation.categories.not_torch = Some(not_torch);
                        explanation.not_torch_nccl = gpu.nccl_grown.map(|grown| grown.min(not_torch));
                        explanation.process_used = Some(process);
                        let others: u64 = gpu.others.iter().filter_map(|p| p.bytes).sum();
                        explanation.unattributed = Some(residual(
                            gpu.device_used,
                            process + others,
                            |over| {
                                format!(
                                    "this process and the others listed exceed NVML's device figure by {}",
                                    bytes(over)
                                )
                            },
                            &mut notes,
                        ));
                    }
                    None => notes.push(format!(
                        "NVML gives no figure for this process on {device}, so what torch does not track \
                         can't be told from the rest"
                    )),
                }
                for process in gpu.others.iter().filter(|p| p.bytes.is_none()) {
                    notes.push(format!("the driver withholds what process {} holds", process.pid));
                }
                explanation.other_processes = gpu.others;
            }
        }
        explanation.notes = notes;
        explanation
    }

    pub fn grid(&self) -> Grid {
        const SHOWN_HOLDERS: usize = 10;
        let gpu = self.torch_allocated.is_some();
        let row = |label: &str, value: Option<u64>, what: &str| {
            vec![label.to_string(), value.map(bytes).unwrap_or_else(|| "n/a".into()), what.to_string()]
        };
        let c = &self.categories;
        let owners = "reachable from your names";
        let mut rows = vec![
            row("parameters", Some(c.parameters), &format!("of the modules and optimizers {owners}")),
            row("gradients", Some(c.gradients), ".grad of those parameters"),
            row("optimizer state", Some(c.optimizer_state), &format!("of the optimizers {owners}")),
            row("buffers", Some(c.buffers), "of those modules (running statistics)"),
            row(
                "other tensors",
                Some(c.other_tensors),
                if gpu { "held by" } else { "tensors and NumPy arrays held by" },
            ),
        ];
        for holder in self.holders.iter().take(SHOWN_HOLDERS) {
            rows.push(row(
                &format!("  {}", holder.path),
                Some(holder.bytes),
                &format!("{} {}", holder.kind, holder.shape),
            ));
        }
        if self.holders.len() > SHOWN_HOLDERS {
            let rest = &self.holders[SHOWN_HOLDERS..];
            let label = format!("  … {} more", rest.len());
            rows.push(row(&label, Some(rest.iter().map(|h| h.bytes).sum()), "to_dict() lists them all"));
        }
        if self.unreachable > 0 {
            rows.push(row(
                "  (no reachable referrer)",
                Some(self.unreachable),
                "live tensors only C++ or a cycle holds",
            ));
        }
        if gpu {
            rows.push(row(
                "no Python tensor",
                c.no_python_tensor,
                "saved for backward, workspaces, the allocator's rounding",
            ));
            rows.push(row("= torch allocated", self.torch_allocated, ""));
            rows.push(row("torch cache", c.torch_cache, "reserved, unallocated: empty_cache() frees it"));
            rows.push(row("  of which fragmented", self.torch_cache_fragmented, "free parts of blocks partly in use"));
            rows.push(row("= torch reserved", self.torch_reserved, ""));
            rows.push(row(
                "not torch",
                c.not_torch,
                "the residual: CUDA context and kernels, cuBLAS/cuDNN/NCCL, other libraries",
            ));
            if self.not_torch_nccl.is_some() {
                rows.push(row("  of which NCCL", self.not_torch_nccl, "grew as the group's communicator was made"));
            }
            rows.push(row("= NVML this process", self.process_used, ""));
            for process in &self.other_processes {
                rows.push(row(&format!("other process {}", process.pid), process.bytes, "another compute process"));
            }
            if self.unattributed.is_some_and(|b| b > 0) {
                rows.push(row("not attributed", self.unattributed, "used on the device, listed for no process"));
            }
            rows.push(row("= NVML device used", self.device_used, ""));
        } else {
            rows.push(row(
                "not tensors",
                c.not_torch,
                "the residual: the interpreter, libraries, other objects, saved for backward",
            ));
            rows.push(row("= host RSS", self.process_used, ""));
        }
        let mut lines = Vec::new();
        if let (Some(name), Some(uuid), Some(nvml), Some(total)) = (&self.name, &self.uuid, self.nvml_index, self.total)
        {
            lines.push(format!("{} = NVML {nvml} · {name} · {uuid} · {} total", self.device, bytes(total)));
        }
        let mut notes = prefixed("note", &self.notes);
        notes.push(format!("{} objects visited in {:.2} s", self.objects_visited, self.seconds));
        Grid {
            title: format!("gpuexp · explain · {}", self.device),
            lines,
            header: ["memory", "size", "what"].map(String::from).to_vec(),
            rows,
            notes,
            compact: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grid::testing::{expected_cells, html_cells, text_cells};

    const MIB: u64 = 1 << 20;

    fn found() -> Found {
        Found {
            roles: TensorRoles {
                parameters: 64 * MIB,
                gradients: 64 * MIB,
                optimizer_state: 128 * MIB,
                buffers: MIB,
                other_tensors: 1024 * MIB + 8 * MIB,
            },
            holders: vec![Holder {
                path: "cache[0]".into(),
                bytes: 1024 * MIB,
                device: "cuda:0".into(),
                kind: "tensor".into(),
                shape: "[1073741824]".into(),
                saved_for_backward: 0,
            }],
            unreachable: 8 * MIB,
            objects_visited: 1000,
            seconds: 0.05,
        }
    }

    fn gpu(process_used: Option<u64>, reserved: u64) -> GpuFigures {
        GpuFigures {
            torch_index: 0,
            nvml_index: 2,
            name: "NVIDIA H100 80GB HBM3".into(),
            uuid: "GPU-aaaa".into(),
            total: 80 << 30,
            allocated: 1400 * MIB,
            reserved,
            fragmented: 20 * MIB,
            process_used,
            device_used: 4000 * MIB,
            others: vec![OtherProcess { pid: 4242, bytes: Some(1000 * MIB) }],
            nccl_grown: None,
        }
    }

    #[test]
    fn nccl_s_measured_share_is_a_part_of_not_torch_never_more() {
        let nccl = |grown| GpuFigures { nccl_grown: Some(grown), ..gpu(Some(2500 * MIB), 1500 * MIB) };
        let explained = Explanation::new("cuda:1", Reading::Gpu(nccl(300 * MIB)), found());
        assert_eq!(explained.categories.not_torch, Some(1000 * MIB));
        assert_eq!(explained.not_torch_nccl, Some(300 * MIB));
        assert_eq!(explained.categories.total(), 2500 * MIB, "a part of the residual, not another summand");
        let row = text_cells(&explained.grid().to_text()).into_iter().find(|r| r[0].contains("of which NCCL"));
        assert_eq!(row.expect("an NCCL row")[1], bytes(300 * MIB));
        let capped = Explanation::new("cuda:1", Reading::Gpu(nccl(5000 * MIB)), found());
        assert_eq!(capped.not_torch_nccl, Some(1000 * MIB));
        let unmeasured = Explanation::new("cuda:1", Reading::Gpu(gpu(Some(2500 * MIB), 1500 * MIB)), found());
        assert!(!unmeasured.grid().to_text().contains("NCCL ") && unmeasured.not_torch_nccl.is_none());
    }

    #[test]
    fn the_parts_add_up_to_nvml_exactly_with_the_residuals_labelled() {
        let explained = Explanation::new("cuda:0", Reading::Gpu(gpu(Some(2500 * MIB), 1500 * MIB)), found());
        let c = explained.categories;
        assert_eq!(c.no_python_tensor, Some(1400 * MIB - 1289 * MIB));
        assert_eq!(c.torch_cache, Some(100 * MIB));
        assert_eq!(c.not_torch, Some(1000 * MIB));
        assert_eq!(c.total(), 2500 * MIB, "the categories sum to NVML's figure for this process");
        assert_eq!(explained.unattributed, Some(500 * MIB));
        assert_eq!(c.total() + 1000 * MIB + 500 * MIB, 4000 * MIB, "and with the others, to the device's");
        assert!(explained.notes.is_empty(), "{:?}", explained.notes);
    }

    #[test]
    fn a_residual_is_never_negative_and_an_excess_is_said() {
        let explained = Explanation::new("cuda:0", Reading::Gpu(gpu(Some(1200 * MIB), 1500 * MIB)), found());
        assert_eq!(explained.categories.not_torch, Some(0));
        assert!(explained.notes[0].starts_with("torch reserved exceeds NVML's figure for this process by 300.00 MiB"));
        let mut tensors = found();
        tensors.roles.other_tensors = 2 << 30;
        let explained = Explanation::new("cuda:0", Reading::Gpu(gpu(Some(2500 * MIB), 1500 * MIB)), tensors);
        assert_eq!(explained.categories.no_python_tensor, Some(0));
        assert!(explained.notes[0].contains("the Python tensors exceed torch allocated by"), "{:?}", explained.notes);
    }

    #[test]
    fn without_an_nvml_figure_for_the_process_nothing_is_made_up() {
        let mut figures = gpu(None, 1500 * MIB);
        figures.others[0].bytes = None;
        let explained = Explanation::new("cuda:0", Reading::Gpu(figures), found());
        assert_eq!((explained.categories.not_torch, explained.unattributed), (None, None));
        assert_eq!(explained.notes.len(), 2);
        assert!(explained.grid().to_text().contains("│ not torch "), "the row stays, as n/a");
    }

    #[test]
    fn the_host_splits_rss_into_tensors_and_the_rest() {
        let explained = Explanation::new("cpu", Reading::Host { rss: 3 << 30 }, found());
        let c = explained.categories;
        assert_eq!((c.no_python_tensor, c.torch_cache), (None, None));
        assert_eq!(c.total(), 3 << 30);
        let small = Explanation::new("cpu", Reading::Host { rss: MIB }, found());
        assert_eq!(small.categories.not_torch, Some(0));
        assert!(small.notes[0].contains("not resident"), "{:?}", small.notes);
        let text = explained.grid().to_text();
        assert!(text.contains("not tensors") && text.contains("= host RSS") && !text.contains("torch cache"), "{text}");
    }

    #[test]
    fn the_table_shows_every_category_holders_and_totals() {
        let explained = Explanation::new("cuda:0", Reading::Gpu(gpu(Some(2500 * MIB), 1500 * MIB)), found());
        let grid = explained.grid();
        let trimmed: Vec<Vec<String>> =
            expected_cells(&grid).iter().map(|row| row.iter().map(|c| c.trim().to_string()).collect()).collect();
        assert_eq!(text_cells(&grid.to_text()), trimmed);
        assert_eq!(html_cells(&grid.to_html()), expected_cells(&grid));
        assert!(grid.to_text().contains("│   cache[0] "), "holders are indented under other tensors");
        let labels: Vec<&str> = grid.rows.iter().map(|r| r[0].trim()).collect();
        assert_eq!(
            labels,
            [
                "parameters",
                "gradients",
                "optimizer state",
                "buffers",
                "other tensors",
                "cache[0]",
                "(no reachable referrer)",
                "no Python tensor",
                "= torch allocated",
                "torch cache",
                "of which fragmented",
                "= torch reserved",
                "not torch",
                "= NVML this process",
                "other process 4242",
                "not attributed",
                "= NVML device used"
            ]
        );
        assert_eq!(grid.lines, ["cuda:0 = NVML 2 · NVIDIA H100 80GB HBM3 · GPU-aaaa · 80.00 GiB total"]);
        let json = serde_json::to_value(&explained).unwrap();
        let keys: Vec<&String> = json["categories"].as_object().unwrap().keys().collect();
        assert_eq!(keys.len(), 8);
        assert_eq!(json["categories"]["not_torch"], 1000 * MIB);
    }
}
