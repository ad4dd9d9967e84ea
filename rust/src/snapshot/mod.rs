//! One reading of everything gpuexp measures: host memory, NVML's view of each visible GPU,
//! and torch's allocator on each of them.

pub mod host;
pub mod nvml;
pub mod torch;
pub mod visible;

use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

pub use host::HostReading;
pub use nvml::GpuIdent;
use nvml::ProcessUse;
pub use torch::{NoTorch, TorchProbe, TorchStats};

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
    /// None when NVML cannot tell (see [`Snapshot::notes`]); never a made-up zero.
    pub process_used: Option<u64>,
    /// None when torch is not imported.
    pub torch: Option<TorchStats>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Snapshot {
    /// Seconds since the Unix epoch.
    pub taken_at: f64,
    pub host: HostReading,
    pub gpus: Vec<GpuReading>,
    /// Why a row is missing or a figure is unavailable, in words a user can act on.
    pub notes: Vec<String>,
}

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
    pub fn take(selection: &GpuSelection, torch: &dyn TorchProbe) -> Snapshot {
        let mut snapshot = Snapshot { taken_at: now(), host: host::read(), gpus: Vec::new(), notes: Vec::new() };
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
                match nvml::read(device, &pids) {
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
            Err(why) => snapshot.notes.push(why),
        }
        snapshot
    }
}

fn gpu_reading(ident: &GpuIdent, nvml: nvml::NvmlReading, torch: Option<TorchStats>, notes: &mut Vec<String>) -> GpuReading {
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
        process_used,
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
fn own_pids() -> Vec<u32> {
    static CACHE: Mutex<Option<(u32, Vec<u32>)>> = Mutex::new(None);
    let pid = std::process::id();
    let mut cache = CACHE.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    match cache.as_ref() {
        Some((owner, pids)) if *owner == pid => pids.clone(),
        _ => {
            let mut pids = vec![pid];
            if let Ok(status) = std::fs::read_to_string("/proc/self/status") {
                if let Some(line) = status.lines().find(|l| l.starts_with("NSpid:")) {
                    pids.extend(line.split_whitespace().skip(1).filter_map(|p| p.parse::<u32>().ok()));
                }
            }
            *cache = Some((pid, pids.clone()));
            pids
        }
    }
}

/// One measured quantity, identified across snapshots (GPUs by UUID, which survives re-indexing).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Gauge {
    HostRss,
    TorchAllocated(String),
    TorchReserved(String),
    ProcessUsed(String),
    DeviceUsed(String),
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
                out.push((Gauge::ProcessUsed(gpu.uuid.clone()), used, used));
            }
            out.push((Gauge::DeviceUsed(gpu.uuid.clone()), gpu.device_used, gpu.device_used));
        }
        out
    }

    pub fn gpu(&self, uuid: &str) -> Option<&GpuReading> {
        self.gpus.iter().find(|g| g.uuid == uuid)
    }
}
