//! A hunt's tables from surveys built by hand, and which memories a finished experiment hunts.

use super::*;
use crate::report::{test_tensor as holder, Details, Holder, Span};
use crate::snapshot::testing::{gpu, host, torch, GIB};
use crate::snapshot::{GpuReading, Snapshot};

const MIB: u64 = 1 << 20;

fn survey(held: Vec<(Buffer, Holder)>, found: &[(usize, u64)], live: &[(usize, u64)]) -> Survey<()> {
    Survey {
        held,
        containers: Vec::new(),
        found: found.iter().map(|(s, n)| (Buffer::Storage(*s), *n)).collect(),
        live: live.iter().map(|(s, n)| (Buffer::Storage(*s), *n)).collect(),
        owners: Vec::new(),
        owner_paths: Vec::new(),
        objects_visited: 42,
        skipped: 1,
        truncated: false,
        partly_read: Vec::new(),
    }
}

#[test]
fn unreachable_is_live_memory_no_root_reached_outside_the_exclusions() {
    let found = survey(Vec::new(), &[(1, 10)], &[(1, 10), (2, 20), (3, 40)]);
    assert_eq!(found.unreachable(&HashSet::new()), 60);
    assert_eq!(found.unreachable(&HashSet::from([Buffer::Storage(3)])), 20);
}

#[test]
fn python_bytes_are_the_live_tensors_and_what_a_graph_saved() {
    // Storage 9 was saved by a graph: the walk reached it, the collector does not list it.
    let found = survey(Vec::new(), &[(1, 10), (9, 5)], &[(1, 10), (2, 20)]);
    assert_eq!(found.python_bytes(), 35);
}

#[test]
fn the_table_keeps_holders_of_min_bytes_counting_what_their_graph_saved() {
    let held = vec![
        (Buffer::Storage(1), holder("big", 4 * MIB, 0)),
        (Buffer::Storage(2), holder("saves", 0, 2 * MIB)),
        (Buffer::Storage(3), holder("small", MIB / 2, 0)),
    ];
    let found = survey(held, &[(1, 4 * MIB), (2, 0), (3, MIB / 2)], &[(1, 4 * MIB), (4, 8 * MIB)]);
    let roles = TensorRoles { parameters: MIB, ..TensorRoles::default() };
    let table = found.holders(&Memory::Cuda(0), roles, MIB, &HashSet::new(), 0.5);
    let paths: Vec<&str> = table.holders.iter().map(|h| h.path.as_str()).collect();
    assert_eq!(paths, ["big", "saves"]);
    assert_eq!((table.device.as_str(), table.unreachable, table.min_bytes), ("cuda:0", 8 * MIB, MIB));
    assert_eq!((table.objects_visited, table.skipped, table.roles), (42, 1, Some(roles)));
    let none = found.holders(&Memory::Host, TensorRoles::default(), MIB, &HashSet::new(), 0.5);
    assert_eq!((none.device.as_str(), none.roles), ("host", None));
}

#[test]
fn storages_are_given_per_named_holder_on_a_gpu_only() {
    let held = vec![
        (Buffer::Storage(0x1000), holder("cache", 2 * MIB, 0)),
        (Buffer::Storage(0x9000), holder("cache", MIB, 0)),
        // A graph charged to its tensor: no storage of its own.
        (Buffer::Storage(0), holder("preds", 0, 4 * MIB)),
        (Buffer::Storage(0x5000), holder("too_small", 1, 0)),
    ];
    let found = survey(held, &[], &[]);
    let table = found.holders(&Memory::Cuda(1), TensorRoles::default(), MIB, &HashSet::new(), 0.0);
    let storages = found.holder_storages(&Memory::Cuda(1), &table);
    assert_eq!(
        storages,
        [HolderStorages { torch_index: 1, path: "cache".into(), storages: vec![(0x1000, 2 * MIB), (0x9000, MIB)] }]
    );
    assert!(found.holder_storages(&Memory::Host, &table).is_empty());
}

