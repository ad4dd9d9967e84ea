use super::*;
use crate::trace::{replay, Event, PlainNamer, SiteRule};

const MIB: u64 = 1 << 20;

fn event(action: Action, addr: u64, size: u64, time_us: i64) -> Event {
    Event { action, addr, size, stream: 0, time_us, stack: 0, device_free: 0, annotation: None }
}

/// A step that held 4 MiB and ended at t=10, then 2 × 8 MiB and 1 × 2 MiB made, then an
/// OOM asking 64 MiB at t=30.
fn snapshot() -> AllocationHistory {
    AllocationHistory {
        device_traces: vec![vec![
            event(Action::Alloc, 0x1000_0000, 4 * MIB, 5),
            event(Action::Alloc, 0x2000_0000, 8 * MIB, 20),
            event(Action::Alloc, 0x3000_0000, 8 * MIB, 21),
            event(Action::Alloc, 0x4000_0000, 2 * MIB, 22),
            event(Action::Oom, 0, 64 * MIB, 30),
        ]],
        ..AllocationHistory::default()
    }
}

fn read(step: Option<StepEnd>, asked: Option<u64>) -> Option<OomRecord> {
    let snapshot = snapshot();
    let replayed = replay(&snapshot, 0, None);
    let (rule, namer) = (SiteRule::default(), PlainNamer::default());
    read_oom(&snapshot, &replayed, asked, step, &Attribution::new(&snapshot.stacks, &rule, &namer))
}

#[test]
fn what_grew_since_the_last_step_and_the_live_blocks_by_size_come_from_a_stackless_record() {
    let step = StepEnd { kind: StepKind::OptimizerStep, time_us: 10, level: None };
    let found = read(Some(step), Some(64 * MIB)).expect("the OOM is in the record");
    assert!(found.sites.is_none());
    assert_eq!(
        found.since_step,
        SinceStep::Grew {
            step,
            failed_us: 30,
            held_then: 4 * MIB,
            held_at_failure: 22 * MIB,
            made_since: Some(18 * MIB),
            blocks_since: Some(3),
            later_steps: 0,
        }
    );
    let live = found.live.expect("live blocks by size");
    assert_eq!((live.total, live.blocks, live.made_since_step), (22 * MIB, 4, Some(18 * MIB)));
    assert_eq!(live.largest[0], SizeGroup { bytes: 8 * MIB, count: 2 });
    let text = format!("{}\n{}", found.since_step.describe(), live.describe());
    assert!(text.contains("since the last completed optimizer step") && text.contains("(+18.00 MiB)"), "{text}");
    assert!(text.contains("2 × 8.00 MiB, 1 × 4.00 MiB, 1 × 2.00 MiB of 22.00 MiB in 4 blocks"), "{text}");
}

#[test]
fn without_a_step_or_before_the_record_it_says_so() {
    let none = read(None, None).expect("the OOM is in the record");
    assert_eq!(none.since_step, SinceStep::NoStep);
    assert!(none.since_step.describe().contains("none completed"));
    assert_eq!(none.live.and_then(|l| l.made_since_step), None);
    let early = StepEnd { kind: StepKind::Cell, time_us: 1, level: None };
    let before = read(Some(early), None).expect("the OOM is in the record");
    assert_eq!(before.since_step, SinceStep::BeforeRecord { step: early });
    assert!(before.since_step.describe().contains("before the allocation record's first event"));
}

#[test]
fn an_oom_of_another_size_is_not_the_one_the_message_names() {
    assert!(read(None, Some(4 << 30)).is_none());
}

#[test]
fn a_step_end_is_kept_until_the_next_one() {
    let _alone = TESTS_ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    step_ended(StepKind::Cell, 100, None);
    step_ended(StepKind::OptimizerStep, 200, None);
    assert_eq!(last_step(), Some(StepEnd { kind: StepKind::OptimizerStep, time_us: 200, level: None }));
    assert_eq!(StepKind::parse("trainer step"), Some(StepKind::TrainerStep));
    assert_eq!(StepKind::parse("epoch"), None);
}

