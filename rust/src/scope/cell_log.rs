//! The cell log's sequence around each cell, over [`CellWorld`]: the bindings read memory
//! through torch and NVML, the tests through a fake. A cell's window opens where the last
//! logged cell ended when nothing read memory in between, so a cell reads memory once, at its end.

use std::sync::{Arc, MutexGuard};

use super::Registry;
use crate::live_view::schedule::Schedule;
use crate::report::CellRecord;
use crate::snapshot::{GpuSelection, Snapshot};

/// What the cell log acts on.
pub trait CellWorld {
    /// What a snapshot read of torch, for the reset of its peak counters.
    type Torch;
    /// Never held while Python code runs.
    fn registry(&self) -> MutexGuard<'_, Registry>;
    /// How many times gpuexp read memory for anything else so far.
    fn other_readings(&self) -> u64;
    /// A cell's start with no end of the last cell to start from.
    fn opening_snapshot(&mut self, selection: &GpuSelection) -> (Snapshot, Self::Torch);
    fn cell_snapshot(&mut self, selection: &GpuSelection) -> (Snapshot, Self::Torch);
    fn reset_counters(&mut self, torch: &Self::Torch, at: &Snapshot);
    /// The trace's share of the cell begins (`carried`: its window began where the last ended).
    fn begin_trace(&mut self, carried: bool);
    /// The top site of the cell's torch peak, where the trace is on.
    fn end_trace(&mut self, record: Arc<CellRecord>) -> Arc<CellRecord>;
    /// The sampler follows what is open now, and recordings no longer needed stop.
    fn settle(&mut self);
}

/// Opens the window of a cell about to run (`pre_run_cell`).
pub fn begin_cell<W: CellWorld>(world: &mut W, schedule: &Schedule) {
    let selection = world.registry().cell_selection();
    let readings = world.other_readings();
    let carried = world.registry().begin_cell_where_last_ended(&selection, readings);
    let window = carried.unwrap_or_else(|| {
        let (start, torch) = world.opening_snapshot(&selection);
        let window = world.registry().begin_cell(start.clone());
        world.reset_counters(&torch, &start);
        window
    });
    world.begin_trace(carried.is_some());
    schedule.cell_began(window);
}

/// How a cell ended: its record where its block shows, and the window of its live view if one
/// was drawn (the caller replaces it).
pub struct CellEnded {
    pub shown: Option<Arc<CellRecord>>,
    pub drawn: Option<u64>,
}

/// Closes the running cell's window and records it (`post_run_cell`). The block shows where
/// something moved by `cell_log_min_change`, or under `%gpuexp log all`.
pub fn end_cell<W: CellWorld>(world: &mut W, schedule: &Schedule, execution_count: u64) -> CellEnded {
    let drawn = schedule.cell_ended();
    let Some(selection) = world.registry().open_cell_selection() else { return CellEnded { shown: None, drawn } };
    let (end, torch) = world.cell_snapshot(&selection);
    let record = world.registry().end_cell(execution_count, &end);
    // The trace is read without the registry held: naming a site calls into Python.
    let record = record.map(|record| world.end_trace(record));
    let (shown, next_selection) = {
        let registry = world.registry();
        let shown = record.filter(|r| registry.shows(r));
        (shown, registry.cell_log_active().then(|| registry.cell_selection()))
    };
    if let Some(next_selection) = next_selection {
        // The end's peaks are in every open window now: the next cell's window starts here.
        world.reset_counters(&torch, &end);
        let readings = world.other_readings();
        world.registry().keep_cell_end(end, next_selection, readings);
    }
    world.settle();
    CellEnded { shown, drawn }
}

impl Registry {
    /// `%gpuexp log on|all|off`: the cell log without an experiment; `every_cell` (`log all`)
    /// shows every cell's block. Returns whether the log went off: recordings then settle.
    pub fn set_standalone_log(&mut self, on: bool, every_cell: bool) -> bool {
        self.standalone_log = on;
        self.cell_log_every_cell = on && every_cell;
        self.forget_cell_end();
        !on
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::snapshot::testing::host;

    #[derive(Default)]
    struct Recorded {
        registry: Mutex<Registry>,
        readings: u64,
        calls: Vec<String>,
    }

    impl CellWorld for Recorded {
        type Torch = &'static str;
        fn registry(&self) -> MutexGuard<'_, Registry> {
            self.registry.lock().unwrap()
        }
        fn other_readings(&self) -> u64 {
            self.readings
        }
        fn opening_snapshot(&mut self, _: &GpuSelection) -> (Snapshot, &'static str) {
            self.calls.push("opening_snapshot".into());
            (host(1.0, 100, 100), "torch at opening")
        }
        fn cell_snapshot(&mut self, _: &GpuSelection) -> (Snapshot, &'static str) {
            self.calls.push("cell_snapshot".into());
            (host(2.0, 300, 300), "torch at end")
        }
        fn reset_counters(&mut self, torch: &&'static str, _: &Snapshot) {
            self.calls.push(format!("reset_counters ({torch})"));
        }
        fn begin_trace(&mut self, carried: bool) {
            self.calls.push(format!("begin_trace carried={carried}"));
        }
        fn end_trace(&mut self, record: Arc<CellRecord>) -> Arc<CellRecord> {
            self.calls.push("end_trace".into());
            record
        }
        fn settle(&mut self) {
            self.calls.push("settle".into());
        }
    }

    #[test]
    fn a_logged_cell_reads_memory_once_at_its_end_and_the_next_starts_there() {
        let mut world = Recorded::default();
        let schedule = Schedule::new();
        assert!(!world.registry().set_standalone_log(true, true), "the log went on");
        begin_cell(&mut world, &schedule);
        assert_eq!(world.calls, ["opening_snapshot", "reset_counters (torch at opening)", "begin_trace carried=false"]);
        world.calls.clear();
        let ended = end_cell(&mut world, &schedule, 1);
        assert!(ended.shown.is_some(), "`log all` shows every cell");
        assert_eq!(ended.drawn, None, "no live view was drawn");
        assert_eq!(world.calls, ["cell_snapshot", "end_trace", "reset_counters (torch at end)", "settle"]);
        world.calls.clear();
        begin_cell(&mut world, &schedule);
        assert_eq!(world.calls, ["begin_trace carried=true"], "nothing read memory in between");
        world.calls.clear();
        end_cell(&mut world, &schedule, 2);
        world.readings += 1;
        begin_cell(&mut world, &schedule);
        assert_eq!(
            world.calls[world.calls.len() - 3..],
            ["opening_snapshot", "reset_counters (torch at opening)", "begin_trace carried=false"],
            "another reading came in between"
        );
    }

    #[test]
    fn with_the_log_off_a_cell_end_only_settles() {
        let mut world = Recorded::default();
        let schedule = Schedule::new();
        assert!(world.registry().set_standalone_log(false, true), "the log went off");
        assert!(!world.registry().cell_log_every_cell, "`all` needs the log on");
        let ended = end_cell(&mut world, &schedule, 1);
        assert!(ended.shown.is_none());
        assert!(world.calls.is_empty(), "no cell was open: {:?}", world.calls);
    }
}
