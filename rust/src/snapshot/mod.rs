//! One reading of everything gpuexp measures: host memory, NVML's view of each visible GPU,
//! and torch's allocator on each of them.

pub mod children;
pub mod host;
pub mod nvml;
pub mod torch;
pub mod visible;

use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::fork::PerProcess;

pub use host::HostReading;
pub use nvml::GpuIdent;
use nvml::ProcessUse;
pub use torch::{TorchProbe, TorchStats};

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GpuReading {
    pub torch_index: u32,
    pub nvml_index: u32,
    pub uuid: String,
    pub name: String,
    pub total: u64,
    pub free: u64,
    /// NVML's "reserved": set aside by the driver, counted in neither used nor free.
    pub reserved: u64,
    pub device_used: u64,
    /// Highest `device_used` since the last reset, as the sampler saw it (NVML has no peak counter).
    pub device_used_peak: u64,
    /// None when NVML cannot tell (see [`Snapshot::notes`]); never a made-up zero.
    pub process_used: Option<u64>,
    /// Highest `process_used` since the last reset, as the sampler saw it.
    pub process_used_peak: Option<u64>,
    /// What this process's descendants hold on the device (see [`children`]).
    pub children_used: u64,
    /// Highest `children_used` since the last reset, as the sampler saw it.
    pub children_used_peak: u64,
    /// None when torch is not imported.
    pub torch: Option<TorchStats>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Snapshot {
    /// Seconds since the Unix epoch.
    #[serde(serialize_with = "crate::units::serialize_rfc3339")]
    pub taken_at: f64,
    pub host: HostReading,
    pub gpus: Vec<GpuReading>,
    /// Why a row is missing or a figure is unavailable, in words a user can act on.
    pub notes: Vec<String>,
}

/// Where a snapshot gets a device's NVML figures from, given the device and this process's PIDs.
pub type NvmlSource =
    dyn Fn(&GpuIdent, &nvml_wrapper::Device<'static>, &[u32]) -> crate::error::Result<nvml::NvmlReading>;

/// Which GPUs a snapshot covers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuSelection {
    None,
    AllVisible,
    /// Torch indices (positions among the visible devices).
    Only(Vec<u32>),
}

pub fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

impl Snapshot {
    /// A snapshot of `host` and the selected GPUs, whose NVML figures come from `read_nvml`:
    /// usually the driver, but the per-cell log takes the sampler's latest sample instead of
    /// asking it again.
    pub fn take(
        host: HostReading,
        selection: &GpuSelection,
        torch: &dyn TorchProbe,
        read_nvml: &NvmlSource,
    ) -> Snapshot {
        let mut snapshot = Snapshot { taken_at: now(), host, gpus: Vec::new(), notes: Vec::new() };
        if *selection == GpuSelection::None {
            return snapshot;
        }
        let pids = own_pids();
        let read = nvml::with_visible(torch.device_uuids(), |devices| {
            let mut gpus = Vec::with_capacity(devices.len());
            let mut notes = Vec::new();
            for (ident, device) in devices {
                if let GpuSelection::Only(wanted) = selection {
                    if !wanted.contains(&ident.torch_index) {
                        continue;
                    }
                }
                match read_nvml(ident, device, &pids) {
                    Ok(reading) => gpus.push(gpu_reading(ident, reading, torch.stats(ident.torch_index), &mut notes)),
                    Err(e) => notes.push(format!("cuda:{} could not be read through NVML: {e}", ident.torch_index)),
                }
            }
            (gpus, notes)
        });
        match read {
            Ok((gpus, notes)) => {
                if gpus.is_empty() && notes.is_empty() {
                    snapshot.notes.push(no_gpu_note());
                }
                if !gpus.is_empty() && !torch.imported() {
                    snapshot.notes.push("torch is not imported: torch allocated/reserved rows are not shown".into());
                }
                snapshot.gpus = gpus;
                snapshot.notes.extend(notes);
            }
            Err(why) => snapshot.notes.push(format!("{why}: GPU rows are not shown")),
        }
        snapshot
    }
}

fn gpu_reading(
    ident: &GpuIdent,
    nvml: nvml::NvmlReading,
    torch: Option<TorchStats>,
    notes: &mut Vec<String>,
) -> GpuReading {
    let torch_holds_memory = torch.is_some_and(|t| t.reserved > 0);
    let process_used = match nvml.process {
        ProcessUse::Listed(bytes) => Some(bytes),
        ProcessUse::NotListed if torch_holds_memory => {
            notes.push(format!(
                "cuda:{}: the driver does not list this process although torch holds memory there \
                 (a PID namespace, as in some containers), so NVML process figures are unavailable",
                ident.torch_index
            ));
            None
        }
        ProcessUse::NotListed => Some(0),
        ProcessUse::Unreported => {
            notes.push(format!("cuda:{}: the driver does not report per-process memory", ident.torch_index));
            None
        }
    };
    GpuReading {
        torch_index: ident.torch_index,
        nvml_index: ident.nvml_index,
        uuid: ident.uuid.clone(),
        name: ident.name.clone(),
        total: nvml.total,
        free: nvml.free,
        reserved: nvml.reserved,
        device_used: nvml.used,
        device_used_peak: nvml.used,
        process_used,
        process_used_peak: process_used,
        children_used: nvml.children,
        children_used_peak: nvml.children,
        torch,
    }
}

fn no_gpu_note() -> String {
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(value) => format!("no GPU is visible (CUDA_VISIBLE_DEVICES={value:?}): only host rows are shown"),
        Err(_) => "no GPU found: only host rows are shown".into(),
    }
}

