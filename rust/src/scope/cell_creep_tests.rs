use super::*;
use crate::report::{CellGpu, CellMetric};

const MIB: u64 = 1 << 20;

/// A cell's record on one GPU: torch's allocated bytes from `start` to `end`.
fn cell(execution_count: u64, start: u64, end: u64) -> CellRecord {
    let metric = CellMetric {
        start,
        end,
        peak: start.max(end),
        consumed: end as i64 - start as i64,
        peak_above_start: end.saturating_sub(start),
    };
    let host = CellMetric { start: 0, end: 0, peak: 0, consumed: 0, peak_above_start: 0 };
    CellRecord {
        execution_count,
        started_at: 0.0,
        wall_s: 1.0,
        host,
        gpus: vec![CellGpu {
            torch_index: 0,
            uuid: "GPU-0".into(),
            torch_allocated: Some(metric),
            torch_reserved: None,
            process_used: None,
        }],
        notes: Vec::new(),
        peak_sites: Vec::new(),
    }
}

fn outs(items: u64) -> Vec<HolderReading> {
    vec![HolderReading { name: "outs".into(), items, tensor_bytes: items * 4 * MIB }]
}

/// Runs cells ending at `levels` (each starting where the last ended), the holder read at each
/// by `holders`; returns each cell's note.
fn run(levels: &[u64], holders: impl Fn(usize) -> Vec<HolderReading>) -> Vec<Option<String>> {
    let mut creep = CellCreep::default();
    let mut start = 100 * MIB;
    levels
        .iter()
        .enumerate()
        .map(|(i, &end)| {
            let note = creep.cell_ended(&cell(i as u64 + 1, start, end), holders(i));
            start = end;
            note
        })
        .collect()
}

#[test]
fn the_third_cell_in_a_row_that_ends_higher_growing_the_same_list_gets_the_note() {
    let notes = run(&[140 * MIB, 180 * MIB, 220 * MIB, 260 * MIB], |i| outs(10 * (i as u64 + 1)));
    assert_eq!(notes[0], None);
    assert_eq!(notes[1], None, "two cells are not yet a row");
    let note = notes[2].as_deref().expect("the third cell gets the note");
    assert!(note.contains("`outs`") && note.contains("In [1] to In [3]") && note.contains("cuda:0"), "{note}");
    assert!(note.contains("+120.00 MiB in all, about +40.00 MiB a run"), "{note}");
    assert!(note.contains("now 30 items, 120.00 MiB of tensors"), "{note}");
    assert!(notes[3].as_deref().is_some_and(|n| n.contains("In [2] to In [4]")), "{:?}", notes[3]);
}

#[test]
fn a_cell_that_ends_no_higher_breaks_the_row() {
    let notes = run(&[140 * MIB, 140 * MIB, 180 * MIB, 220 * MIB, 260 * MIB], |i| outs(10 * (i as u64 + 1)));
    assert_eq!(notes[..4], [None, None, None, None]);
    assert!(notes[4].as_deref().is_some_and(|n| n.contains("In [3] to In [5]")), "cells 3 to 5 are a row again");
    let small = run(&[100 * MIB + MIB / 2, 101 * MIB, 102 * MIB], |i| outs(i as u64 + 1));
    assert!(small.iter().all(Option::is_none), "a rise under 1 MiB is no creep: {small:?}");
}

#[test]
fn memory_that_rises_while_the_holder_stays_the_same_is_no_creep_of_that_holder() {
    let notes = run(&[140 * MIB, 180 * MIB, 220 * MIB], |_| outs(10));
    assert!(notes[1].is_none() && notes[2].is_none(), "{notes:?}");
    let without = run(&[140 * MIB, 180 * MIB, 220 * MIB], |i| if i == 1 { Vec::new() } else { outs(i as u64 + 1) });
    assert!(without.iter().all(Option::is_none), "a cell that grew no holder (or failed) breaks the row");
}

#[test]
fn a_cell_that_moved_nothing_in_between_is_passed_over() {
    let mut creep = CellCreep::default();
    let mut notes = Vec::new();
    for (count, start, end, items) in
        [(1, 100, 140, 1), (2, 140, 140, 0), (3, 140, 180, 2), (4, 180, 180, 0), (5, 180, 220, 3)]
    {
        let holders = if items > 0 { outs(items) } else { Vec::new() };
        notes.push(creep.cell_ended(&cell(count, start * MIB, end * MIB), holders));
    }
    let note =
        notes[4].as_deref().expect("cells 1, 3 and 5 are a row: a `print(len(outs))` between them moved nothing");
    assert!(note.contains("In [1] to In [5]"), "{note}");
}

#[test]
fn different_cells_growing_the_same_holder_count_and_the_holder_named_is_the_one_that_grew() {
    let notes = run(&[140 * MIB, 180 * MIB, 220 * MIB], |i| {
        let mut read = vec![HolderReading { name: "cache".into(), items: 5, tensor_bytes: 0 }];
        read.extend(outs(i as u64 + 1));
        read
    });
    let note = notes[2].as_deref().expect("a note");
    assert!(note.contains("`outs`") && !note.contains("`cache`"), "{note}");
}
