//! The rescue after a CUDA out-of-memory error, and its diagnosis: the order of the rescue's
//! steps (the device read, the failed line read before the frames are cleared, the allocation
//! record's view of the OOM, the frames cleared, memory released as at a teardown, the device
//! read again) runs here over [`RescueWorld`], which the bindings implement over Python and
//! torch and the tests over a fake.

pub mod observed;

use crate::recorder::{self, LiveBlocks, OomRecord, Rising, SinceStep, StepEnd};
use crate::report::OomMessage;
use crate::report::{self, Creep, FailedLine, FiguresSource, Holders, OomDiagnosis, RisingRuns, TorchPools};
use crate::snapshot::{nvml, own_pids, GpuReading, Snapshot};
use crate::teardown::{self, Step};
use crate::training::Position;
use observed::Observed;

/// What a rescue reads and does outside the core.
pub trait RescueWorld {
    /// The error clearing the frames raised, which the rescue passes on.
    type Error;
    /// The host and every visible GPU now.
    fn snapshot(&self) -> Snapshot;
    /// The failed line and module from the exception's traceback.
    fn failed_line(&self) -> Option<FailedLine>;
    /// The OOM in torch's allocation history where one is being recorded (see `recorder::read_oom`).
    fn last_oom(&self, torch_index: u32, requested: Option<u64>, step: Option<StepEnd>) -> Option<OomRecord>;
    /// The blocks torch's allocator holds on `torch_index` now.
    fn live_in_state(&self, torch_index: u32) -> Option<LiveBlocks>;
    fn recorder(&self) -> RecorderState;
    /// Whether torch's allocation history is being recorded.
    fn history_enabled(&self) -> bool;
    /// Clears the failed cell's frames and the references to its exception; what was cleared.
    fn clear_frames(&self) -> Result<Vec<String>, Self::Error>;
    fn release(&self, step: Step) -> Result<(), String>;
    /// What holds memory on `torch_index` now, from the user's names (`gpuexp.holders()`'s
    /// search, bounded by its object count): Ok(Err(why)) where it raised, Err to pass on an
    /// interrupt.
    fn holders(&self, torch_index: u32) -> Result<Result<Holders, String>, Self::Error>;
}

/// Holders the diagnosis names after the rescue.
pub const HOLDERS_NAMED: usize = 3;