/// This process's PID in each PID namespace it belongs to (/proc's NSpid), read once per
/// process: a forked child reads its own.
pub(crate) fn own_pids() -> Vec<u32> {
    static OWN_PIDS: PerProcess<Vec<u32>> = PerProcess::new(read_own_pids);
    OWN_PIDS.lock().clone()
}

fn read_own_pids() -> Vec<u32> {
    let mut pids = vec![crate::fork::pid()];
    if let Ok(status) = std::fs::read_to_string("/proc/self/status") {
        if let Some(line) = status.lines().find(|l| l.starts_with("NSpid:")) {
            pids.extend(line.split_whitespace().skip(1).filter_map(|p| p.parse::<u32>().ok()));
        }
    }
    pids
}

/// One measured quantity, identified across snapshots (GPUs by UUID, which survives re-indexing).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Gauge {
    HostRss,
    TorchAllocated(String),
    TorchReserved(String),
    ProcessUsed(String),
    DeviceUsed(String),
    ChildrenUsed(String),
}

impl Snapshot {
    /// Every gauge with its current value and its high-water mark since gpuexp last reset the
    /// process-wide counters (VmHWM, torch's peaks). Gauges without a counter report the current value.
    pub fn gauges(&self) -> Vec<(Gauge, u64, u64)> {
        let mut out = vec![(Gauge::HostRss, self.host.rss, self.host.peak_rss.max(self.host.rss))];
        for gpu in &self.gpus {
            if let Some(t) = gpu.torch {
                out.push((Gauge::TorchAllocated(gpu.uuid.clone()), t.allocated, t.peak_allocated.max(t.allocated)));
                out.push((Gauge::TorchReserved(gpu.uuid.clone()), t.reserved, t.peak_reserved.max(t.reserved)));
            }
            if let Some(used) = gpu.process_used {
                let peak = gpu.process_used_peak.unwrap_or(used).max(used);
                out.push((Gauge::ProcessUsed(gpu.uuid.clone()), used, peak));
            }
            out.push((Gauge::DeviceUsed(gpu.uuid.clone()), gpu.device_used, gpu.device_used_peak.max(gpu.device_used)));
            let children_peak = gpu.children_used_peak.max(gpu.children_used);
            out.push((Gauge::ChildrenUsed(gpu.uuid.clone()), gpu.children_used, children_peak));
        }
        out
    }

    pub fn gpu(&self, uuid: &str) -> Option<&GpuReading> {
        self.gpus.iter().find(|g| g.uuid == uuid)
    }
}

/// Hand-built snapshots for unit tests: `Snapshot::take` reads the real machine.
#[cfg(test)]
pub(crate) mod testing {
    use super::{GpuReading, HostReading, Snapshot, TorchStats};

    pub(crate) const GIB: u64 = 1 << 30;

    /// A snapshot with only host figures; `peak_rss` is the VmHWM since the last reset.
    pub(crate) fn host(taken_at: f64, rss: u64, peak_rss: u64) -> Snapshot {
        Snapshot {
            taken_at,
            host: HostReading { rss, peak_rss, available: 64 * GIB, total: 128 * GIB, cgroup_limit: None },
            gpus: Vec::new(),
            notes: Vec::new(),
        }
    }

