//! Exact sizes on synthetic traces whose truth is known: blocks from before the recording freed
//! in it, and blocks cut whole from a free block, with and without the allocator's state at the
//! recording's start; and the bound of the error where sizes had to be inferred.

use super::*;

const MIB: u64 = 1 << 20;
/// Asked for 2.7 MB, given a 3.5 MiB block (cut whole from a free block: 0.9 MiB would have been
/// left, too little for the large pool to split off).
const OLD_REQUESTED: u64 = 2_700_000;
const OLD_BLOCK: u64 = 3 * MIB + MIB / 2;
const NEW_REQUESTED: u64 = 15 * MIB + MIB / 2;
const NEW_BLOCK: u64 = 16 * MIB + MIB / 2;

fn event(action: Action, addr: u64, size: u64, time_us: i64) -> Event {
    Event { action, addr, size, stream: 0, time_us, stack: 0, device_free: 0, annotation: None }
}

fn block(address: u64, size: u64, requested_size: u64, state: BlockState) -> SegmentBlock {
    SegmentBlock { address, size, requested_size, state, stack: 0 }
}

fn segment(blocks: Vec<SegmentBlock>) -> Segment {
    Segment { device: 0, address: 0, total_size: 20 * MIB, stream: 0, segment_type: "large".into(), blocks }
}

/// A 20 MiB segment holds `old` (from before the recording) and a free rest. The recording
/// sees: the rest allocated whole as `new`, `old` freed, a small tensor, `new` freed.
/// Returns the snapshot (the state at the end: one free segment) and torch's counter after
/// each event.
fn program(opening: bool) -> (AllocationHistory, Vec<u64>) {
    let events = vec![
        event(Action::Alloc, OLD_BLOCK, NEW_REQUESTED, 100),
        event(Action::FreeRequested, 0, OLD_REQUESTED, 110),
        event(Action::FreeCompleted, 0, OLD_REQUESTED, 111),
        event(Action::SegmentAlloc, 64 * MIB, 2 * MIB, 120),
        event(Action::Alloc, 64 * MIB, 1000, 121),
        event(Action::FreeRequested, OLD_BLOCK, NEW_REQUESTED, 130),
        event(Action::FreeCompleted, OLD_BLOCK, NEW_REQUESTED, 131),
    ];
    let truth = vec![OLD_BLOCK + NEW_BLOCK, NEW_BLOCK, NEW_BLOCK, NEW_BLOCK, NEW_BLOCK + 1024, 1024, 1024];
    let at_start = segment(vec![
        block(0, OLD_BLOCK, OLD_REQUESTED, BlockState::ActiveAllocated),
        block(OLD_BLOCK, NEW_BLOCK, 0, BlockState::Inactive),
    ]);
    let mut small = segment(vec![
        block(64 * MIB, 1024, 1000, BlockState::ActiveAllocated),
        block(64 * MIB + 1024, 2 * MIB - 1024, 0, BlockState::Inactive),
    ]);
    (small.address, small.total_size) = (64 * MIB, 2 * MIB);
    let snapshot = AllocationHistory {
        segments: vec![segment(vec![block(0, 20 * MIB, 0, BlockState::Inactive)]), small],
        device_traces: vec![events],
        gpuexp: Gpuexp {
            opening: opening.then(|| Opening { time_us: 90, max_entries: Some(1000), segments: vec![at_start] }),
            window: None,
            steps: None,
        },
        ..AllocationHistory::default()
    };
    (snapshot, truth)
}

#[test]
fn blocks_from_before_the_recording_freed_in_it_take_their_size_from_the_state_at_its_start() {
    let (snapshot, truth) = program(true);
    let replayed = replay(&snapshot, 0, None);
    assert_eq!(replayed.baseline, OLD_BLOCK, "the block from before, at its own size");
    assert_eq!(replayed.allocated, truth, "and the block cut whole from the free rest, at its size");
    assert_eq!(replayed.peak.bytes, OLD_BLOCK + NEW_BLOCK);
    assert_eq!((replayed.completeness.inferred_sizes, replayed.completeness.sized_from_opening), (0, 1));
    assert!(!replayed.completeness.may_have_wrapped, "every free explained: no wrap");
    assert_eq!(replayed.peak_bounds(0), None, "exact: no bound to give");
    let (rule, namer) = (SiteRule::default(), PlainNamer::default());
    let sites = peak_sites(&replayed, &Attribution::new(&snapshot.stacks, &rule, &namer), TOP_SITES);
    assert_eq!(sites.table.total, truth[0], "the rows add up to the peak");
    assert!(sites.exactness().is_empty(), "{:?}", sites.exactness());
}

#[test]
fn without_the_state_at_its_start_the_report_bounds_the_error_in_bytes_and_the_truth_lies_within() {
    let (snapshot, truth) = program(false);
    let replayed = replay(&snapshot, 0, None);
    let true_peak = *truth.iter().max().unwrap();
    assert!(replayed.peak.bytes < true_peak, "the inferred sizes fall short: this test shows the bound");
    assert_eq!(replayed.completeness.inferred_sizes, 2);
    let bounds = replayed.peak_bounds(0).expect("inferred sizes: a bound");
    assert!(bounds.at_least <= true_peak && true_peak <= bounds.at_most, "{bounds:?} vs {true_peak}");
    assert!(bounds.at_most - bounds.at_least <= 2 * MIB, "a mebibyte at most per block: {bounds:?}");
    let (rule, namer) = (SiteRule::default(), PlainNamer::default());
    let sites = peak_sites(&replayed, &Attribution::new(&snapshot.stacks, &rule, &namer), TOP_SITES);
    let said = sites.exactness().join("\n");
    assert!(said.contains("the true peak lies between") && said.contains("2 block sizes were inferred"), "{said}");
    assert!(sites.to_text().contains("note: 2 block sizes were inferred"), "{}", sites.to_text());
}

#[test]
fn a_wrapped_trace_does_not_use_a_state_that_no_longer_precedes_its_first_event() {
    let (mut snapshot, _) = program(true);
    snapshot.gpuexp.opening.as_mut().unwrap().max_entries = Some(7);
    let replayed = replay(&snapshot, 0, None);
    assert!(replayed.completeness.may_have_wrapped);
    assert_eq!(replayed.completeness.sized_from_opening, 0, "the state is older than the trace's start");
    assert!(replayed.peak_bounds(0).is_some(), "so the sizes are inferred, and bounded");
}

#[test]
fn torch_s_own_peak_saved_with_the_snapshot_is_told_where_the_replay_does_not_meet_it() {
    let (mut snapshot, truth) = program(false);
    snapshot.gpuexp.window = Some(Window { opened_us: 0, max_entries: None, peaks: vec![(0, truth[0])] });
    let traces = scope_traces(
        &snapshot,
        &[0],
        None,
        0,
        &Attribution::new(&snapshot.stacks, &SiteRule::default(), &PlainNamer::default()),
    );
    assert_eq!(traces[0].peak.true_peak, Some(truth[0]));
    assert!(traces[0].peak.exactness().iter().any(|line| line.starts_with("torch counted a peak of")));
    let (mut exact, _) = program(true);
    exact.gpuexp.window = snapshot.gpuexp.window.clone();
    let traces = scope_traces(
        &exact,
        &[0],
        None,
        0,
        &Attribution::new(&exact.stacks, &SiteRule::default(), &PlainNamer::default()),
    );
    assert!(traces[0].peak.exactness().is_empty(), "the replay meets torch's peak: nothing to say");
}