/// Rescues after the CUDA out-of-memory error whose text is `message`, raised while the
/// training run stood at `training`, and diagnoses it: what was asked for, what the device had,
/// what grew since the last step, what came back.
pub fn rescue<W: RescueWorld>(
    world: &W,
    message: String,
    training: Option<Position>,
) -> Result<OomDiagnosis, W::Error> {
    let parsed = OomMessage::parse(&message);
    let (requested, device) = (parsed.requested, parsed.device);
    // Read first: what the observer saw belongs to this failure only if nothing ran since.
    let observed = observed::take(device, requested);
    let before = world.snapshot();
    // The traceback is read before its frames are cleared.
    let failed_line = world.failed_line();
    let step = recorder::last_step();
    // The device torch's message names; another GPU's figures would only mislead.
    let failing = |s: &Snapshot| -> Option<GpuReading> {
        match device {
            Some(index) => s.gpus.iter().find(|g| g.torch_index == index).cloned(),
            None => s.gpus.first().cloned(),
        }
    };
    let gpu_before = failing(&before);
    let at_error = AtError::of(observed, &parsed, gpu_before.as_ref());
    let recorded = gpu_before.as_ref().and_then(|g| world.last_oom(g.torch_index, requested, step));
    let levelled = recorder::last_level();
    // The loop's repetitions are its iterations only where no training step ended last: a
    // training loop's iterations are its steps, and its steps' levels say whether it crept.
    let stepping = step.is_some_and(|s| s.kind != recorder::StepKind::Cell);
    let in_history = recorded.as_ref().filter(|_| !stepping).map(|r| (r.repeated, r.floors));
    let (since_step, sites, live_blocks) = match (recorded, step) {
        (Some(recorded), _) => (recorded.since_step, recorded.sites, recorded.live),
        (None, None) => (SinceStep::NoStep, None, None),
        // The history was given back after the cell's first steps: levels and the allocator's state.
        (None, Some(step)) if levelled.is_some() => {
            match gpu_before.as_ref().and_then(|g| Some((g.torch_index, at_error.allocated?))) {
                Some((index, allocated)) => (
                    recorder::since_level(levelled, index, crate::torch_history::now_us(), allocated),
                    None,
                    world.live_in_state(index),
                ),
                None => (SinceStep::Unknown { step, why: no_record_why(world) }, None, None),
            }
        }
        (None, Some(step)) => (SinceStep::Unknown { step, why: no_record_why(world) }, None, None),
    };
    let cleared = world.clear_frames()?;
    let mut failed_steps = Vec::new();
    for step in teardown::RELEASE {
        if let Err(e) = world.release(step) {
            failed_steps.push(format!("rescue step {step:?} failed: {e}"));
        }
    }
    let gpu_after = failing(&world.snapshot());
    // Still at least half the budget after the rescue: the failed cell's frames are gone, so
    // what remains is held by the user's names, and the search names them.
    let allocated_after = gpu_after.as_ref().and_then(|g| g.torch).map(|t| t.allocated);
    let held =
        at_error.allowed.or(at_error.total).zip(allocated_after).is_some_and(|(budget, after)| after >= budget / 2);
    let (mut held_after, mut holder_search) = (Vec::new(), None);
    if let (true, Some(gpu)) = (held, gpu_after.as_ref()) {
        match world.holders(gpu.torch_index)? {
            Ok(found) => held_after = found.holders.into_iter().take(HOLDERS_NAMED).collect(),
            Err(why) => holder_search = Some(why),
        }
    }
    let creep = gpu_before.as_ref().and_then(|g| {
        let (repetitions, floors) = in_history.unwrap_or_default();
        let evidence = Unstepped { repetitions, floors, allocated_after, failed_line: failed_line.as_ref() };
        creep(g.torch_index, evidence.runs(), &at_error)
    });
    let mut others: Vec<(u32, Option<u64>)> =
        gpu_before.as_ref().map(|g| nvml::other_processes(&g.uuid, &own_pids())).unwrap_or_default();
    // Where NVML lists none, torch's message may: only where it also names this process's own
    // line, since in a container torch lists its own process under a pid of the host's.
    if others.is_empty() && parsed.process_used.is_some() {
        others = parsed.others.iter().map(|&(pid, used)| (pid, Some(used))).collect();
    }
    let others =
        others.into_iter().map(|(pid, used)| report::OtherProcess { pid, name: process_name(pid), used }).collect();
    let mut diagnosis = OomDiagnosis {
        message,
        torch_index: gpu_before.as_ref().map(|g| g.torch_index).or(device),
        requested,
        total: at_error.total,
        at_error_source: at_error.source,
        allowed: at_error.allowed,
        free_before: at_error.free,
        free_after: gpu_after.as_ref().map(|g| g.free),
        torch_allocated_before: at_error.allocated,
        torch_allocated_after: gpu_after.as_ref().and_then(|g| g.torch).map(|t| t.allocated),
        torch_reserved_before: at_error.reserved,
        torch_pools_before: at_error.pools,
        process_used_before: at_error.process_used,
        others,
        hints: Vec::new(),
        cleared,
        training,
        sites,
        failed_line,
        since_step,
        live_blocks,
        cause: None,
        also: Vec::new(),
        creep,
        held_after,
        holder_search,
    };
    diagnosis.cause = diagnosis.cause();
    diagnosis.also = diagnosis.also();
    diagnosis.hints = diagnosis.hints();
    diagnosis.hints.extend(failed_steps);
    Ok(diagnosis)
}

/// The failing device's figures at the failure, from one source: the observer's, else torch's
/// message, else (no figures in the message) the device read after the exception unwound.
struct AtError {
    source: FiguresSource,
    total: Option<u64>,
    allowed: Option<u64>,
    free: Option<u64>,
    allocated: Option<u64>,
    reserved: Option<u64>,
    pools: Option<TorchPools>,
    process_used: Option<u64>,
}

impl AtError {
    fn of(observed: Option<Observed>, parsed: &OomMessage, gpu: Option<&GpuReading>) -> AtError {
        let total = parsed.capacity.or(gpu.map(|g| g.total));
        // Torch's own use of the device, which no stats call gives: the message's, else the read's
        // (the cached segments stay reserved through the unwind, so it barely moves).
        let process_used = parsed.process_used.or(gpu.and_then(|g| g.process_used));
        if let Some(o) = observed {
            return AtError {
                source: FiguresSource::Observer,
                total,
                allowed: parsed.allowed.or(total.filter(|&t| o.limit < t).map(|_| o.limit)),
                free: Some(o.free),
                allocated: Some(o.allocated.all),
                reserved: Some(o.reserved.all),
                pools: Some(TorchPools { allocated: o.allocated, reserved: o.reserved }),
                process_used,
            };
        }
        if let (Some(allocated), Some(unallocated)) = (parsed.allocated, parsed.reserved_unallocated) {
            return AtError {
                source: FiguresSource::Message,
                total,
                allowed: parsed.allowed,
                free: parsed.free,
                allocated: Some(allocated),
                reserved: Some(allocated + unallocated),
                pools: None,
                process_used,
            };
        }
        let torch = gpu.and_then(|g| g.torch);
        AtError {
            source: FiguresSource::AfterUnwind,
            total,
            allowed: parsed.allowed,
            free: gpu.map(|g| g.free),
            allocated: torch.map(|t| t.allocated),
            reserved: torch.map(|t| t.reserved),
            pools: None,
            process_used,
        }
    }
}

