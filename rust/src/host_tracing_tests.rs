use std::cell::{Cell, RefCell};
use std::sync::Mutex;

use super::*;
use crate::trace::PlainNamer;

/// The lease is per process: the tests that use it take turns.
static TURN: Mutex<()> = Mutex::new(());

/// A tracemalloc that logs what it was asked to do; each tally adds one trace of `live` bytes.
#[derive(Default)]
struct Fake {
    tracing: Cell<bool>,
    /// The marker's generation of tracing: a restart makes a new one.
    generation: Cell<u32>,
    live: Cell<i64>,
    interrupt: Cell<bool>,
    calls: RefCell<Vec<&'static str>>,
}

impl Tracemalloc for Fake {
    type Marker = u32;
    fn is_tracing(&self) -> Result<bool, Failure> {
        Ok(self.tracing.get())
    }
    fn start(&self) -> Result<(), Failure> {
        self.calls.borrow_mut().push("start");
        self.tracing.set(true);
        Ok(())
    }
    fn stop(&self) -> Result<(), Failure> {
        self.calls.borrow_mut().push("stop");
        self.tracing.set(false);
        Ok(())
    }
    fn tally_live(&self, growth: &mut HostGrowth, sign: i64) -> Result<(), Failure> {
        if self.interrupt.get() {
            return Err(Failure::Interrupted);
        }
        let frame = growth.stacks.intern_frame("/home/me/train.py", 3, "");
        let stack = growth.stacks.intern_stack(&[frame]);
        growth.tally(stack, sign * self.live.get(), sign);
        Ok(())
    }
    fn marker(&self) -> Result<u32, Failure> {
        Ok(self.generation.get())
    }
    fn traces(&self, marker: &u32) -> Result<bool, Failure> {
        Ok(*marker == self.generation.get())
    }
}

fn finished(fake: &Fake, window: HostWindow<u32>) -> HostFinding {
    finish(fake, window, &PlainNamer::default())
}

#[test]
fn gpuexp_starts_tracemalloc_and_stops_it_after_the_last_experiment() {
    let _turn = crate::locks::lock(&TURN);
    let fake = Fake { live: Cell::new(100), ..Fake::default() };
    let (first, notes) = open(&fake);
    assert!(notes.is_empty(), "{notes:?}");
    let (second, _) = open(&fake);
    fake.live.set(1_000);
    finished(&fake, second);
    assert_eq!(*fake.calls.borrow(), ["start"], "an experiment still traces");
    let report = finished(&fake, first);
    assert_eq!(*fake.calls.borrow(), ["start", "stop"]);
    let trace = report.trace.expect("a host table");
    assert_eq!(trace.net_bytes, 900);
}

#[test]
fn the_users_tracemalloc_is_shared_and_left_running() {
    let _turn = crate::locks::lock(&TURN);
    let fake = Fake { tracing: Cell::new(true), ..Fake::default() };
    let (window, notes) = open(&fake);
    assert!(notes[0].contains("leaves it running"), "{notes:?}");
    finished(&fake, window);
    assert!(fake.calls.borrow().is_empty());
}

#[test]
fn a_stop_during_the_experiment_leaves_no_table_and_a_restart_is_the_users() {
    let _turn = crate::locks::lock(&TURN);
    let fake = Fake::default();
    let (window, _) = open(&fake);
    fake.tracing.set(false);
    let report = finished(&fake, window);
    assert!(report.trace.is_none());
    assert!(report.notes[0].contains("tracemalloc.stop()"), "{:?}", report.notes);

    let (window, _) = open(&fake);
    fake.generation.set(fake.generation.get() + 1);
    fake.calls.borrow_mut().clear();
    let report = finished(&fake, window);
    assert!(report.trace.is_some());
    assert!(report.notes[0].contains("started again"), "{:?}", report.notes);
    assert!(fake.calls.borrow().is_empty(), "the restarted tracing is the user's, left running");
}

#[test]
fn an_interrupt_at_finish_ends_only_the_host_table() {
    let _turn = crate::locks::lock(&TURN);
    let fake = Fake::default();
    let (window, _) = open(&fake);
    fake.interrupt.set(true);
    let report = finished(&fake, window);
    assert!(report.trace.is_none());
    assert!(report.notes[0].contains("interrupted"), "{:?}", report.notes);
    assert_eq!(*fake.calls.borrow(), ["start", "stop"]);
}
