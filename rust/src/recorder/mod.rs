//! The flight recorder's side of an out-of-memory error: where training steps ended, and what an
//! OOM reads when nobody asked for a trace. While gpuexp is active the recorder keeps torch's
//! allocation history without stacks for the first steps of each cell (`schedule`), so the
//! history knows every block's size and time, not its line: what grew since the last completed
//! step, and the blocks live at the failure by size, made since that step or held from before.
//! After those steps each step's end reads one level instead (torch's allocated bytes), and an
//! OOM then says what grew from that level and which blocks the allocator's state holds.

mod pattern;
mod schedule;
mod series;

pub use pattern::{floors, repeated};
pub use schedule::{HistoryChange, Phase, HISTORY_STEPS};
use series::Series;
pub use series::{DeviceSeries, Reading, Rising};

use serde::Serialize;

use crate::fork::PerProcess;
use crate::recording_lease::HistoryMode;
use crate::torch_history::{self, TorchMemory};
use crate::trace::{oom, Action, AllocationHistory, Attribution, BlockState, OomSites, Replay};
use crate::units::bytes;

/// What completed: the point "what grew since the last step" counts from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StepKind {
    /// `optimizer.step()` returned (torch's global optimizer step hook).
    OptimizerStep,
    /// A framework's callback saw a training step end.
    TrainerStep,
    /// The batch-size finder's call of the user's step returned.
    FinderStep,
    /// A notebook cell ran to its end without an error.
    Cell,
}

impl StepKind {
    pub fn label(self) -> &'static str {
        match self {
            StepKind::OptimizerStep => "optimizer step",
            StepKind::TrainerStep => "trainer step",
            StepKind::FinderStep => "finder step",
            StepKind::Cell => "cell",
        }
    }

    pub fn parse(name: &str) -> Option<StepKind> {
        [StepKind::OptimizerStep, StepKind::TrainerStep, StepKind::FinderStep, StepKind::Cell]
            .into_iter()
            .find(|k| k.label() == name)
    }
}

/// Torch's allocated bytes on one device, read at a step's end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Level {
    pub torch_index: u32,
    pub allocated: u64,
}

/// The end of a completed step, on torch's `time_us` clock (Unix microseconds), with the level
/// read then where the recorder had given the history back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct StepEnd {
    pub kind: StepKind,
    pub time_us: i64,
    pub level: Option<Level>,
}

/// This process's recorder: its phase and the latest step end.
#[derive(Default)]
struct Record {
    phase: Phase,
    last: Option<StepEnd>,
    /// The latest step end with a level read, and how many steps completed after it.
    levelled: Option<(StepEnd, u32)>,
    /// Training steps and cells completed in this process, counting the series' iterations.
    steps: u64,
    cells: u64,
    series: Series,
    /// A framework's callback marks this cell's iterations (trainer steps): the optimizer steps
    /// within them are no iterations of their own, which would halve what each one keeps. Reset
    /// when a cell ends, or the next starts (the cell of a trainer that raised never ends).
    trainer_stepping: bool,
}

impl Record {
    /// Whether a step of `kind` is an iteration the recorder counts: every kind, except an
    /// optimizer step while a trainer marks the iterations (until its cell ends or the next starts).
    fn counts(&self, kind: StepKind) -> bool {
        !(kind == StepKind::OptimizerStep && self.trainer_stepping)
    }
}

/// After the history, a level is read at a step's end at most this often: in a steady loop the
/// level at every step's end is the same, and a read (one allocator stats call, about 21 µs, and
/// its Python calls) is what a launch-bound step of a few milliseconds would feel.
pub const LEVEL_EVERY_US: i64 = 250_000;

/// One record per process (a forked child starts its own).
static RECORD: PerProcess<Record> = PerProcess::new(Record::default);

fn with_record<T>(work: impl FnOnce(&mut Record) -> T) -> T {
    work(&mut RECORD.lock())
}

/// Whether this process holds the recorder's share (a forked child holds none of its parent's).
static HELD: PerProcess<bool> = PerProcess::new(|| false);