#[test]
fn after_the_history_an_oom_counts_from_the_last_level_and_the_allocators_state() {
    use crate::trace::{Segment, SegmentBlock};
    let level = Level { torch_index: 0, allocated: 4 * MIB };
    let step = StepEnd { kind: StepKind::OptimizerStep, time_us: 10, level: Some(level) };
    let grew = since_level(Some((step, 0)), 0, 30, 22 * MIB);
    assert!(matches!(grew, SinceStep::Grew { held_then, made_since: None, .. } if held_then == 4 * MIB));
    let text = grew.describe();
    assert!(text.contains("(+18.00 MiB)") && text.contains("which blocks grew is not known"), "{text}");
    let older = since_level(Some((step, 3)), 0, 30, 22 * MIB).describe();
    assert!(older.contains("with a level read, 3 steps before the last"), "{older}");
    assert!(matches!(since_level(Some((step, 0)), 1, 30, MIB), SinceStep::Unknown { .. }), "another GPU's level");
    assert_eq!(since_level(None, 0, 30, MIB), SinceStep::NoStep);
    let block = |size, state| SegmentBlock { address: 0, size, requested_size: size, state, stack: 0 };
    let state = AllocationHistory {
        segments: vec![Segment {
            device: 0,
            address: 0,
            total_size: 32 * MIB,
            stream: 0,
            segment_type: "large".into(),
            blocks: vec![
                block(8 * MIB, BlockState::ActiveAllocated),
                block(8 * MIB, BlockState::ActiveAllocated),
                block(2 * MIB, BlockState::ActivePendingFree),
                block(14 * MIB, BlockState::Inactive),
            ],
        }],
        ..AllocationHistory::default()
    };
    let live = live_in_state(&state, 0);
    assert_eq!(
        (live.total, live.blocks, live.largest.clone()),
        (16 * MIB, 2, vec![SizeGroup { bytes: 8 * MIB, count: 2 }])
    );
    assert_eq!(live_in_state(&state, 1).blocks, 0);
}

#[test]
fn levels_read_at_step_and_cell_ends_go_to_their_devices_series() {
    let _alone = TESTS_ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // A device no other test reads, since the record is one per process.
    let level = |allocated| Some(Level { torch_index: 7, allocated });
    step_ended(StepKind::OptimizerStep, 1_000, level(10 * MIB));
    step_ended(StepKind::OptimizerStep, 2_000, None);
    step_ended(StepKind::OptimizerStep, 3_000, level(30 * MIB));
    step_ended(StepKind::Cell, 4_000, level(31 * MIB));
    let series = series(7).expect("a series for the device");
    let steps: Vec<u64> = series.steps.recent.iter().map(|r| r.allocated).collect();
    assert_eq!(steps, [10 * MIB, 30 * MIB], "the cell's level is not a step's");
    let run = series.steps.rising.unwrap();
    assert_eq!((run.rises, run.iterations()), (1, 2), "two steps between the readings");
    assert_eq!(series.cells.latest().map(|r| r.allocated), Some(31 * MIB));
}

#[test]
fn under_a_trainer_its_steps_are_the_iterations_and_the_optimizer_steps_inside_them_are_passed_over() {
    let _alone = TESTS_ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let level = |allocated| Some(Level { torch_index: 8, allocated });
    step_ended(StepKind::Cell, 0, None); // no trainer marks this cell's iterations yet
    for (iteration, allocated) in [10, 20, 30].into_iter().enumerate() {
        let at = iteration as i64 * 1_000_000;
        step_ended(StepKind::TrainerStep, at, level(allocated * MIB));
        assert!(!wants_level(StepKind::OptimizerStep, at + 500_000), "no level read inside a trainer's step");
        step_ended(StepKind::OptimizerStep, at + 500_000, level(allocated * MIB + MIB));
    }
    let series = series(8).expect("a series for the device");
    let steps: Vec<u64> = series.steps.recent.iter().map(|r| r.allocated).collect();
    assert_eq!(steps, [10 * MIB, 20 * MIB, 30 * MIB], "the optimizer steps' levels are not iterations");
    assert_eq!(series.steps.rising.unwrap().iterations(), 2, "one iteration between the readings, not two");
    assert_eq!(last_step().map(|s| s.kind), Some(StepKind::TrainerStep));
    step_ended(StepKind::Cell, 4_000_000, None);
    step_ended(StepKind::OptimizerStep, 5_000_000, level(40 * MIB));
    assert_eq!(
        last_step().map(|s| s.kind),
        Some(StepKind::OptimizerStep),
        "after the cell, optimizer steps count again"
    );
    step_ended(StepKind::TrainerStep, 6_000_000, None); // a trainer whose cell raised: no cell end
    arm();
    disarm(); // the phase as the other tests find it
    step_ended(StepKind::OptimizerStep, 7_000_000, None);
    assert_eq!(last_step().map(|s| s.time_us), Some(7_000_000), "the next cell starts afresh");
}