#[test]
fn roles_count_each_storage_once_named_roles_first_and_skip_exclusions() {
    let held = vec![(Buffer::Storage(1), holder("model.weight", 10, 0)), (Buffer::Storage(2), holder("x", 20, 0))];
    let found = survey(held, &[], &[(1, 10), (2, 20), (3, 40), (4, 80)]);
    let roles = HashMap::from([(Buffer::Storage(1), (Role::Parameter, 10)), (Buffer::Storage(5), (Role::Gradient, 7))]);
    let sums = sum_roles(&found, &roles, &HashSet::from([Buffer::Storage(4)]));
    assert_eq!((sums.parameters, sums.gradients, sums.other_tensors), (10, 7, 60));
}

#[test]
fn torch_figures_never_go_negative() {
    let mut table = Holders::default();
    add_torch_figures(&mut table, 100, 300, 150);
    assert_eq!((table.no_python_tensor, table.cached), (Some(0), Some(200)));
}

#[test]
fn a_gpu_not_visible_is_refused_with_the_ones_that_are() {
    assert_eq!(no_such_gpu(1, &[0, 1]), None);
    let said = no_such_gpu(3, &[0, 1]).unwrap();
    assert!(said.starts_with("holders(device='cuda:3'): no such GPU.") && said.contains("[0, 1]"), "{said}");
    assert!(no_such_gpu(0, &[]).unwrap().contains("no GPU that NVML can see"));
}

fn with_allocated(index: u32, allocated: u64) -> GpuReading {
    GpuReading { torch: Some(torch(allocated, allocated, allocated, allocated)), ..gpu(index, &format!("GPU-{index}")) }
}

fn finished(start: Snapshot, end: Snapshot) -> Report {
    let span = Span { start: &start, before_teardown: &end, end: Some(&end) };
    Report::build("leaky", true, span, |_| None, Details::default())
}

#[test]
fn a_memory_is_hunted_where_it_kept_more_than_its_slack() {
    let start = host(0.0, GIB, GIB).with_gpu(with_allocated(0, 0)).with_gpu(with_allocated(1, 0));
    let end = host(1.0, GIB + 63 * MIB, GIB).with_gpu(with_allocated(0, MIB)).with_gpu(with_allocated(1, MIB - 1));
    assert_eq!(leaked_memories(&finished(start.clone(), end)), [Memory::Cuda(0)]);
    let end = host(1.0, GIB + 64 * MIB, GIB).with_gpu(with_allocated(0, 0)).with_gpu(with_allocated(1, 0));
    assert_eq!(leaked_memories(&finished(start, end)), [Memory::Host]);
}

#[test]
fn a_leak_hunt_keeps_only_the_memories_where_it_named_something() {
    let start = host(0.0, GIB, GIB).with_gpu(with_allocated(0, 0)).with_gpu(with_allocated(1, 0));
    let end = host(1.0, GIB, GIB).with_gpu(with_allocated(0, GIB)).with_gpu(with_allocated(1, GIB));
    let mut hunted = Vec::new();
    let (found, storages) = hunt_leaks(&finished(start, end), |memory| {
        hunted.push(memory.clone());
        let mut table = Holders { device: memory.label(), ..Holders::default() };
        let storages = match memory {
            Memory::Cuda(1) => {
                table.unreachable = GIB;
                vec![HolderStorages { torch_index: 1, path: "x".into(), storages: vec![(1, 1)] }]
            }
            _ => Vec::new(),
        };
        Ok::<_, ()>((table, storages))
    })
    .unwrap();
    assert_eq!(hunted, [Memory::Cuda(0), Memory::Cuda(1)]);
    assert_eq!(found.iter().map(|h| h.device.as_str()).collect::<Vec<_>>(), ["cuda:1"]);
    assert_eq!(storages.len(), 1);
}