    /// A GPU without torch, with NVML figures that are easy to tell apart.
    pub(crate) fn gpu(torch_index: u32, uuid: &str) -> GpuReading {
        GpuReading {
            torch_index,
            nvml_index: torch_index,
            uuid: uuid.to_string(),
            name: "NVIDIA H100 80GB HBM3".to_string(),
            total: 80 * GIB,
            free: 79 * GIB,
            reserved: 0,
            device_used: GIB,
            // No sampler: the gauges take the current values as the peaks.
            device_used_peak: 0,
            process_used: Some(0),
            process_used_peak: None,
            children_used: 0,
            children_used_peak: 0,
            torch: None,
        }
    }

    /// Torch allocator figures; peaks are those since torch's counters were last reset.
    pub(crate) fn torch(allocated: u64, reserved: u64, peak_allocated: u64, peak_reserved: u64) -> TorchStats {
        TorchStats { allocated, reserved, peak_allocated, peak_reserved, num_ooms: 0 }
    }

    impl Snapshot {
        pub(crate) fn with_gpu(mut self, gpu: GpuReading) -> Snapshot {
            self.gpus.push(gpu);
            self
        }

        pub(crate) fn with_note(mut self, note: &str) -> Snapshot {
            self.notes.push(note.to_string());
            self
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvml::{NvmlReading, ProcessUse};

    const GIB: u64 = 1 << 30;

    fn ident() -> GpuIdent {
        GpuIdent { torch_index: 0, nvml_index: 3, uuid: "GPU-aaaa".into(), name: "H200".into() }
    }

    fn nvml_reading(process: ProcessUse) -> NvmlReading {
        NvmlReading { total: 140 * GIB, used: 10 * GIB, free: 130 * GIB, reserved: GIB / 2, process, children: 0 }
    }

    fn torch_holding(reserved: u64) -> Option<TorchStats> {
        Some(TorchStats { allocated: reserved / 2, reserved, ..TorchStats::default() })
    }

    #[test]
    fn an_unlisted_process_holding_torch_memory_is_unavailable_not_zero() {
        // In a PID namespace the driver lists host PIDs, so ours is missing although torch holds memory.
        let mut notes = Vec::new();
        let reading = gpu_reading(&ident(), nvml_reading(ProcessUse::NotListed), torch_holding(GIB), &mut notes);
        assert_eq!(reading.process_used, None);
        assert!(notes[0].contains("PID namespace"), "{notes:?}");
    }

    #[test]
    fn an_unlisted_process_without_torch_memory_uses_nothing() {
        let mut notes = Vec::new();
        for torch in [None, Some(TorchStats::default())] {
            let reading = gpu_reading(&ident(), nvml_reading(ProcessUse::NotListed), torch, &mut notes);
            assert_eq!(reading.process_used, Some(0));
        }
        assert!(notes.is_empty());
    }

    #[test]
    fn listed_and_withheld_figures() {
        let mut notes = Vec::new();
        let listed = gpu_reading(&ident(), nvml_reading(ProcessUse::Listed(3 * GIB)), torch_holding(GIB), &mut notes);
        assert_eq!((listed.process_used, listed.nvml_index, listed.device_used), (Some(3 * GIB), 3, 10 * GIB));
        assert!(notes.is_empty());
        let withheld = gpu_reading(&ident(), nvml_reading(ProcessUse::Unreported), None, &mut notes);
        assert_eq!(withheld.process_used, None);
        assert_eq!(notes.len(), 1);
    }

    #[test]
    fn gauges_cover_every_figure_with_a_value() {
        let gpu = gpu_reading(&ident(), nvml_reading(ProcessUse::Listed(GIB)), torch_holding(2 * GIB), &mut Vec::new());
        let snapshot = Snapshot { taken_at: 0.0, host: HostReading::default(), gpus: vec![gpu], notes: vec![] };
        let names: Vec<Gauge> = snapshot.gauges().into_iter().map(|(g, _, _)| g).collect();
        let uuid = || "GPU-aaaa".to_string();
        assert_eq!(
            names,
            [
                Gauge::HostRss,
                Gauge::TorchAllocated(uuid()),
                Gauge::TorchReserved(uuid()),
                Gauge::ProcessUsed(uuid()),
                Gauge::DeviceUsed(uuid()),
                Gauge::ChildrenUsed(uuid())
            ]
        );
    }
}
