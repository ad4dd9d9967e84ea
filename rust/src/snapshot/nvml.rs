//! NVML through nvml-wrapper, which opens the driver's library at run time: a machine without
//! a driver gets an explanation, never a failed import.

use std::sync::{Mutex, OnceLock};

use nvml_wrapper::enum_wrappers::device::Brand;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};

use super::visible::{self, DeviceOrder, PhysicalGpu, VisibleGpu};
use crate::error::{Error, Result};
use crate::locks::lock;

/// A GPU this process can use, with how each side names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuIdent {
    /// Position among the devices CUDA shows this process (torch's index).
    pub torch_index: u32,
    /// NVML's index of the physical GPU (the parent, for a MIG instance).
    pub nvml_index: u32,
    pub uuid: String,
    pub name: String,
}

/// What NVML says this process holds on a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcessUse {
    Listed(u64),
    /// The driver lists no process with our PID; in a PID namespace that does not mean zero.
    NotListed,
    /// Listed, but the driver withholds the figure (WDDM, some MIG set-ups).
    Unreported,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NvmlReading {
    pub total: u64,
    pub used: u64,
    pub free: u64,
    pub reserved: u64,
    pub process: ProcessUse,
    /// What this process's descendants hold on the device.
    pub children: u64,
}

fn library() -> Result<&'static Nvml> {
    static NVML: OnceLock<Result<Nvml>> = OnceLock::new();
    NVML.get_or_init(|| {
        // Driver installs ship only the versioned name; the unversioned one comes with dev packages.
        Nvml::builder().lib_path("libnvidia-ml.so.1".as_ref()).init().or_else(|_| Nvml::init()).map_err(|e| match e {
            NvmlError::LibloadingError(_) => Error::NoDriver("no NVIDIA driver (libnvidia-ml.so.1 not found)".into()),
            e => Error::NoDriver(format!("NVML unavailable ({e})")),
        })
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Whether NVML can be used, with the reason when it cannot.
pub fn available() -> Result<()> {
    library().map(|_| ())
}

/// Driver version and CUDA version the driver supports, e.g. ("580.65", "13.0").
pub fn driver_versions() -> Result<(String, String)> {
    let nvml = library()?;
    let driver = nvml.sys_driver_version().map_err(failed)?;
    let cuda = nvml.sys_cuda_driver_version().map_err(failed)?;
    Ok((driver, format!("{}.{}", cuda / 1000, (cuda % 1000) / 10)))
}

/// An NVML call's failure, in NVML's words.
fn failed(error: NvmlError) -> Error {
    Error::Nvml(error.to_string())
}

fn device_count(nvml: &Nvml) -> Result<u32> {
    nvml.device_count().map_err(|e| Error::Nvml(format!("NVML could not count devices: {e}")))
}

fn physical_gpus(nvml: &Nvml) -> Result<Vec<PhysicalGpu>> {
    let count = device_count(nvml)?;
    let mut gpus = Vec::with_capacity(count as usize);
    for index in 0..count {
        let Ok(device) = nvml.device_by_index(index) else { continue };
        let cc = device.cuda_compute_capability().map(|c| (c.major, c.minor)).unwrap_or((0, 0));
        let mig_uuids = (0..device.mig_device_count().unwrap_or(0))
            .filter_map(|i| device.mig_device_by_index(i).ok()?.uuid().ok())
            .collect();
        gpus.push(PhysicalGpu {
            nvml_index: index,
            uuid: device.uuid().unwrap_or_default(),
            pci_bus_id: device.pci_info().map(|p| p.bus_id).unwrap_or_default(),
            compute_capability: cc,
            multiprocessors: device.num_cores().unwrap_or(0),
            mig_uuids,
        });
    }
    Ok(gpus)
}

/// What the visible-device list was computed from: it is recomputed only when this changes.
#[derive(Clone, PartialEq, Eq)]
struct VisibilityKey {
    cuda_visible_devices: Option<String>,
    device_order: Option<String>,
    torch_uuids: Option<Vec<String>>,
}

struct VisibleSet {
    key: VisibilityKey,
    devices: Vec<(GpuIdent, Device<'static>)>,
}

/// The devices this process sees, in torch index order. Once torch has initialised CUDA its
/// UUIDs decide (exact); before that, CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER do.
pub fn with_visible<R>(
    torch_uuids: Option<Vec<String>>,
    read: impl FnOnce(&[(GpuIdent, Device<'static>)]) -> R,
) -> Result<R> {
    static CACHE: Mutex<Option<VisibleSet>> = Mutex::new(None);
    let nvml = library()?;
    // Torch's UUIDs, once it has them, decide alone: the environment is read only before.
    let env = |name: &str| if torch_uuids.is_none() { std::env::var(name).ok() } else { None };
    let key = VisibilityKey {
        cuda_visible_devices: env("CUDA_VISIBLE_DEVICES"),
        device_order: env("CUDA_DEVICE_ORDER"),
        torch_uuids,
    };
    let mut cache = lock(&CACHE);
    if cache.as_ref().map(|set| &set.key) != Some(&key) {
        let devices = resolve(nvml, &key)?;
        *cache = Some(VisibleSet { key, devices });
    }
    Ok(read(&cache.as_ref().expect("filled above").devices))
}

fn resolve(nvml: &'static Nvml, key: &VisibilityKey) -> Result<Vec<(GpuIdent, Device<'static>)>> {
    let physical = physical_gpus(nvml)?;
    let chosen: Vec<VisibleGpu> = match &key.torch_uuids {
        Some(uuids) => uuids.iter().filter_map(|uuid| by_uuid(&physical, uuid)).collect(),
        None => visible::resolve(
            key.cuda_visible_devices.as_deref(),
            DeviceOrder::from_env_value(key.device_order.as_deref()),
            &physical,
        ),
    };
    let mut devices = Vec::with_capacity(chosen.len());
    for (torch_index, gpu) in chosen.into_iter().enumerate() {
        let (nvml_index, device) = match &gpu {
            VisibleGpu::Whole { nvml_index } => (*nvml_index, nvml.device_by_index(*nvml_index)),
            VisibleGpu::Mig { parent_nvml_index, uuid } => (*parent_nvml_index, nvml.device_by_uuid(uuid.as_str())),
        };
        let device = device.map_err(|e| Error::Nvml(format!("NVML could not open GPU {nvml_index}: {e}")))?;
        let ident = GpuIdent {
            torch_index: torch_index as u32,
            nvml_index,
            uuid: device.uuid().unwrap_or_default(),
            name: device.name().unwrap_or_else(|_| brand_name(&device)),
        };
        devices.push((ident, device));
    }
    Ok(devices)
}

fn brand_name(device: &Device) -> String {
    match device.brand() {
        Ok(Brand::Tesla) => "NVIDIA Tesla".into(),
        _ => "NVIDIA GPU".into(),
    }
}

fn by_uuid(physical: &[PhysicalGpu], uuid: &str) -> Option<VisibleGpu> {
    physical.iter().find_map(|gpu| {
        if visible::same_uuid(&gpu.uuid, uuid) {
            return Some(VisibleGpu::Whole { nvml_index: gpu.nvml_index });
        }
        gpu.mig_uuids
            .iter()
            .find(|mig| visible::same_uuid(mig, uuid))
            .map(|mig| VisibleGpu::Mig { parent_nvml_index: gpu.nvml_index, uuid: mig.clone() })
    })
}

/// Compute processes on the device other than this one, with what they hold.
pub fn other_processes(uuid: &str, own: &[u32]) -> Vec<(u32, Option<u64>)> {
    let Ok(device) = open(uuid) else { return Vec::new() };
    let Ok(processes) = device.running_compute_processes() else { return Vec::new() };
    processes
        .into_iter()
        .filter(|p| !own.contains(&p.pid))
        .map(|p| match p.used_gpu_memory {
            UsedGpuMemory::Used(bytes) => (p.pid, Some(bytes)),
            UsedGpuMemory::Unavailable => (p.pid, None),
        })
        .collect()
}

/// What a monitor shows besides memory, each None where the device does not report it.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Activity {
    /// Percent of the last sample period a kernel was running.
    pub utilization: Option<u32>,
    pub memory_utilization: Option<u32>,
    pub temperature_c: Option<u32>,
    pub power_w: Option<f64>,
}

pub fn activity(device: &Device) -> Activity {
    let rates = device.utilization_rates().ok();
    Activity {
        utilization: rates.as_ref().map(|r| r.gpu),
        memory_utilization: rates.as_ref().map(|r| r.memory),
        temperature_c: device.temperature(nvml_wrapper::enum_wrappers::device::TemperatureSensor::Gpu).ok(),
        power_w: device.power_usage().ok().map(|mw| f64::from(mw) / 1000.0),
    }
}

/// The UUIDs of the GPUs this process sees, in torch's order as CUDA_VISIBLE_DEVICES sets it.
pub fn visible_uuids() -> Result<Vec<String>> {
    with_visible(None, |devices| devices.iter().map(|(ident, _)| ident.uuid.clone()).collect())
}

/// A compute process on a device, for `gpuexp status`.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ProcessStatus {
    pub pid: u32,
    pub user: String,
    pub command: String,
    pub used: Option<u64>,
}

/// One device as `gpuexp status` shows it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct DeviceStatus {
    /// NVML's index, or the CUDA ordinal with `cuda_order`.
    pub index: u32,
    pub nvml_index: u32,
    pub uuid: String,
    pub name: String,
    pub used: u64,
    pub total: u64,
    #[serde(flatten)]
    pub activity: Activity,
    pub processes: Vec<ProcessStatus>,
}

/// A device as the `gpuexp` command lists it, opened once: what never changes is read here, the
/// rest by `status` from the kept handle.
pub struct Listed {
    /// NVML's index, or the CUDA ordinal in CUDA's order.
    index: u32,
    nvml_index: u32,
    uuid: String,
    name: String,
    device: Device<'static>,
}

/// Every GPU in NVML's order, or those CUDA_VISIBLE_DEVICES shows in CUDA's order.
pub fn list_devices(cuda_order: bool) -> Result<Vec<Listed>> {
    let nvml = library()?;
    if cuda_order {
        let idents: Vec<GpuIdent> =
            with_visible(None, |devices| devices.iter().map(|(ident, _)| ident.clone()).collect())?;
        return idents
            .into_iter()
            .map(|ident| {
                Ok(Listed {
                    device: open(&ident.uuid)?,
                    index: ident.torch_index,
                    nvml_index: ident.nvml_index,
                    uuid: ident.uuid,
                    name: ident.name,
                })
            })
            .collect();
    }
    let count = device_count(nvml)?;
    Ok((0..count)
        .filter_map(|index| {
            let device = nvml.device_by_index(index).ok()?;
            Some(Listed {
                index,
                nvml_index: index,
                uuid: device.uuid().ok()?,
                name: device.name().unwrap_or_else(|_| brand_name(&device)),
                device,
            })
        })
        .collect())
}

impl Listed {
    /// Memory and activity now, with the compute processes when asked (each costs reads of
    /// /proc and /etc/passwd).
    pub fn status(&self, with_processes: bool) -> Result<DeviceStatus> {
        let memory = self
            .device
            .memory_info()
            .map_err(|e| Error::Nvml(format!("NVML could not read GPU {}: {e}", self.index)))?;
        let processes =
            if with_processes { self.device.running_compute_processes().unwrap_or_default() } else { Vec::new() }
                .into_iter()
                .map(|p| ProcessStatus {
                    pid: p.pid,
                    user: process_user(p.pid),
                    command: super::host::process_command(p.pid),
                    used: match p.used_gpu_memory {
                        UsedGpuMemory::Used(bytes) => Some(bytes),
                        UsedGpuMemory::Unavailable => None,
                    },
                })
                .collect();
        Ok(DeviceStatus {
            index: self.index,
            nvml_index: self.nvml_index,
            uuid: self.uuid.clone(),
            name: self.name.clone(),
            used: memory.used,
            total: memory.total,
            activity: activity(&self.device),
            processes,
        })
    }
}

fn process_user(pid: u32) -> String {
    let uid = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("Uid:"))?.split_whitespace().nth(1).map(String::from));
    let Some(uid) = uid else { return "?".into() };
    std::fs::read_to_string("/etc/passwd")
        .ok()
        .and_then(|passwd| {
            passwd.lines().find(|l| l.split(':').nth(2) == Some(uid.as_str()))?.split(':').next().map(String::from)
        })
        .unwrap_or(uid)
}

/// A handle of its own for a device, by UUID (the sampler's thread keeps one per GPU).
pub fn open(uuid: &str) -> Result<Device<'static>> {
    library()?.device_by_uuid(uuid).map_err(|e| Error::Nvml(format!("NVML could not open {uuid}: {e}")))
}

