use super::*;

const KIB: f64 = 1024.0;
const MIB: f64 = KIB * 1024.0;
const GIB: f64 = MIB * 1024.0;

fn b(n: f64) -> Option<u64> {
    Some(n.round() as u64)
}

// Messages as torch raised them, copied from users' reports.

/// Torch 2.1: "capacty", another process listed, no "this process" line (a container's pid).
const TORCH_2_1: &str = "CUDA out of memory. Tried to allocate 224.00 MiB. GPU 0 has a total capacty of 14.75 GiB \
    of which 11.06 MiB is free. Process 3258 has 14.73 GiB memory in use. Of the allocated memory 14.04 GiB is \
    allocated by PyTorch, and 509.85 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory \
    is large try setting max_split_size_mb to avoid fragmentation.  See documentation for Memory Management and \
    PYTORCH_CUDA_ALLOC_CONF";

/// Torch 2.1 with both lines, and a small reserved figure in KiB.
const TORCH_2_1_BOTH: &str = "CUDA out of memory. Tried to allocate 32.00 GiB. GPU 0 has a total capacty of 23.69 GiB \
    of which 14.12 GiB is free. Process 2006998 has 256.00 MiB memory in use. Including non-PyTorch memory, this \
    process has 9.30 GiB memory in use. Of the allocated memory 9.00 GiB is allocated by PyTorch, and 982.50 KiB is \
    reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting max_split_size_mb \
    to avoid fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF";

/// Torch 2.2 on, under `set_per_process_memory_fraction`, another process beside.
const TORCH_2_X_ALLOWED: &str = "CUDA out of memory. Tried to allocate 996.00 MiB. GPU 0 has a total capacity of \
    44.43 GiB of which 9.06 GiB is free. Process 2102129 has 17.54 GiB memory in use. Including non-PyTorch memory, \
    this process has 17.81 GiB memory in use. 17.69 GiB allowed; Of the allocated memory 17.44 GiB is allocated by \
    PyTorch, and 59.88 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try \
    setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation. See documentation for Memory \
    Management (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)";

/// A later torch: CUDA graphs' private pools, NVML's "unknown" use, the newer documentation link.
const TORCH_2_X_POOLS: &str = "CUDA out of memory. Tried to allocate 76.00 MiB. GPU 0 has a total capacity of 255.69 GiB \
    of which 252.82 GiB is free. Including non-PyTorch memory, this process has 17179869184.00 GiB memory in use. \
    1.20 GiB allowed; Of the allocated memory 1.14 GiB is allocated by PyTorch, with 17.00 MiB allocated in private \
    pools (e.g., CUDA Graphs), and 18.63 MiB is reserved by PyTorch but unallocated. If reserved but unallocated \
    memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See \
    documentation for Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)";

/// Torch 2.0 and older.
const TORCH_2_0: &str = "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 1; 79.19 GiB total capacity; 77.71 GiB \
    already allocated; 3.06 MiB free; 7.00 GiB allowed; 78.40 GiB reserved in total by PyTorch) If reserved memory \
    is >> allocated memory try setting max_split_size_mb to avoid fragmentation.";

#[test]
fn torch_2_1s_message_is_read_with_its_spelling() {
    let m = OomMessage::parse(TORCH_2_1);
    assert_eq!(m.requested, b(224.0 * MIB));
    assert_eq!(m.device, Some(0));
    assert_eq!(m.capacity, b(14.75 * GIB));
    assert_eq!(m.free, b(11.06 * MIB));
    assert_eq!(m.process_used, None);
    assert_eq!(m.others, [(3258, (14.73 * GIB).round() as u64)]);
    assert_eq!(m.allowed, None);
    assert_eq!(m.allocated, b(14.04 * GIB));
    assert_eq!(m.reserved_unallocated, b(509.85 * MIB));

    let m = OomMessage::parse(TORCH_2_1_BOTH);
    assert_eq!(m.requested, b(32.0 * GIB));
    assert_eq!(m.process_used, b(9.30 * GIB));
    assert_eq!(m.others, [(2006998, (256.0 * MIB) as u64)]);
    assert_eq!(m.allocated, b(9.00 * GIB));
    assert_eq!(m.reserved_unallocated, b(982.50 * KIB));
}

#[test]
fn the_memory_fractions_allowed_figure_and_private_pools_are_read() {
    let m = OomMessage::parse(TORCH_2_X_ALLOWED);
    assert_eq!(m.capacity, b(44.43 * GIB));
    assert_eq!(m.free, b(9.06 * GIB));
    assert_eq!(m.process_used, b(17.81 * GIB));
    assert_eq!(m.others, [(2102129, (17.54 * GIB).round() as u64)]);
    assert_eq!(m.allowed, b(17.69 * GIB));
    assert_eq!(m.allocated, b(17.44 * GIB));
    assert_eq!(m.reserved_unallocated, b(59.88 * MIB));

    let m = OomMessage::parse(TORCH_2_X_POOLS);
    assert_eq!(m.process_used, None, "17179869184.00 GiB is NVML's unknown, no figure");
    assert_eq!(m.allowed, b(1.20 * GIB));
    assert_eq!(m.allocated, b(1.14 * GIB), "torch's figure counts the private pools already");
    assert_eq!(m.reserved_unallocated, b(18.63 * MIB));
    assert!(m.others.is_empty());
}

#[test]
fn torch_2_0s_message_gives_the_same_figures() {
    let m = OomMessage::parse(TORCH_2_0);
    assert_eq!(m.requested, b(20.0 * MIB));
    assert_eq!(m.device, Some(1));
    assert_eq!(m.capacity, b(79.19 * GIB));
    assert_eq!(m.free, b(3.06 * MIB));
    assert_eq!(m.allowed, b(7.0 * GIB));
    assert_eq!(m.allocated, b(77.71 * GIB));
    assert_eq!(m.reserved_unallocated, Some(b(78.40 * GIB).unwrap() - b(77.71 * GIB).unwrap()));
}

#[test]
fn a_message_without_figures_gives_none() {
    assert_eq!(OomMessage::parse("CUDA error: out of memory"), OomMessage::default());
    let m = OomMessage::parse("Tried to allocate lots of GPU memory");
    assert_eq!((m.requested, m.allocated, m.free), (None, None, None));
    let small = OomMessage::parse("CUDA out of memory. Tried to allocate 512 bytes. GPU 2 has a total capacity of 0 bytes of which 0 bytes is free.");
    assert_eq!((small.requested, small.device, small.free), (Some(512), Some(2), Some(0)));
}
