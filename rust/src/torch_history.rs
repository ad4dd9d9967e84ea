//! Torch's CUDA allocation history for its three clients: experiments opened with `trace=True`
//! and the cell log's trace (with stacks), and the flight recorder (events only). The lease
//! (`crate::recording_lease`) decides; this module runs its decisions in a fixed order over
//! [`TorchMemory`], which the bindings implement over `torch.cuda.memory` and the tests over a
//! fake. gpuexp starts the recording where none runs, runs it in the strongest mode a client
//! asked for, and stops it when the last client leaves; a recording the user or a framework
//! started is shared and left exactly as it was. While any client with stacks holds a share,
//! module hooks mark allocations with their `nn.Module` path.

use crate::fork::{Guard, PerProcess};
use crate::recording_lease::{Change, HistoryMode, Lease};

/// Entries the ring buffer keeps, in either mode (torch would scramble a ring buffer that a
/// restart shrinks): a GPT-2 training step recorded about 1,700 and a resnet50 step about 2,000
/// on an H100 (../shared/gpu/README.md), so 200,000 cover about a hundred steps. Its host
/// memory is stated in docs/trace.md.
pub const MAX_ENTRIES: u64 = 200_000;

/// A forked child's torch records nothing of the parent's: its first client starts its own.
static HISTORY: PerProcess<Lease<HistoryMode>> = PerProcess::new(Lease::new);

fn lease() -> Guard<'static, Lease<HistoryMode>> {
    HISTORY.lock()
}

/// Now in Unix microseconds: the clock of torch's `time_us`.
pub fn now_us() -> i64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    i64::try_from(since.as_micros()).unwrap_or(i64::MAX)
}

/// Why there is no CUDA allocation to record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Missing {
    Torch,
    CudaGpu,
    /// `torch.cuda.memory` could not be reached.
    Failed(String),
}

/// What to trace instead where there is no CUDA allocation to record.
const TRACE_HOST: &str =
    "trace=\"host\" traces the host's memory instead (Python's objects and NumPy's arrays, through tracemalloc)";

impl Missing {
    pub fn why(&self) -> String {
        match self {
            Missing::Torch => {
                format!("trace=True records torch's CUDA allocations: import torch first, or {TRACE_HOST}")
            }
            Missing::CudaGpu => {
                format!("trace=True records torch's CUDA allocations, and torch sees no CUDA GPU: {TRACE_HOST}")
            }
            Missing::Failed(e) => e.clone(),
        }
    }
}

/// Torch's allocator and its history, as the bindings reach them (never importing torch).
pub trait TorchMemory {
    /// Whether torch with a CUDA GPU is there to record.
    fn available(&self) -> Result<(), Missing>;
    /// Whether a recording runs now (gpuexp's or anyone's).
    fn history_enabled(&self) -> bool;
    fn cuda_initialised(&self) -> bool;
    fn init_cuda(&self) -> Result<(), String>;
    /// Runs the recording in `mode` with [`MAX_ENTRIES`] (None: stops it).
    fn record(&self, mode: Option<HistoryMode>) -> Result<(), String>;
    /// Keeps the allocator's state at `time_us`, just before gpuexp starts a recording.
    fn take_opening(&self, time_us: i64);
    /// The recording gpuexp started stopped: its opening state describes no history now.
    fn forget_opening(&self);
    /// Puts the module-path hooks on (or takes them off). Ok(Some): why they were not put on.
    fn module_paths(&self, install: bool) -> Result<Option<String>, String>;
}

/// The module hooks put on or taken off; a note where that did not happen.
fn module_paths(world: &dyn TorchMemory, install: bool) -> Option<String> {
    match world.module_paths(install) {
        Ok(why) => why.map(|why| format!("trace: {why}")),
        Err(e) => Some(format!("trace: module paths failed ({e})")),
    }
}

/// Starts, switches or stops torch's recording as the lease decided: the allocator's state is
/// taken just before a start (its blocks' exact sizes, see `crate::trace::opening`) and
/// forgotten at a stop.
fn apply(world: &dyn TorchMemory, change: Change<HistoryMode>) -> Result<(), String> {
    match change {
        Change::Keep => Ok(()),
        Change::Stop => {
            world.forget_opening();
            world.record(None)
        }
        Change::Start(mode) => {
            world.take_opening(now_us());
            world.record(Some(mode))
        }
        Change::Switch(mode) => world.record(Some(mode)),
    }
}

/// How a client's share of the recording began.
pub struct Joined {
    /// The ring buffer's size where gpuexp runs the recording (None: the user's).
    pub max_entries: Option<u64>,
    pub notes: Vec<String>,
}

