use std::cell::{Cell, RefCell};

use super::*;
use crate::report::FiguresSource;
use crate::snapshot::testing::{gpu, host, torch};

/// A world that logs the rescue's steps; its GPU 1 holds `allocated` until the release.
struct Fake {
    released: Cell<bool>,
    calls: RefCell<Vec<String>>,
    /// Torch's allocated bytes after the release.
    kept: u64,
    /// The run over the loop's repetitions its allocation record holds, where it holds one.
    repeated: Option<recorder::Rising>,
    /// The run over the floors of the cell's record.
    floors: Option<recorder::Rising>,
    failed: Option<FailedLine>,
    recorder: RecorderState,
}

impl Fake {
    /// A world whose torch keeps `kept` bytes after the release, with the recorder wanted.
    fn keeping(kept: u64) -> Self {
        Fake {
            released: Cell::new(false),
            calls: RefCell::default(),
            kept,
            repeated: None,
            floors: None,
            failed: None,
            recorder: RecorderState::Wanted,
        }
    }

    fn log(&self, call: &str) {
        self.calls.borrow_mut().push(call.into());
    }
}

impl RescueWorld for Fake {
    type Error = String;
    fn snapshot(&self) -> Snapshot {
        self.log("snapshot");
        let allocated = if self.released.get() { self.kept } else { 900 };
        let reading =
            |index: u32| GpuReading { torch: Some(torch(allocated, 1_000, 950, 1_000)), ..gpu(index, "GPU-x") };
        host(1.0, 10, 10).with_gpu(reading(0)).with_gpu(reading(1))
    }
    fn failed_line(&self) -> Option<FailedLine> {
        self.log("failed_line");
        self.failed.clone()
    }
    fn last_oom(&self, torch_index: u32, _: Option<u64>, _: Option<StepEnd>) -> Option<OomRecord> {
        self.log(&format!("last_oom cuda:{torch_index}"));
        (self.repeated.is_some() || self.floors.is_some()).then_some(OomRecord {
            sites: None,
            live: None,
            since_step: SinceStep::NoStep,
            repeated: self.repeated,
            floors: self.floors,
        })
    }
    fn live_in_state(&self, _: u32) -> Option<LiveBlocks> {
        None
    }
    fn recorder(&self) -> RecorderState {
        self.recorder
    }
    fn history_enabled(&self) -> bool {
        false
    }
    fn clear_frames(&self) -> Result<Vec<String>, String> {
        self.log("clear_frames");
        Ok(vec!["frames of the failed cell".into()])
    }
    fn holders(&self, torch_index: u32) -> Result<Result<Holders, String>, String> {
        self.log(&format!("holders cuda:{torch_index}"));
        let outs = crate::report::Holder {
            path: "outs".into(),
            bytes: 1 << 30,
            saved_for_backward: 4 << 30,
            device: format!("cuda:{torch_index}"),
            kind: "a list of 142 tensors that require grad, each keeping its graph".into(),
            shape: String::new(),
        };
        Ok(Ok(Holders { holders: vec![outs], ..Holders::default() }))
    }
    fn release(&self, step: Step) -> Result<(), String> {
        self.log(&format!("release {step:?}"));
        self.released.set(true);
        if step == Step::FreeCublasWorkspaces {
            return Err("no cuBLAS".into());
        }
        Ok(())
    }
}

const MESSAGE: &str = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 79.19 GiB";

#[test]
fn the_failed_line_is_read_before_the_frames_are_cleared_and_memory_released_after() {
    let _alone = observed::TESTS_ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let world = Fake::keeping(100);
    let diagnosis = rescue(&world, MESSAGE.into(), None).expect("rescued");
    assert_eq!(
        *world.calls.borrow(),
        [
            "snapshot",
            "failed_line",
            "last_oom cuda:1",
            "clear_frames",
            "release CollectGarbage",
            "release FreeCublasWorkspaces",
            "release EmptyCache",
            "snapshot"
        ]
    );
    assert_eq!(diagnosis.torch_index, Some(1), "the GPU torch's message names");
    assert_eq!(diagnosis.torch_allocated_before, Some(900));
    assert_eq!(diagnosis.torch_allocated_after, Some(100));
    assert_eq!(diagnosis.cleared, ["frames of the failed cell"]);
    assert!(
        diagnosis.hints.iter().any(|h| h.contains("FreeCublasWorkspaces failed: no cuBLAS")),
        "{:?}",
        diagnosis.hints
    );
}