/// Carries out the schedule's change to the recorder's share of torch's history (without
/// stacks). Returns a note where giving it back failed.
pub fn change_history(torch: &dyn TorchMemory, change: HistoryChange) -> Option<String> {
    let held = *HELD.lock();
    match change {
        HistoryChange::Join if !held && torch_history::join(torch, HistoryMode::Events).is_ok() => *HELD.lock() = true,
        HistoryChange::Leave if held => {
            *HELD.lock() = false;
            return torch_history::leave(torch, HistoryMode::Events);
        }
        _ => {}
    }
    None
}

/// A cell starts or an experiment opens while the recorder is wanted.
pub fn arm() -> HistoryChange {
    with_record(|record| {
        record.trainer_stepping = false; // a failed trainer's cell never ended: this one starts afresh
        record.phase.arm()
    })
}

/// gpuexp is no longer active, or the recorder was turned off.
pub fn disarm() -> HistoryChange {
    with_record(|record| record.phase.disarm())
}

/// Whether the step ending at `now_us` needs its level read: the schedule wants levels, and the
/// last was read `LEVEL_EVERY_US` ago or more (always at the step that gives the history back,
/// and at every cell's end, for the series across cells).
pub fn wants_level(kind: StepKind, now_us: i64) -> bool {
    with_record(|record| {
        if !record.counts(kind) {
            return false;
        }
        let due = match (record.phase, record.levelled) {
            _ if kind == StepKind::Cell => true,
            (Phase::History { .. }, _) | (_, None) => true,
            (_, Some((levelled, _))) => now_us - levelled.time_us >= LEVEL_EVERY_US,
        };
        record.phase.wants_level(kind == StepKind::Cell) && due
    })
}

/// A step of `kind` ended at `time_us`, its level read where `wants_level` asked: one lock, a
/// few stores and, with a level, one push onto the device's bounded series (an optimizer step
/// inside a trainer's step is passed over: the trainer's step is the iteration). Says what
/// happens to the recorder's share of torch's history.
pub fn step_ended(kind: StepKind, time_us: i64, level: Option<Level>) -> HistoryChange {
    with_record(|record| {
        if !record.counts(kind) {
            return HistoryChange::Keep;
        }
        let step = StepEnd { kind, time_us, level };
        let cell = kind == StepKind::Cell;
        record.trainer_stepping = match kind {
            StepKind::TrainerStep => true,
            StepKind::Cell => false,
            _ => record.trainer_stepping,
        };
        record.last = Some(step);
        record.levelled = match (level, record.levelled) {
            (Some(_), _) => Some((step, 0)),
            (None, Some((levelled, after))) => Some((levelled, after + 1)),
            (None, None) => None,
        };
        let change = record.phase.step_ended(cell);
        let count = if cell { &mut record.cells } else { &mut record.steps };
        *count += 1;
        if let Some(level) = level {
            let reading = Reading { time_us, allocated: level.allocated, count: *count };
            match cell {
                true => record.series.cell_level(level.torch_index, reading),
                false => record.series.step_level(level.torch_index, reading, change == HistoryChange::Leave),
            }
        }
        change
    })
}

/// The bounded series of levels on `torch_index` (see `series`).
pub fn series(torch_index: u32) -> Option<DeviceSeries> {
    with_record(|record| record.series.device(torch_index).cloned())
}

/// The latest step that ended in this process.
pub fn last_step() -> Option<StepEnd> {
    with_record(|record| record.last)
}

/// The latest step end with a level read, and how many steps completed after it.
pub fn last_level() -> Option<(StepEnd, u32)> {
    with_record(|record| record.levelled)
}

/// What grew from the last completed step to the failure.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum SinceStep {
    /// No step completed in this process.
    NoStep,
    /// The step ended before the record's first event (the recorder started after it, or its
    /// ring buffer has dropped it).
    BeforeRecord { step: StepEnd },
    /// Torch's allocated bytes at the step's end and at the failure, and the blocks made since
    /// that were still live (unknown where only levels were read).
    Grew {
        step: StepEnd,
        failed_us: i64,
        held_then: u64,
        held_at_failure: u64,
        made_since: Option<u64>,
        blocks_since: Option<usize>,
        /// Steps that completed after `step` (levels are not read at every step's end).
        later_steps: u32,
    },
    /// No record to read it from.
    Unknown { step: StepEnd, why: String },
}