/// A client joins the recording in `mode` (torch must have CUDA initialised: its allocator
/// keeps no setting for a device it has not). Err: why there is no recording.
pub fn join(world: &dyn TorchMemory, mode: HistoryMode) -> Result<Joined, String> {
    world.available().map_err(|missing| missing.why())?;
    let mut notes = Vec::new();
    let first_with_stacks = mode == HistoryMode::Stacks && lease().clients_of(HistoryMode::Stacks) == 0;
    if first_with_stacks {
        notes.extend(module_paths(world, true));
    }
    let change = lease().join(mode, || world.history_enabled());
    if let Err(e) = apply(world, change) {
        if matches!(change, Change::Start(_)) {
            world.forget_opening();
        }
        lease().join_failed(mode);
        if first_with_stacks {
            let _ = module_paths(world, false);
        }
        return Err(format!("torch did not start recording its allocations ({e})"));
    }
    let max_entries = lease().started_by_gpuexp().then_some(MAX_ENTRIES);
    if max_entries.is_none() && mode == HistoryMode::Stacks {
        notes.push("trace: shares the allocation history already being recorded, and leaves it as it was".into());
    }
    Ok(Joined { max_entries, notes })
}

/// A client of `mode` leaves: the recording steps down to what the others need, or stops where
/// gpuexp started it and this was the last. Returns a note where that failed.
pub fn leave(world: &dyn TorchMemory, mode: HistoryMode) -> Option<String> {
    let change = lease().leave(mode);
    let mut unhooked = None;
    if mode == HistoryMode::Stacks && lease().clients_of(HistoryMode::Stacks) == 0 {
        unhooked = module_paths(world, false);
    }
    if change == Change::Keep {
        return unhooked;
    }
    world.available().ok()?;
    apply(world, change).err().map(|e| format!("trace: torch's recording could not be changed ({e})")).or(unhooked)
}

/// One traced experiment's (or the cell log's) share of the recording.
pub struct TraceWindow {
    /// When the experiment opened, in Unix microseconds: the clock of torch's `time_us`.
    pub opened_us: i64,
    /// The ring buffer's size, so a full one can be told apart (None: the user's recording).
    pub max_entries: Option<u64>,
    /// Why there is nothing to read at finish, where that was known at open.
    pub unavailable: Option<String>,
}

/// Joins (or starts) the recording, with stacks, for a traced experiment that opens now. Torch's
/// allocator keeps no setting for devices it has not initialised, so CUDA is initialised first:
/// its context then belongs to the start figures, not to the experiment.
pub fn open(world: &dyn TorchMemory) -> (TraceWindow, Vec<String>) {
    let mut notes = Vec::new();
    let opened_us = now_us();
    let unavailable = |why: String| TraceWindow { opened_us, max_entries: None, unavailable: Some(why) };
    if let Err(missing) = world.available() {
        return (unavailable(missing.why()), notes);
    }
    if !world.cuda_initialised() {
        if let Err(e) = world.init_cuda() {
            return (unavailable(format!("trace=True: CUDA could not be initialised ({e})")), notes);
        }
        notes.push("trace=True initialised CUDA: its context is in the start figures".into());
    }
    match join(world, HistoryMode::Stacks) {
        Ok(joined) => {
            notes.extend(joined.notes);
            (TraceWindow { opened_us, max_entries: joined.max_entries, unavailable: None }, notes)
        }
        Err(why) => (unavailable(format!("trace=True: {why}")), notes),
    }
}

/// A traced experiment's (or the cell log's) share ends. Returns a note where changing the
/// recording failed.
pub fn close(world: &dyn TorchMemory) -> Option<String> {
    leave(world, HistoryMode::Stacks)
}

/// Sampled stacks: on the steps not sampled the recording runs without stacks (the lease's
/// ceiling; every client keeps its share) and the module hooks come off; on a sampled step both
/// come back. Returns whether the recording records stacks then: also where it is the user's
/// (never switched), or where the switch failed and it still does.
pub fn set_stacks(world: &dyn TorchMemory, on: bool) -> bool {
    let change = lease().set_ceiling((!on).then_some(HistoryMode::Events));
    if change != Change::Keep {
        let applied = world.available().map_err(|missing| missing.why()).and_then(|()| apply(world, change));
        if applied.is_err() {
            // Torch kept the mode it had: so does the lease.
            lease().set_ceiling(on.then_some(HistoryMode::Events));
        }
    }
    let (with_stacks, hooked) = {
        let lease = lease();
        (
            lease.mode() != Some(HistoryMode::Events),
            lease.started_by_gpuexp() && lease.clients_of(HistoryMode::Stacks) > 0,
        )
    };
    if hooked && change != Change::Keep {
        // A hook's failure note is the report's at its finish; here it only stops the marking.
        let _ = module_paths(world, with_stacks);
    }
    with_stacks
}

/// How many clients with stacks share the recording: open traced experiments and the cell log.
pub fn open_shares() -> usize {
    lease().clients_of(HistoryMode::Stacks)
}

#[cfg(test)]
#[path = "torch_history_tests.rs"]
mod tests;