#[test]
fn where_no_record_holds_the_oom_the_diagnosis_says_why_and_how_to_get_one() {
    use crate::recorder::StepKind;
    let _alone = observed::TESTS_ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let _record = recorder::TESTS_ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    recorder::forget(); // no level read: nothing but the record could say what grew
    recorder::step_ended(StepKind::Cell, 1, None);
    for (recorder, why) in [
        // Importing gpuexp rescues an OOM, but the recorder runs only while gpuexp is active.
        (RecorderState::Idle, "only while an experiment is open or the cell log is on (%gpuexp log on)"),
        (RecorderState::Off, "gpuexp.config(flight_recorder=True)"),
        (RecorderState::Wanted, "the recorder starts at the first cell or experiment after CUDA is initialised"),
    ] {
        let world = Fake { recorder, ..Fake::keeping(100) };
        let diagnosis = rescue(&world, MESSAGE.into(), None).expect("rescued");
        match diagnosis.since_step {
            SinceStep::Unknown { why: said, .. } => assert!(said.contains(why), "{recorder:?}: {said}"),
            other => panic!("{recorder:?}: {other:?}"),
        }
    }
}

/// The GPT-2 step of issue 44, as torch's message wrote it; read after the unwind, the 24 GiB
/// intermediate the failing operator made is cached, and looked like fragmentation.
const TOO_BIG: &str = "CUDA out of memory. Tried to allocate 24.00 GiB. GPU 1 has a total capacity of 139.81 GiB of \
    which 15.12 GiB is free. Including non-PyTorch memory, this process has 124.68 GiB memory in use. Of the \
    allocated memory 123.97 GiB is allocated by PyTorch, and 164.25 MiB is reserved by PyTorch but unallocated.";

#[test]
fn without_an_observer_the_figures_are_torchs_message_and_a_too_big_step_is_no_fragmentation() {
    let _alone = observed::TESTS_ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let world = Fake::keeping(100);
    let diagnosis = rescue(&world, TOO_BIG.into(), None).expect("rescued");
    const GIB: f64 = (1u64 << 30) as f64;
    assert_eq!(diagnosis.at_error_source, FiguresSource::Message);
    assert_eq!(diagnosis.torch_allocated_before, Some((123.97 * GIB).round() as u64));
    assert_eq!(diagnosis.free_before, Some((15.12 * GIB).round() as u64));
    assert_eq!(diagnosis.cause, Some(report::OomCause::StepTooBig));
    let text = diagnosis.grid().to_text();
    assert!(text.contains("at the error (torch's message)"), "{text}");
    assert!(!text.contains("may fit") && !text.contains("expandable_segments"), "{text}");
}

#[test]
fn the_observers_figures_come_first_and_say_so() {
    use observed::{Observed, PoolBytes};
    let _alone = observed::TESTS_ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let pools = |all: u64| PoolBytes { all, large_pool: all - 10, small_pool: 10 };
    observed::record(Observed {
        torch_index: 3,
        requested: 3 << 30,
        limit: 8 << 30,
        free: 5 << 30,
        allocated: pools(6 << 30),
        reserved: pools((6 << 30) + 4096),
    });
    let world = Fake::keeping(100);
    let message = "CUDA out of memory. Tried to allocate 3.00 GiB. GPU 3 has a total capacity of 79.19 GiB of \
        which 5.00 GiB is free. 8.00 GiB allowed; Of the allocated memory 6.00 GiB is allocated by PyTorch, and \
        4.00 KiB is reserved by PyTorch but unallocated.";
    let diagnosis = rescue(&world, message.into(), None).expect("rescued");
    assert_eq!(diagnosis.at_error_source, FiguresSource::Observer);
    assert_eq!(diagnosis.torch_reserved_before, Some((6 << 30) + 4096), "exact bytes, not the message's rounding");
    assert_eq!(diagnosis.torch_pools_before.map(|p| p.allocated.small_pool), Some(10));
    assert_eq!(diagnosis.allowed, Some(8 << 30));
    let text = diagnosis.grid().to_text();
    assert!(
        text.contains("at the error (torch's OOM observer)") && text.contains("allowed (memory fraction)"),
        "{text}"
    );
}

