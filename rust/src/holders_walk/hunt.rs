//! A hunt in one memory, built on the walk: the live buffers the collector knows are what the walk
//! looks for, and what it found becomes the holders table, with what no path reaches and what the
//! tensors are to training. Also which memories a finished experiment hunts, and the order of
//! that hunt; the Python objects are the bindings' (`python_heap`, `hunt_roots`).

use std::collections::{HashMap, HashSet};

use super::{walk, Bounds, Buffer, Heap, Memory, Root, Survey};
use crate::report::{Holders, Metric, Report, Role, TensorRoles};
use crate::trace::HolderStorages;

/// What a finished experiment's GPU may keep above its start before a hunt names what holds it:
/// torch's allocator rounds, and small tensors come and go.
const GPU_SLACK: u64 = 1 << 20;
/// The same on the host, whose RSS moves with the interpreter's own allocations.
const HOST_SLACK: u64 = 64 << 20;
/// The smallest holder a finished experiment's report names.
pub const LEAK_MIN_BYTES: u64 = 1 << 20;

/// Walks from `roots` to the buffers of `memory`; `live` are those the collector knows there. On
/// a GPU the walk stops once each live buffer outside `exclude` is found; arrays are not known in
/// advance, so a host hunt walks everything it can reach.
pub fn survey<H: Heap>(
    heap: &mut H,
    memory: &Memory,
    roots: Vec<Root<H::Object>>,
    live: HashMap<Buffer, u64>,
    exclude: &HashSet<Buffer>,
    bounds: Bounds,
) -> Survey<H::Object> {
    let wanted: HashSet<Buffer> = live.keys().copied().filter(|b| !exclude.contains(b)).collect();
    let until = (*memory != Memory::Host).then_some(&wanted);
    let mut survey = walk(heap, roots, until, exclude, bounds);
    survey.live = live;
    survey
}

impl<O> Survey<O> {
    /// Bytes of live buffers outside `exclude` that no root reaches.
    pub fn unreachable(&self, exclude: &HashSet<Buffer>) -> u64 {
        self.live.iter().filter(|(b, _)| !exclude.contains(b) && !self.found.contains_key(b)).map(|(_, n)| n).sum()
    }

    /// Bytes of every tensor in the memory that has a Python object: the live ones, and those
    /// an autograd graph saved, which the walk gave one.
    pub fn python_bytes(&self) -> u64 {
        let saved: u64 = self.found.iter().filter(|(b, _)| !self.live.contains_key(b)).map(|(_, n)| n).sum();
        self.live.values().sum::<u64>() + saved
    }

    /// The holders table of `memory`: holders of `min_bytes` or more (counting what their graph
    /// saved), largest first, and what no root reaches.
    pub fn holders(
        &self,
        memory: &Memory,
        roles: TensorRoles,
        min_bytes: u64,
        exclude: &HashSet<Buffer>,
        seconds: f64,
    ) -> Holders {
        Holders {
            device: memory.label(),
            unreachable: self.unreachable(exclude),
            no_python_tensor: None,
            cached: None,
            roles: (roles.total() > 0).then_some(roles),
            objects_visited: self.objects_visited,
            skipped: self.skipped,
            truncated: self.truncated,
            partly_read: self.partly_read.clone(),
            seconds,
            min_bytes,
            holders: super::rolled(&self.held, &self.containers)
                .into_iter()
                .filter(|h| h.bytes + h.saved_for_backward >= min_bytes)
                .collect(),
        }
    }

    /// The storages each holder of `named` keeps on a GPU (by data pointer), for the trace to
    /// say where they were allocated; none on the host.
    pub fn holder_storages(&self, memory: &Memory, named: &Holders) -> Vec<HolderStorages> {
        let Memory::Cuda(torch_index) = *memory else { return Vec::new() };
        let mut by_path: Vec<HolderStorages> = Vec::new();
        for (buffer, holder) in &self.held {
            // An autograd graph charged to its tensor has no storage of its own (pointer 0).
            let Buffer::Storage(pointer) = *buffer else { continue };
            if pointer == 0 || !named.holders.iter().any(|h| h.path == holder.path) {
                continue;
            }
            let storage = (pointer as u64, holder.bytes);
            match by_path.iter_mut().find(|h| h.path == holder.path) {
                Some(known) => known.storages.push(storage),
                None => {
                    by_path.push(HolderStorages { torch_index, path: holder.path.clone(), storages: vec![storage] })
                }
            }
        }
        by_path
    }
}

