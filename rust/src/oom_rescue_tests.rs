use std::cell::{Cell, RefCell};

use super::*;
use crate::snapshot::testing::{gpu, host, torch};

/// A world that logs the rescue's steps; its GPU 1 holds `allocated` until the release.
struct Fake {
    released: Cell<bool>,
    calls: RefCell<Vec<String>>,
}

impl Fake {
    fn log(&self, call: &str) {
        self.calls.borrow_mut().push(call.into());
    }
}

impl RescueWorld for Fake {
    type Error = String;
    fn snapshot(&self) -> Snapshot {
        self.log("snapshot");
        let allocated = if self.released.get() { 100 } else { 900 };
        let reading =
            |index: u32| GpuReading { torch: Some(torch(allocated, 1_000, 950, 1_000)), ..gpu(index, "GPU-x") };
        host(1.0, 10, 10).with_gpu(reading(0)).with_gpu(reading(1))
    }
    fn failed_line(&self) -> Option<FailedLine> {
        self.log("failed_line");
        None
    }
    fn last_oom(&self, torch_index: u32, _: Option<u64>, _: Option<StepEnd>) -> Option<OomRecord> {
        self.log(&format!("last_oom cuda:{torch_index}"));
        None
    }
    fn live_in_state(&self, _: u32) -> Option<LiveBlocks> {
        None
    }
    fn flight_recorder_on(&self) -> bool {
        true
    }
    fn history_enabled(&self) -> bool {
        false
    }
    fn clear_frames(&self) -> Result<Vec<String>, String> {
        self.log("clear_frames");
        Ok(vec!["frames of the failed cell".into()])
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
    let world = Fake { released: Cell::new(false), calls: RefCell::default() };
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