#[test]
fn levels_that_crept_before_the_failure_make_it_a_creep_with_its_fix() {
    use crate::recorder::{Level, StepKind};
    const GIB: u64 = 1 << 30;
    let _alone = observed::TESTS_ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let _record = recorder::TESTS_ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // Read every 10 steps, each keeping 1 GiB: 10 GiB to 120 GiB on GPU 0 (no other test reads
    // its series).
    for reading in 1..=12u64 {
        for step in 1..=10u64 {
            let level = (step == 10).then_some(Level { torch_index: 0, allocated: reading * 10 * GIB });
            recorder::step_ended(StepKind::OptimizerStep, (reading * 10 + step) as i64, level);
        }
    }
    let world = Fake::keeping(100);
    let diagnosis = rescue(&world, TOO_BIG.replace("GPU 1", "GPU 0"), None).expect("rescued");
    assert_eq!(diagnosis.cause, Some(report::OomCause::Creep));
    let creep = diagnosis.creep.expect("the creep's figures");
    assert_eq!((creep.per_iteration, creep.iterations), (Some(GIB), 110));
    let hints = diagnosis.hints.join("\n");
    assert!(hints.contains("about 1.00 GiB a step over 110 steps") && hints.contains(".item()"), "{hints}");
    assert!(!hints.contains("Make the step smaller") && !hints.contains("a batch of at most"), "{hints}");
    assert!(!world.calls.borrow().iter().any(|c| c.starts_with("holders")), "100 bytes kept: no search");
    let kept = Fake { kept: 120 * GIB, ..world };
    let named = rescue(&kept, TOO_BIG.replace("GPU 1", "GPU 0"), None).expect("rescued");
    assert!(kept.calls.borrow().contains(&"holders cuda:0".to_string()), "{:?}", kept.calls.borrow());
    let hints = named.hints.join("\n");
    assert!(
        hints.contains(
            "the largest holder is outs (a list of 142 tensors that require grad, each keeping its graph): \
                        5.00 GiB: `del outs` would return at most 5.00 GiB"
        ),
        "{hints}"
    );
    assert!(
        named.grid().to_text().contains("held after the rescue: outs (a list of 142"),
        "{}",
        named.grid().to_text()
    );
    let step_too_big = rescue(&kept, TOO_BIG.into(), None).expect("rescued");
    assert_eq!(step_too_big.cause, Some(report::OomCause::StepTooBig), "GPU 1's levels never crept");
}

#[test]
fn where_no_training_step_ended_last_the_loops_repetitions_are_its_iterations() {
    use crate::recorder::{Reading, Rising, StepKind};
    const GIB: u64 = 1 << 30;
    let _alone = observed::TESTS_ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let _record = recorder::TESTS_ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // 100 repetitions of an evaluation loop, each keeping 1 GiB, on GPU 1.
    let readings = (0..100u64).map(|i| Reading { time_us: i as i64, allocated: (20 + i) * GIB, count: i });
    let world = Fake { repeated: Rising::ending(readings), ..Fake::keeping(100) };
    recorder::step_ended(StepKind::Cell, 1, None);
    let diagnosis = rescue(&world, TOO_BIG.into(), None).expect("rescued");
    assert_eq!(diagnosis.cause, Some(report::OomCause::Creep));
    let creep = diagnosis.creep.unwrap();
    assert_eq!((creep.over, creep.per_iteration, creep.iterations), (report::CreptOver::Repetitions, Some(GIB), 99));
    assert!(diagnosis.hints[0].contains("about 1.00 GiB an iteration over 99 iterations"), "{:?}", diagnosis.hints);
    recorder::step_ended(StepKind::OptimizerStep, 2, None);
    let stepping = rescue(&world, TOO_BIG.into(), None).expect("rescued");
    assert_eq!(stepping.cause, Some(report::OomCause::StepTooBig), "a training loop's iterations are its steps");
}

