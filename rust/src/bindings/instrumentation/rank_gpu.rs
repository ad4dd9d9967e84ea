//! A rank's own GPU, and NCCL's share of what torch does not track there, read from
//! torch.distributed and torch.cuda (looked up, never imported; no CUDA context is created:
//! torch's current device is asked only once CUDA is initialised).

use pyo3::prelude::*;

use crate::bindings::ranks::{identity, process_group};
use crate::bindings::torch::PyTorch;
use crate::fork::PerProcess;
use crate::ranks::{rank_device, Because, DeviceClues, NcclShare};
use crate::snapshot::{nvml, Snapshot};

/// The NCCL share this process measured: a forked child's communicators are its own.
static NCCL: PerProcess<NcclShare> = PerProcess::new(NcclShare::default);

fn index_of(device: &Bound<PyAny>) -> Option<u32> {
    device.getattr("index").ok()?.extract().ok()
}

/// In a rank, its own GPU and why; None outside a rank, or where nothing points to one.
pub(in crate::bindings) fn own_gpu(py: Python) -> Option<(u32, Because)> {
    let group = process_group(py);
    let (rank, world_size) = identity(group.as_ref()).position()?;
    let visible = u32::try_from(nvml::visible_uuids().ok()?.len()).ok()?;
    let bound = group.as_ref().and_then(|(dist, _, _)| {
        let default = dist.getattr("distributed_c10d").ok()?.call_method0("_get_default_group").ok()?;
        index_of(&default.getattr("bound_device_id").ok()?)
    });
    let current = PyTorch::find(py).cuda().and_then(|cuda| cuda.call_method0("current_device").ok()?.extract().ok());
    let local_rank = std::env::var("LOCAL_RANK").ok().and_then(|v| v.trim().parse().ok());
    rank_device(&DeviceClues { bound, current, local_rank, rank, world_size, visible })
}

/// The GPU `explain`, `holders` and `estimate` mean by default, once CUDA is initialised: the
/// rank's own in a rank, else torch's current one. None before (the host).
#[pyfunction]
pub(in crate::bindings) fn default_device(py: Python) -> Option<u32> {
    let cuda = PyTorch::find(py).cuda()?;
    own_gpu(py).map(|(index, _)| index).or_else(|| cuda.call_method0("current_device").ok()?.extract().ok())
}

/// Whether the default group's NCCL communicator exists, where the group uses NCCL for CUDA;
/// None where that can't be told (no group, another backend, a torch without `_comm_ptr`).
fn nccl_communicator(py: Python) -> Option<bool> {
    let (dist, _, _) = process_group(py)?;
    let torch = PyTorch::find(py);
    torch.cuda()?;
    let device = torch.torch.as_ref()?.getattr("device").ok()?.call1(("cuda",)).ok()?;
    let group = dist.getattr("distributed_c10d").ok()?.call_method0("_get_default_group").ok()?;
    let backend = group.call_method1("_get_backend", (device,)).ok()?;
    if backend.get_type().name().ok()? != "ProcessGroupNCCL" {
        return None;
    }
    // Zero until the communicator of the current device exists (made at the first collective
    // of a lazily initialised group).
    Some(backend.call_method0("_comm_ptr").ok()?.extract::<i64>().ok()? != 0)
}

/// Notes a reading of the rank's residual (NVML process less torch reserved) on its GPU.
pub(in crate::bindings) fn observe_nccl(py: Python, snapshot: &Snapshot) {
    let Some(communicator) = nccl_communicator(py) else { return };
    let Some((index, _)) = own_gpu(py) else { return };
    NCCL.lock().observe_in(snapshot, index, communicator);
}

/// NCCL's share of the residual on `index`, where this process measured it.
pub(in crate::bindings) fn nccl_share(index: u32) -> Option<u64> {
    NCCL.lock().on(index)
}