/// Bytes by role of every buffer the survey saw outside `exclude`, each once: those `roles` names
/// (a module's or an optimizer's), then the named holders and live tensors as other tensors. What
/// a graph saved without a Python tensor of its own stays out, in explain's "no Python tensor",
/// as torch's figures see it.
pub fn sum_roles<O>(
    survey: &Survey<O>,
    roles: &HashMap<Buffer, (Role, u64)>,
    exclude: &HashSet<Buffer>,
) -> TensorRoles {
    let mut sums = TensorRoles::default();
    let mut counted = HashSet::new();
    for (buffer, (role, bytes)) in roles {
        if !exclude.contains(buffer) && counted.insert(*buffer) {
            sums.add(Some(*role), *bytes);
        }
    }
    for (buffer, holder) in &survey.held {
        if counted.insert(*buffer) {
            sums.add(None, holder.bytes);
        }
    }
    for (buffer, bytes) in &survey.live {
        if !exclude.contains(buffer) && counted.insert(*buffer) {
            sums.add(None, *bytes);
        }
    }
    sums
}

/// A GPU's table with torch's figures: what torch allocated that no Python tensor accounts for,
/// and what its allocator reserved without allocating.
pub fn add_torch_figures(holders: &mut Holders, allocated: u64, reserved: u64, python_bytes: u64) {
    holders.no_python_tensor = Some(allocated.saturating_sub(python_bytes));
    holders.cached = Some(reserved.saturating_sub(allocated));
}

/// Why `holders(device='cuda:N')` is refused where N is not among the `visible` GPUs: an empty
/// table would read as "nothing holds memory". None where it is visible.
pub fn no_such_gpu(index: u32, visible: &[u32]) -> Option<String> {
    if visible.contains(&index) {
        return None;
    }
    let fix = if visible.is_empty() {
        "This machine has no GPU that NVML can see: use device='cpu' for host memory.".to_string()
    } else {
        format!("Visible GPUs (torch indices): {visible:?}; name one of them, or device='cpu'.")
    };
    Some(format!("holders(device='cuda:{index}'): no such GPU. {fix}"))
}

/// The memories a finished experiment kept above its start by more than their slack: each GPU
/// by torch's allocated figure, then the host by its RSS.
pub fn leaked_memories(report: &Report) -> Vec<Memory> {
    let kept_above_start =
        |m: &Metric, slack: u64| m.end.is_some_and(|end| end as i64 - m.start as i64 >= slack as i64);
    let mut memories: Vec<Memory> = report
        .gpus
        .iter()
        .filter(|gpu| gpu.torch_allocated.as_ref().is_some_and(|m| kept_above_start(m, GPU_SLACK)))
        .map(|gpu| Memory::Cuda(gpu.torch_index))
        .collect();
    if kept_above_start(&report.host.rss, HOST_SLACK) {
        memories.push(Memory::Host);
    }
    memories
}

/// What a leak hunt found: the holders on each memory, and the storages each keeps on a GPU.
pub type Leaks = (Vec<Holders>, Vec<HolderStorages>);

/// Names what still holds memory a finished experiment created: `hunt` runs on each memory
/// [`leaked_memories`] gives, and a memory where it named nothing is left out.
pub fn hunt_leaks<E>(
    report: &Report,
    mut hunt: impl FnMut(Memory) -> Result<(Holders, Vec<HolderStorages>), E>,
) -> Result<Leaks, E> {
    let (mut found, mut storages) = Leaks::default();
    for memory in leaked_memories(report) {
        let (holders, kept) = hunt(memory)?;
        if !holders.holders.is_empty() || holders.unreachable > 0 {
            found.push(holders);
            storages.extend(kept);
        }
    }
    Ok((found, storages))
}

#[cfg(test)]
#[path = "hunt_tests.rs"]
mod tests;
