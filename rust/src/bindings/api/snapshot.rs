//! Snapshots as the bindings take them: torch read through Python, NVML either fresh or from
//! the sampler's latest sample, peaks folded in; and the sampler kept running over what is needed.

use std::sync::atomic::{AtomicU64, Ordering};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::bindings::rank_gpu;
use crate::bindings::registry::registry;
use crate::bindings::report::SnapshotPy;
use crate::bindings::torch::PyTorch;
use crate::error::Result;
use crate::peak_sampler;
use crate::snapshot::nvml::{self, NvmlReading};
use crate::snapshot::{host, GpuIdent, GpuSelection, HostReading, NvmlSource, Snapshot};

/// Readings taken outside the cell log. Each means gpuexp is doing something (opening a
/// scope, tearing one down, showing a snapshot), so the next cell reads its own start.
static OTHER_READINGS: AtomicU64 = AtomicU64::new(0);

pub(in crate::bindings) fn other_readings() -> u64 {
    OTHER_READINGS.load(Ordering::Relaxed)
}

pub(in crate::bindings) fn take_snapshot<'py>(py: Python<'py>, selection: &GpuSelection) -> (Snapshot, PyTorch<'py>) {
    OTHER_READINGS.fetch_add(1, Ordering::Relaxed);
    let (snapshot, torch) = snapshot_from(py, host::read(), selection, &|_, device, pids| nvml::read(device, pids));
    rank_gpu::observe_nccl(py, &snapshot);
    (snapshot, torch)
}

/// A snapshot for the per-cell log: this process's host memory only (a cell's record shows
/// nothing else), and NVML figures from the sampler's latest sample (at most two intervals old)
/// where it has one, since reading the driver again after every cell would cost more than the
/// rest of the cell log.
pub(in crate::bindings) fn take_cell_snapshot<'py>(
    py: Python<'py>,
    selection: &GpuSelection,
) -> (Snapshot, PyTorch<'py>) {
    snapshot_from(py, host::read_process(), selection, &sampled_nvml)
}

/// A running cell's live view: as for the cell log, but with the system's memory, which its
/// RAM bar is drawn against.
pub(in crate::bindings) fn take_live_snapshot<'py>(
    py: Python<'py>,
    selection: &GpuSelection,
) -> (Snapshot, PyTorch<'py>) {
    snapshot_from(py, host::read(), selection, &sampled_nvml)
}

fn sampled_nvml(ident: &GpuIdent, device: &nvml_wrapper::Device<'static>, pids: &[u32]) -> Result<NvmlReading> {
    match peak_sampler::latest(&ident.uuid) {
        Some(reading) => Ok(reading),
        None => nvml::read(device, pids),
    }
}

/// A snapshot with its NVML figures from `read_nvml`, and peaks raised to what the sampler saw.
fn snapshot_from<'py>(
    py: Python<'py>,
    host: HostReading,
    selection: &GpuSelection,
    read_nvml: &NvmlSource,
) -> (Snapshot, PyTorch<'py>) {
    let torch = PyTorch::find(py);
    let mut snapshot = Snapshot::take(host, selection, &torch, read_nvml);
    peak_sampler::apply(&mut snapshot);
    (snapshot, torch)
}

/// Starts new peak windows: what the counters saw was just folded into the open windows.
pub(in crate::bindings) fn reset_counters(torch: &PyTorch, snapshot: &Snapshot) {
    host::reset_peak(&snapshot.host);
    torch.reset_peaks(snapshot);
    peak_sampler::reset(snapshot);
}

/// Runs the sampler over what gpuexp needs now. While a window is open or about to open
/// (`opening`), or the cell log is on, that is host RSS where VmHWM can't be reset, and the
/// GPUs when a window or the log covers them. The thread stays up between logged cells, so a
/// cell never pays for starting it. Returns whether a thread was started anew.
///
/// The caller must not hold the registry: the GIL is released here, and a thread that held
/// the registry while waiting for the GIL back would deadlock with one holding the GIL while
/// waiting for the registry.
pub(in crate::bindings) fn update_sampler(py: Python, opening: Option<&Snapshot>) -> bool {
    let sources = {
        let registry = registry();
        let log_gpus = registry.cell_log_active() && registry.cell_selection() != GpuSelection::None;
        let needed = opening.is_some() || registry.has_windows() || registry.cell_log_active();
        let gpu_wanted = registry.has_gpu_windows() || log_gpus || opening.is_some_and(|s| !s.gpus.is_empty());
        let gpus = match opening {
            _ if !(needed && gpu_wanted) => Vec::new(),
            Some(s) if !s.gpus.is_empty() => s.gpus.iter().map(|g| g.uuid.clone()).collect(),
            _ => peak_sampler::sampled_gpus(),
        };
        peak_sampler::Sources { host: needed && !host::peak_reset_supported(), gpus }
    };
    // Most cells find the sampler as they need it. Releasing the GIL for nothing is not free in
    // a kernel: ipykernel's IO thread takes it and the cell waits for it back (measured: +0.2 ms
    // per trivial cell). Joining with the GIL held would be safe too (the sampler never takes
    // it), but other Python threads need not wait for a join.
    if peak_sampler::is_as_needed(&sources) {
        return false;
    }
    py.detach(|| peak_sampler::ensure(sources))
}

/// The snapshot a window opens at, taken by `take`. A sampler started for it starts first,
/// so that the thread's own memory (its stack, NVML's per-thread state) is not charged to
/// the window.
pub(in crate::bindings) fn opening_snapshot<'py>(
    py: Python<'py>,
    selection: &GpuSelection,
    take: fn(Python<'py>, &GpuSelection) -> (Snapshot, PyTorch<'py>),
) -> (Snapshot, PyTorch<'py>) {
    let (probe, torch) = take(py, selection);
    if update_sampler(py, Some(&probe)) {
        take(py, selection)
    } else {
        (probe, torch)
    }
}

pub(in crate::bindings) fn selection(gpu: bool, devices: Option<Vec<u32>>) -> GpuSelection {
    match (gpu, devices) {
        (false, _) => GpuSelection::None,
        (true, None) => GpuSelection::AllVisible,
        (true, Some(devices)) => GpuSelection::Only(devices),
    }
}

pub(in crate::bindings) fn check_devices(py: Python, wanted: &[u32]) -> PyResult<()> {
    let (all, _) = take_snapshot(py, &GpuSelection::AllVisible);
    if nvml::available().is_err() {
        return Ok(());
    }
    let visible: Vec<u32> = all.gpus.iter().map(|g| g.torch_index).collect();
    match wanted.iter().find(|d| !visible.contains(d)) {
        None => Ok(()),
        Some(bad) => Err(PyValueError::new_err(format!(
            "devices=[{bad}]: no such GPU. Visible GPUs (torch indices): {visible:?}; \
             pass indices from that list, or devices=None for all of them."
        ))),
    }
}

/// The current state of the host and (with `gpu`) every visible GPU.
#[pyfunction]
#[pyo3(signature = (gpu=true))]
pub(in crate::bindings) fn snapshot(py: Python, gpu: bool) -> SnapshotPy {
    SnapshotPy { snapshot: take_snapshot(py, &selection(gpu, None)).0, title: "snapshot".into() }
}