impl SinceStep {
    /// One line for the diagnosis.
    pub fn describe(&self) -> String {
        match self {
            SinceStep::NoStep => "since the last completed step: none completed in this kernel \
                                  (no optimizer step, trainer step or cell), so what grew in this one is unknown"
                .into(),
            SinceStep::BeforeRecord { step } => format!(
                "since the last completed {}: unknown, it ended before the allocation record's first event",
                step.kind.label()
            ),
            SinceStep::Grew { step, failed_us, held_then, held_at_failure, made_since, blocks_since, later_steps } => {
                let seconds = (failed_us - step.time_us).max(0) as f64 / 1e6;
                let change = *held_at_failure as i128 - *held_then as i128;
                let sign = if change < 0 { "−" } else { "+" };
                let which = match later_steps {
                    0 => format!("the last completed {}", step.kind.label()),
                    n => {
                        format!("the last completed {} with a level read, {n} steps before the last", step.kind.label())
                    }
                };
                let grew = format!(
                    "since {which} ({seconds:.1} s before): torch's allocated went from {} to {} ({sign}{})",
                    bytes(*held_then),
                    bytes(*held_at_failure),
                    bytes(change.unsigned_abs() as u64),
                );
                match (blocks_since, made_since) {
                    (Some(blocks), Some(made)) => format!("{grew}; {blocks} blocks made since hold {}", bytes(*made)),
                    _ => format!(
                        "{grew}, read at the step's end and at the failure (the recorder keeps torch's \
                         history for the first {HISTORY_STEPS} steps of a cell, so which blocks grew is not known)"
                    ),
                }
            }
            SinceStep::Unknown { step, why } => {
                format!("since the last completed {}: unknown ({why})", step.kind.label())
            }
        }
    }
}

/// Blocks of one size live at the failure.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SizeGroup {
    pub bytes: u64,
    pub count: usize,
}

/// The blocks live when the allocation failed, from a record without stacks: the largest sizes,
/// and what of them was made since the last completed step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LiveBlocks {
    pub total: u64,
    pub blocks: usize,
    /// The sizes holding the most, most first.
    pub largest: Vec<SizeGroup>,
    /// Of `total`, what was made since the last completed step (None: no step in the record).
    pub made_since_step: Option<u64>,
}

impl LiveBlocks {
    /// Size groups the diagnosis names.
    pub const SHOWN: usize = 4;

    /// The largest groups of equal sizes, by the bytes they hold.
    fn by_size(sizes: impl Iterator<Item = u64>, made_since_step: Option<u64>) -> LiveBlocks {
        let mut groups: std::collections::BTreeMap<u64, usize> = std::collections::BTreeMap::new();
        let (mut total, mut blocks) = (0, 0);
        for size in sizes {
            *groups.entry(size).or_default() += 1;
            total += size;
            blocks += 1;
        }
        let mut largest: Vec<SizeGroup> = groups.into_iter().map(|(bytes, count)| SizeGroup { bytes, count }).collect();
        largest.sort_by_key(|g| std::cmp::Reverse((g.bytes * g.count as u64, g.bytes)));
        largest.truncate(LiveBlocks::SHOWN);
        LiveBlocks { total, blocks, largest, made_since_step }
    }

    /// One line for the diagnosis.
    pub fn describe(&self) -> String {
        let groups: Vec<String> = self.largest.iter().map(|g| format!("{} × {}", g.count, bytes(g.bytes))).collect();
        let mut line = format!(
            "live then, by size (recorded without stacks: trace=True names their lines): {} of {} in {} blocks",
            groups.join(", "),
            bytes(self.total),
            self.blocks
        );
        if let Some(since) = self.made_since_step {
            line.push_str(&format!(
                "; {} made since the last step (the failing step's activations and temporaries), {} from before \
                 (parameters, optimizer state, tensors kept)",
                bytes(since),
                bytes(self.total.saturating_sub(since))
            ));
        }
        line
    }
}

/// What the record holds of the OOM torch's message describes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OomRecord {
    /// The failed line and the sites live then, where the record has stacks.
    pub sites: Option<OomSites>,
    /// The live blocks by size, where it has none.
    pub live: Option<LiveBlocks>,
    pub since_step: SinceStep,
    /// The rising run over the repetitions of the loop that reaches the failure, where the
    /// record holds one (`pattern`): the iterations where no step completed.
    pub repeated: Option<Rising>,
    /// The rising run over the floors of the cell's record (`pattern::floors`), where no
    /// training step ended in it.
    pub floors: Option<Rising>,
}