/// What torch's history shows of a cell in which no training step ended: the loop's
/// repetitions and the floors of its quarter-seconds. Either can also be a single pass that is
/// too big (a model of 24 identical blocks repeats its allocations 24 times in one forward, each
/// keeping its activations for backward), so each counts only where no single pass explains it.
struct Unstepped<'a> {
    repetitions: Option<Rising>,
    floors: Option<Rising>,
    /// Torch's allocated after the rescue cleared the failed cell's frames.
    allocated_after: Option<u64>,
    failed_line: Option<&'a FailedLine>,
}

impl Unstepped<'_> {
    /// Still held after the rescue: the failed call's frames are gone, so what rose outlived
    /// it, held by the user's names; a single pass's activations would have come back.
    fn still_held(&self, run: &Rising) -> bool {
        let one_rise = run.total() / u64::from(run.rises.max(1));
        self.allocated_after.is_some_and(|after| after >= run.to.allocated - one_rise)
    }

    /// More repetitions than one pass has layers where the failure was inside a model (the
    /// product of its numbered containers' sizes), or none inside one.
    fn more_than_one_pass(&self, run: &Rising) -> bool {
        let layers = self.failed_line.and_then(|line| line.pass_layers);
        layers.is_none_or(|layers| run.iterations() >= layers)
    }

    /// The repetitions where they are no single pass's layers, the floors only where what rose
    /// is still held (they count no iterations, so no layer count can tell).
    fn runs(&self) -> (Option<Rising>, Option<Rising>) {
        let repetitions = self.repetitions.filter(|run| self.still_held(run) || self.more_than_one_pass(run));
        (repetitions, self.floors.filter(|run| self.still_held(run)))
    }
}

/// How memory crept on `torch_index` before the failure, from the recorder's series and, where
/// no step completed, the `repetitions` and `floors` of its history: the budget is the memory
/// fraction's cap, else the device.
fn creep(
    torch_index: u32,
    (repetitions, within_cell): (Option<Rising>, Option<Rising>),
    at_error: &AtError,
) -> Option<Creep> {
    let series = recorder::series(torch_index);
    let runs = RisingRuns {
        steps: series.as_ref().and_then(|s| s.steps.rising),
        repetitions,
        within_cell,
        cells: series.as_ref().and_then(|s| {
            let run = s.cells.rising?;
            // The run's rises that the ring still holds.
            let kept = s.cells.recent.len().min(run.rises as usize + 1);
            let levels: Vec<u64> =
                s.cells.recent.iter().skip(s.cells.recent.len() - kept).map(|r| r.allocated).collect();
            report::same_rises(&levels).then_some(run)
        }),
    };
    Creep::find(runs, at_error.allowed.or(at_error.total)?, at_error.allocated?)
}

/// Whether the flight recorder could have recorded the failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecorderState {
    /// Turned off by `gpuexp.config(flight_recorder=False)`.
    Off,
    /// On, but gpuexp is not active (no experiment open, the cell log off): it does not run.
    Idle,
    /// On while gpuexp is active.
    Wanted,
}

/// Why no allocation record holds the OOM, for the diagnosis.
fn no_record_why(world: &impl RescueWorld) -> String {
    match world.recorder() {
        RecorderState::Off => "the flight recorder is off: gpuexp.config(flight_recorder=True)".into(),
        RecorderState::Idle => {
            "the flight recorder runs only while an experiment is open or the cell log is on (%gpuexp log on)".into()
        }
        RecorderState::Wanted if world.history_enabled() => {
            "the allocation record holds no OOM of the size torch's message names".into()
        }
        RecorderState::Wanted => {
            "no allocation record ran: the recorder starts at the first cell or experiment after CUDA is initialised"
                .into()
        }
    }
}

fn process_name(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).map(|n| n.trim().to_string()).unwrap_or_else(|_| "?".into())
}

#[cfg(test)]
mod tests;