/// One device's memory, and this process's share of it. `pids` are this process's PIDs in
/// every PID namespace it belongs to: drivers report host PIDs in some containers.
pub fn read(device: &Device, pids: &[u32]) -> Result<NvmlReading> {
    let memory = device.memory_info().map_err(failed)?;
    let listed = device.running_compute_processes();
    let children = listed.as_ref().map(|processes| super::children::held_by_descendants(processes)).unwrap_or(0);
    let process = match listed {
        Ok(processes) => match processes.iter().find(|p| pids.contains(&p.pid)) {
            Some(p) => match p.used_gpu_memory {
                UsedGpuMemory::Used(bytes) => ProcessUse::Listed(bytes),
                UsedGpuMemory::Unavailable => ProcessUse::Unreported,
            },
            None => ProcessUse::NotListed,
        },
        Err(_) => ProcessUse::Unreported,
    };
    Ok(NvmlReading {
        total: memory.total,
        used: memory.used,
        free: memory.free,
        reserved: memory.reserved,
        process,
        children,
    })
}

/// Every descendant holding memory on these GPUs (torch index, UUID), with its command line.
pub fn still_holding<'a>(gpus: impl IntoIterator<Item = (u32, &'a str)>) -> Vec<super::children::ChildProcess> {
    let mut found = Vec::new();
    for (torch_index, uuid) in gpus {
        let Ok(device) = open(uuid) else { continue };
        let Ok(processes) = device.running_compute_processes() else { continue };
        for process in processes.into_iter().filter(|p| super::children::is_descendant(p.pid)) {
            let used = match process.used_gpu_memory {
                UsedGpuMemory::Used(bytes) => Some(bytes),
                UsedGpuMemory::Unavailable => None,
            };
            found.push(super::children::ChildProcess {
                pid: process.pid,
                command: super::host::process_command(process.pid),
                torch_index,
                used,
            });
        }
    }
    found
}