/// The OOM torch's message describes (asking `asked`, where the message says) in `snapshot`'s
/// record of `device`: the latest OOM event whose size agrees. None where the record holds none:
/// an older OOM of another size would name the wrong line.
pub fn read_oom(
    snapshot: &AllocationHistory,
    replay: &Replay,
    asked: Option<u64>,
    step: Option<StepEnd>,
    attribution: &Attribution,
) -> Option<OomRecord> {
    let events = snapshot.device_traces.get(replay.device)?;
    let (event, failed) = events.iter().enumerate().rev().find(|(_, e)| e.action == Action::Oom)?;
    if asked.is_some_and(|asked| !crate::trace::held::message_matches(failed.size, asked)) {
        return None;
    }
    let with_stacks = !snapshot.stacks.is_bare(failed.stack);
    let sites = with_stacks
        .then(|| oom(snapshot, replay, attribution, crate::trace::TOP_SITES).into_iter().find(|o| o.event == event))
        .flatten();
    // The events recorded up to the step's end: the step is in the record where any is.
    let recorded_by_step = step.map(|s| replay.time_us[..event].partition_point(|&t| t <= s.time_us));
    let since_step = match (step, recorded_by_step) {
        (None, _) | (_, None) => SinceStep::NoStep,
        (Some(step), Some(0)) => SinceStep::BeforeRecord { step },
        (Some(step), Some(first_after)) => {
            let made: Vec<u64> = replay
                .live_at(event)
                .filter(|b| b.alloc_event.is_some_and(|a| a >= first_after))
                .map(|b| b.bytes)
                .collect();
            SinceStep::Grew {
                step,
                failed_us: failed.time_us,
                held_then: replay.allocated_at(first_after - 1),
                held_at_failure: replay.allocated_at(event),
                made_since: Some(made.iter().sum()),
                blocks_since: Some(made.len()),
                later_steps: 0,
            }
        }
    };
    let live = (!with_stacks).then(|| live_blocks(replay, event, &since_step));
    let repeated = repeated(events, replay, event);
    // The cell's record: from the last cell's end, where no training step ended since.
    let cell_began = match step {
        None => Some(i64::MIN),
        Some(step) => (step.kind == StepKind::Cell).then_some(step.time_us),
    };
    let floors = cell_began.and_then(|since| floors(events, replay, event, since));
    Some(OomRecord { sites, live, since_step, repeated, floors })
}

fn live_blocks(replay: &Replay, event: usize, since_step: &SinceStep) -> LiveBlocks {
    let made_since_step = match since_step {
        SinceStep::Grew { made_since, .. } => *made_since,
        _ => None,
    };
    LiveBlocks::by_size(replay.live_at(event).map(|block| block.bytes), made_since_step)
}

/// Where the recorder had given the history back: what grew from the latest level read at a
/// step's end on this device (`levelled`: that step, and the steps completed after it) to the
/// failure's allocated bytes.
pub fn since_level(
    levelled: Option<(StepEnd, u32)>,
    torch_index: u32,
    failed_us: i64,
    held_at_failure: u64,
) -> SinceStep {
    let Some((step, later_steps)) = levelled else { return SinceStep::NoStep };
    match step.level {
        Some(level) if level.torch_index == torch_index => SinceStep::Grew {
            step,
            failed_us,
            held_then: level.allocated,
            held_at_failure,
            made_since: None,
            blocks_since: None,
            later_steps,
        },
        _ => SinceStep::Unknown { step, why: "no allocation record and no level read at its end on this GPU".into() },
    }
}

/// The blocks the allocator holds on `device` in a snapshot of its state (no history needed).
pub fn live_in_state(snapshot: &AllocationHistory, device: usize) -> LiveBlocks {
    let sizes = (snapshot.segments.iter().filter(|segment| segment.device == device))
        .flat_map(|segment| &segment.blocks)
        .filter(|block| block.state == BlockState::ActiveAllocated)
        .map(|block| block.size);
    LiveBlocks::by_size(sizes, None)
}

/// The record is one per process: the tests that end steps run one at a time.
#[cfg(test)]
pub(crate) static TESTS_ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The record as a fresh process has it, for a test that must not see the steps of others.
#[cfg(test)]
pub(crate) fn forget() {
    with_record(|record| *record = Record::default());
}

#[cfg(test)]
mod tests;
