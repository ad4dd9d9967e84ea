//! Training runs that a framework's callback (Lightning, HF Trainer) measures in an experiment:
//! where each run stands (epoch, step, the shapes of its batch), the peak window of the interval
//! it logs next, and where a run that raised stood, for the OOM diagnosis.

use std::collections::HashMap;
use std::fmt::Write;

use serde::Serialize;

use crate::snapshot::{Gauge, Snapshot};

/// A run is known by its experiment's scope id (`scope::ScopeId`).
pub type RunId = u64;

/// One tensor (or array) of a batch: the path a person would write to reach it from the batch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BatchPart {
    /// `input_ids`, `[0]`, `['image'][1]`; empty for a batch that is one tensor.
    pub path: String,
    pub shape: Vec<u64>,
    /// torch's or numpy's name for it (`torch.int64`, `float32`), when it has one.
    pub dtype: Option<String>,
}

/// Where a run stands: the epoch and the step it is in, and the last batch it took.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Position {
    pub epoch: u64,
    /// The optimizer steps completed before this one (the trainer's `global_step`).
    pub step: u64,
    pub batch: Vec<BatchPart>,
    /// Parts of the batch left out: beyond the parts shown, or objects that raised when read.
    pub batch_skipped: u64,
}

impl Position {
    /// "epoch 1, step 7, batch input_ids (8, 128) int64, labels (8, 128) int64".
    pub fn describe(&self) -> String {
        let mut text = format!("epoch {}, step {}", self.epoch, self.step);
        if self.batch.is_empty() && self.batch_skipped == 0 {
            return text;
        }
        text.push_str(", batch ");
        let parts: Vec<String> = self
            .batch
            .iter()
            .map(|part| {
                let dims: Vec<String> = part.shape.iter().map(u64::to_string).collect();
                let shape = if dims.len() == 1 { format!("({},)", dims[0]) } else { format!("({})", dims.join(", ")) };
                let mut described = if part.path.is_empty() { shape } else { format!("{} {shape}", part.path) };
                if let Some(dtype) = &part.dtype {
                    let _ = write!(described, " {}", dtype.trim_start_matches("torch."));
                }
                described
            })
            .collect();
        text.push_str(&parts.join(", "));
        if self.batch_skipped > 0 {
            let _ = write!(text, " (+{} more not shown)", self.batch_skipped);
        }
        text
    }
}

/// What a run's logged peaks cover: an epoch, or the steps since the last step-level log.
/// Each has its own peak window, so logging every N steps leaves the epoch's peak whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Interval {
    Epoch,
    Steps,
}

/// A run while it trains.
#[derive(Clone, Debug, Default)]
struct Run {
    position: Position,
    /// The peak windows of the intervals logged next, epoch's then steps'.
    windows: [u64; 2],
}

/// A run that raised: its position, tied to the exception that ended it.
#[derive(Clone, Debug)]
struct Failure {
    error: usize,
    position: Position,
}

/// The runs being trained, and where the last one that raised stood.
#[derive(Default, Debug)]
pub struct Runs {
    open: HashMap<RunId, Run>,
    failure: Option<Failure>,
}

impl Runs {
    /// The scope `id` is a run from now on; `windows` are the peak windows of its first epoch
    /// and of its first steps. A failure kept until now belongs to an exception already handled: it goes.
    pub fn begin(&mut self, id: RunId, windows: [u64; 2]) {
        self.failure = None;
        self.open.insert(id, Run { position: Position::default(), windows });
    }

    pub fn is_run(&self, id: RunId) -> bool {
        self.open.contains_key(&id)
    }

