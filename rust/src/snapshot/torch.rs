//! What gpuexp reads from torch's CUDA caching allocator. Torch is reached through its Python
//! API (the bindings implement [`TorchProbe`]); this module only knows the figures.

use serde::Serialize;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TorchStats {
    pub allocated: u64,
    pub reserved: u64,
    /// Highest `allocated` since torch's peak counters were last reset.
    pub peak_allocated: u64,
    /// Highest `reserved` since torch's peak counters were last reset.
    pub peak_reserved: u64,
    pub num_ooms: u64,
}

/// Access to torch for one snapshot. Implementations never import torch and never create a
/// CUDA context: when torch is absent or CUDA is not initialised they answer from what exists.
pub trait TorchProbe {
    /// Whether the user's process has imported torch.
    fn imported(&self) -> bool;
    /// UUIDs of the devices torch sees, by torch index, once torch has initialised CUDA.
    fn device_uuids(&self) -> Option<Vec<String>>;
    /// Allocator figures of one torch device: None when torch is not imported, all zeros
    /// when CUDA is not initialised (no allocation can exist yet).
    fn stats(&self, torch_index: u32) -> Option<TorchStats>;
}
