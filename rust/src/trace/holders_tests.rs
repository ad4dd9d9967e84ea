//! The leak hunter's holders matched to the blocks still held, by where their storages lie, and
//! the report naming each holder's allocation line next to it.

use super::tests::Program;
use super::*;
use crate::report::{Details, Holder, Holders, Report, Span};
use crate::snapshot::testing::host;

const MIB: u64 = 1 << 20;
const USER: &str = "/home/u/train.py";

/// Three blocks left at the end: 64 MiB at line 5, 32 MiB at line 6, 16 MiB at line 7.
fn left_held() -> (Vec<DeviceTrace>, [u64; 3]) {
    let mut p = Program::new();
    let mut addresses = [0; 3];
    for (i, (line, size)) in [(5, 64), (6, 32), (7, 16)].into_iter().enumerate() {
        let stack = p.line(line);
        addresses[i] = p.alloc(size * MIB, stack, &format!("{USER}:{line}"));
    }
    let (snapshot, _, _) = p.snapshot(0);
    let (rule, namer) = (SiteRule::default(), PlainNamer::default());
    let attribution = Attribution::new(&snapshot.stacks, &rule, &namer);
    (scope_traces(&snapshot, &[0], None, i64::MIN, &attribution), addresses)
}

fn holder(path: &str, bytes: u64) -> Holder {
    Holder {
        path: path.into(),
        bytes,
        saved_for_backward: 0,
        device: "cuda:0".into(),
        kind: "tensor".into(),
        shape: String::new(),
    }
}

#[test]
fn a_storage_is_matched_to_the_block_it_lies_in_on_its_own_gpu() {
    let (mut devices, [at5, _, at7]) = left_held();
    let storages = |torch_index: u32, path: &str, pointer: u64| HolderStorages {
        torch_index,
        path: path.into(),
        storages: vec![(pointer, MIB)],
    };
    name_holders(
        &mut devices,
        &[
            storages(0, "cache[0]", at5),
            // A view's storage starts inside its block.
            storages(0, "leak", at7 + 4096),
            storages(0, "ghost", 7),
            storages(1, "elsewhere", at5),
        ],
    );
    let holders: Vec<(u64, Vec<String>)> =
        devices[0].still_held.iter().map(|block| (block.bytes, block.holders.clone())).collect();
    assert_eq!(
        holders,
        [(64 * MIB, vec!["cache[0]".to_string()]), (32 * MIB, Vec::new()), (16 * MIB, vec!["leak".to_string()])],
        "largest first, a pointer past every block and another GPU's holder match nothing"
    );
    let json = serde_json::to_value(&devices[0].still_held).unwrap();
    assert_eq!(json[0]["holders"], serde_json::json!(["cache[0]"]));
    assert!(json[1].get("holders").is_none(), "no holder: no key");
}

#[test]
fn the_report_names_each_holder_s_allocation_line_and_keeps_the_rest_apart() {
    let (mut devices, [at5, _, at7]) = left_held();
    let held =
        |path: &str, pointer: u64| HolderStorages { torch_index: 0, path: path.into(), storages: vec![(pointer, MIB)] };
    name_holders(&mut devices, &[held("cache[0]", at5), held("leak", at7)]);
    let start = host(0.0, MIB, MIB);
    let span = Span { start: &start, before_teardown: &start, end: Some(&start) };
    let mut report = Report::build("leaky", true, span, |_| None, Details::default());
    report.trace = devices;
    report.holders.push(Holders {
        device: "cuda:0".into(),
        holders: vec![holder("cache[0]", 64 * MIB), holder("leak", 16 * MIB), holder("unmatched", 2 * MIB)],
        ..Holders::default()
    });
    let lines = report.grid().lines;
    let expected = format!(
        "still held on cuda:0: cache[0] (64.00 MiB, allocated at {USER}:5), leak (16.00 MiB, allocated at {USER}:7), \
         unmatched (2.00 MiB)"
    );
    assert!(lines.contains(&expected), "{lines:#?}");
    let apart = format!("still held on cuda:0, allocated at: {USER}:6 (32.00 MiB)");
    assert!(lines.contains(&apart), "only the block no holder keeps: {lines:#?}");
}