    /// The runs still training, oldest first.
    pub fn open_ids(&self) -> Vec<RunId> {
        let mut ids: Vec<RunId> = self.open.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// The run moved to a new step; the batch stays until a new one is seen.
    pub fn step(&mut self, id: RunId, epoch: u64, step: u64) {
        if let Some(run) = self.open.get_mut(&id) {
            run.position.epoch = epoch;
            run.position.step = step;
        }
    }

    pub fn batch(&mut self, id: RunId, parts: Vec<BatchPart>, skipped: u64) {
        if let Some(run) = self.open.get_mut(&id) {
            run.position.batch = parts;
            run.position.batch_skipped = skipped;
        }
    }

    pub fn position(&self, id: RunId) -> Option<&Position> {
        self.open.get(&id).map(|run| &run.position)
    }

    /// Swaps the window of the run's `interval` for `next`; returns the one that ended.
    pub fn next_interval(&mut self, id: RunId, interval: Interval, next: u64) -> Option<u64> {
        let window = &mut self.open.get_mut(&id)?.windows[interval as usize];
        Some(std::mem::replace(window, next))
    }

    /// The run raised `error` (an exception's address, alive while it is handled): its position
    /// is kept for the OOM diagnosis of that exception.
    pub fn failed(&mut self, id: RunId, error: usize) {
        if let Some(run) = self.open.get(&id) {
            self.failure = Some(Failure { error, position: run.position.clone() });
        }
    }

    /// Where the run that raised `error` stood: the one that said so, or else the run still
    /// training when the error reached the cell (HF Trainer has no hook for exceptions), the
    /// latest if several. Taken once.
    pub fn position_at(&mut self, error: usize) -> Option<Position> {
        if let Some(failure) = self.failure.take_if(|f| f.error == error) {
            return Some(failure.position);
        }
        self.open.iter().max_by_key(|(id, _)| **id).map(|(_, run)| run.position.clone())
    }

    /// The run ended (its scope finished); returns its interval windows to close.
    pub fn end(&mut self, id: RunId) -> Option<[u64; 2]> {
        Some(self.open.remove(&id)?.windows)
    }
}

/// The names a run's metrics are logged under, one per figure and device.
const HOST_RSS: &str = "host_rss_peak_mib";
const TORCH_ALLOCATED: &str = "torch_allocated_peak_mib";
const TORCH_RESERVED: &str = "torch_reserved_peak_mib";
const NVML_PROCESS: &str = "nvml_process_peak_mib";

/// The peaks of an interval as a trainer logs them: MiB under `gpuexp/...` names. The host's
/// RSS always; per GPU the process used in the interval (torch reserved or NVML saw memory of
/// this process there), torch allocated, torch reserved and NVML's figure for this process
/// (`gpuexp/cuda1/...` when it used several GPUs).
pub fn interval_metrics(end: &Snapshot, peak: impl Fn(&Gauge) -> Option<u64>) -> Vec<(String, f64)> {
    let mib = |bytes: u64| bytes as f64 / (1u64 << 20) as f64;
    let mut metrics = vec![(format!("gpuexp/{HOST_RSS}"), mib(peak(&Gauge::HostRss).unwrap_or(end.host.rss)))];
    let used_memory = |gauge: Gauge| peak(&gauge).is_some_and(|bytes| bytes > 0);
    let used: Vec<_> = end
        .gpus
        .iter()
        .filter(|g| g.torch.is_some())
        .filter(|g| {
            used_memory(Gauge::TorchReserved(g.uuid.clone())) || used_memory(Gauge::ProcessUsed(g.uuid.clone()))
        })
        .collect();
    for gpu in &used {
        let prefix = if used.len() == 1 { "gpuexp/".to_string() } else { format!("gpuexp/cuda{}/", gpu.torch_index) };
        let uuid = &gpu.uuid;
        let gauges = [
            (TORCH_ALLOCATED, Gauge::TorchAllocated(uuid.clone())),
            (TORCH_RESERVED, Gauge::TorchReserved(uuid.clone())),
            (NVML_PROCESS, Gauge::ProcessUsed(uuid.clone())),
        ];
        for (name, gauge) in gauges {
            if let Some(value) = peak(&gauge) {
                metrics.push((format!("{prefix}{name}"), mib(value)));
            }
        }
    }
    metrics
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::testing::{gpu, host};
    use crate::snapshot::{GpuReading, TorchStats};

    fn part(path: &str, shape: &[u64], dtype: &str) -> BatchPart {
        BatchPart { path: path.into(), shape: shape.to_vec(), dtype: Some(dtype.into()) }
    }

    #[test]
    fn a_position_names_epoch_step_and_every_shape() {
        let position = Position {
            epoch: 1,
            step: 7,
            batch: vec![part("input_ids", &[8, 128], "torch.int64"), part("[1]", &[8], "float32")],
            batch_skipped: 2,
        };
        assert_eq!(
            position.describe(),
            "epoch 1, step 7, batch input_ids (8, 128) int64, [1] (8,) float32 (+2 more not shown)"
        );
        assert_eq!(Position { epoch: 0, step: 3, ..Position::default() }.describe(), "epoch 0, step 3");
    }

    #[test]
    fn the_failed_run_is_found_by_its_error_else_the_run_still_training() {
        let mut runs = Runs::default();
        runs.begin(4, [10, 11]);
        runs.step(4, 2, 9);
        runs.batch(4, vec![part("", &[4, 3], "torch.float32")], 0);
        runs.failed(4, 0xbeef);
        runs.step(4, 3, 0);
        assert_eq!(runs.position_at(0xbeef).map(|p| (p.epoch, p.step)), Some((2, 9)), "the failure's position");
        assert_eq!(runs.position_at(0xbeef).map(|p| p.epoch), Some(3), "taken once: then the open run's");
        assert_eq!(runs.end(4), Some([10, 11]));
        assert_eq!(runs.position_at(0xbeef), None, "no run: no position");
    }

    #[test]
    fn a_new_interval_hands_back_the_window_that_ended_and_leaves_the_other() {
        let mut runs = Runs::default();
        runs.begin(1, [5, 6]);
        assert_eq!(runs.next_interval(1, Interval::Steps, 7), Some(6));
        assert_eq!(runs.next_interval(1, Interval::Steps, 8), Some(7));
        assert_eq!(runs.next_interval(1, Interval::Epoch, 9), Some(5), "the epoch's window outlived the steps'");
        assert_eq!(runs.next_interval(2, Interval::Epoch, 10), None, "not a run");
        assert_eq!(runs.open_ids(), vec![1]);
        assert_eq!(runs.end(1), Some([9, 8]));
        assert!(!runs.is_run(1));
    }

    #[test]
    fn metrics_are_mib_per_figure_and_the_gpus_torch_uses() {
        let torch =
            TorchStats { allocated: 1 << 20, reserved: 2 << 20, peak_allocated: 0, peak_reserved: 0, num_ooms: 0 };
        let used = GpuReading { torch: Some(torch), process_used: Some(3 << 20), ..gpu(0, "GPU-a") };
        let end = host(1.0, 1 << 30, 1 << 30).with_gpu(used).with_gpu(gpu(1, "GPU-b"));
        let peak = |gauge: &Gauge| match gauge {
            Gauge::HostRss => Some(512 << 20),
            Gauge::TorchAllocated(_) => Some(10 << 20),
            Gauge::TorchReserved(_) => Some(20 << 20),
            Gauge::ProcessUsed(_) => Some(30 << 20),
            _ => None,
        };
        let metrics = interval_metrics(&end, peak);
        let idle = GpuReading { torch: Some(TorchStats { allocated: 0, reserved: 0, ..torch }), ..gpu(1, "GPU-c") };
        let end = end.with_gpu(idle);
        let idle_peak = |gauge: &Gauge| match gauge {
            Gauge::TorchAllocated(uuid) | Gauge::TorchReserved(uuid) | Gauge::ProcessUsed(uuid) if uuid == "GPU-c" => {
                Some(0)
            }
            other => peak(other),
        };
        assert_eq!(interval_metrics(&end, idle_peak), metrics, "GPU-c: torch has figures, the run used none of it");
        let expected = [
            ("gpuexp/host_rss_peak_mib", 512.0),
            ("gpuexp/torch_allocated_peak_mib", 10.0),
            ("gpuexp/torch_reserved_peak_mib", 20.0),
            ("gpuexp/nvml_process_peak_mib", 30.0),
        ];
        assert_eq!(metrics, expected.map(|(n, v)| (n.to_string(), v)).to_vec(), "GPU-b: torch never read it");
        let host_only = interval_metrics(&host(1.0, 1 << 30, 1 << 30), |_| Some(256 << 20));
        assert_eq!(host_only, vec![("gpuexp/host_rss_peak_mib".to_string(), 256.0)]);
    }
}