#[test]
fn a_single_pass_through_identical_blocks_is_no_creep_unless_what_rose_outlived_it() {
    use crate::recorder::{Reading, Rising, StepKind};
    const GIB: u64 = 1 << 30;
    let _alone = observed::TESTS_ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let _record = recorder::TESTS_ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    recorder::step_ended(StepKind::Cell, 1, None);
    // One forward of 24 identical blocks, failing in the 21st: its allocations repeated 20
    // times, each block keeping 4 GiB of activations for backward.
    let blocks = (0..20u64).map(|i| Reading { time_us: i as i64, allocated: (40 + 4 * i) * GIB, count: i });
    let line = FailedLine {
        label: "In [7], line 3".into(),
        source: None,
        module: Some("model.blocks.20.fc1 (Linear)".into()),
        pass_layers: Some(24),
    };
    let pass = Fake { repeated: Rising::ending(blocks.clone()), failed: Some(line.clone()), ..Fake::keeping(10 * GIB) };
    let diagnosis = rescue(&pass, TOO_BIG.into(), None).expect("rescued");
    assert_eq!(diagnosis.cause, Some(report::OomCause::StepTooBig), "{:?}", diagnosis.hints);
    assert!(diagnosis.creep.is_none());
    // The same readings still held after the rescue: the user's names keep them, no pass did.
    let held = Fake { kept: 116 * GIB, ..pass };
    let diagnosis = rescue(&held, TOO_BIG.into(), None).expect("rescued");
    assert_eq!(diagnosis.creep.map(|c| c.over), Some(report::CreptOver::Repetitions));
    // More repetitions than the model has blocks: a loop over passes, even where freed.
    let loop_of_passes = (0..30u64).map(|i| Reading { time_us: i as i64, allocated: (30 + 3 * i) * GIB, count: i });
    let passes = Fake { repeated: Rising::ending(loop_of_passes), failed: Some(line), ..Fake::keeping(10 * GIB) };
    assert_eq!(rescue(&passes, TOO_BIG.into(), None).unwrap().cause, Some(report::OomCause::Creep));
}

#[test]
fn floors_that_rose_within_the_cell_are_a_creep_only_where_what_rose_is_still_held() {
    use crate::recorder::{Reading, Rising, StepKind};
    const GIB: u64 = 1 << 30;
    let _alone = observed::TESTS_ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let _record = recorder::TESTS_ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    recorder::step_ended(StepKind::Cell, 1, None);
    let quarters = (0..12u64).map(|i| Reading { time_us: i as i64, allocated: (40 + 7 * i) * GIB, count: i });
    let freed = Fake { floors: Rising::ending(quarters), ..Fake::keeping(10 * GIB) };
    let diagnosis = rescue(&freed, TOO_BIG.into(), None).expect("rescued");
    assert!(diagnosis.creep.is_none(), "a slow pass too big gives its memory back: {:?}", diagnosis.creep);
    let held = Fake { kept: 117 * GIB, ..freed };
    let diagnosis = rescue(&held, TOO_BIG.into(), None).expect("rescued");
    let creep = diagnosis.creep.expect("held by the user's names");
    assert_eq!((creep.over, creep.per_iteration, creep.iterations), (report::CreptOver::WithinCell, None, 11));
    assert!(diagnosis.hints[0].contains("memory crept within the cell"), "{:?}", diagnosis.hints);
    assert!(!diagnosis.hints.iter().any(|h| h.contains("a batch of at most")), "{:?}", diagnosis.hints);
}
