//! Torch's CUDA allocation history, through `torch.cuda.memory` (looked up, never imported),
//! for its three clients: experiments opened with `trace=True` and the cell log's trace (with
//! stacks), and the flight recorder (events only). One `Lease` decides: gpuexp starts the
//! recording where none runs, runs it in the strongest mode a client asked for, and stops it
//! when the last client leaves, so no allocator hook outlives gpuexp's active state (pytorch
//! #153571: hooks left behind slow every later allocation). A recording the user or a framework
//! started is shared and left exactly as it was. While any client with stacks holds a share,
//! module hooks mark allocations with their `nn.Module` path.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::torch::PyTorch;
use super::trace_opening::WindowKey;
use crate::fork::{Guard, PerProcess};
use crate::recording_lease::{Change, HistoryMode, Lease};

/// Entries the ring buffer keeps, in either mode (torch would scramble a ring buffer that a
/// restart shrinks): a GPT-2 training step recorded about 1,700 and a resnet50 step about 2,000
/// on an H100 (../shared/gpu/README.md), so 200,000 cover about a hundred steps. Its host
/// memory is stated in docs/trace.md.
pub(super) const MAX_ENTRIES: u64 = 200_000;

/// A forked child's torch records nothing of the parent's: its first client starts its own.
static HISTORY: PerProcess<Lease<HistoryMode>> = PerProcess::new(Lease::new);

fn lease() -> Guard<'static, Lease<HistoryMode>> {
    HISTORY.lock()
}

/// One traced experiment's share of the recording.
pub(super) struct TraceWindow {
    /// When the experiment opened, in Unix microseconds: the clock of torch's `time_us`.
    pub(super) opened_us: i64,
    /// The ring buffer's size, so a full one can be told apart (None: the user's recording).
    pub(super) max_entries: Option<u64>,
    /// Why there is nothing to read at finish, where that was known at open.
    pub(super) unavailable: Option<String>,
}

pub(super) fn now_us() -> i64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    i64::try_from(since.as_micros()).unwrap_or(i64::MAX)
}

/// What to trace instead where there is no CUDA allocation to record.
const TRACE_HOST: &str =
    "trace=\"host\" traces the host's memory instead (Python's objects and NumPy's arrays, through tracemalloc)";

fn memory_module<'py>(py: Python<'py>) -> Result<(PyTorch<'py>, Bound<'py, PyAny>), String> {
    let torch = PyTorch::find(py);
    let module = torch
        .torch
        .as_ref()
        .ok_or_else(|| format!("trace=True records torch's CUDA allocations: import torch first, or {TRACE_HOST}"))?;
    let cuda = module.getattr("cuda").map_err(|e| e.to_string())?;
    let available = cuda.call_method0("is_available").and_then(|a| a.extract::<bool>()).unwrap_or(false);
    if !available {
        return Err(format!("trace=True records torch's CUDA allocations, and torch sees no CUDA GPU: {TRACE_HOST}"));
    }
    let memory = cuda.getattr("memory").map_err(|e| e.to_string())?;
    Ok((torch, memory))
}

/// Marks allocations with module paths (python/gpuexp/module_paths.py: torch hooks, so that
/// `torch.compile` skips them); `uninstall` removes the hooks. Returns why not, as a note.
fn module_paths(py: Python, method: &str) -> Option<String> {
    let called = py.import("gpuexp.module_paths").and_then(|module| module.call_method0(method));
    match called {
        Ok(why) => why.extract::<Option<String>>().ok().flatten().map(|why| format!("trace: {why}")),
        Err(e) => Some(format!("trace: module paths failed ({e})")),
    }
}

pub(super) fn history_enabled(torch: &PyTorch) -> bool {
    torch
        .torch
        .as_ref()
        .and_then(|t| t.getattr("_C").ok()?.call_method0("_cuda_isHistoryEnabled").ok()?.extract().ok())
        .unwrap_or(false)
}

/// Starts, switches or stops torch's recording as the lease decided.
fn apply(py: Python, memory: &Bound<PyAny>, change: Change<HistoryMode>) -> PyResult<()> {
    let kwargs = PyDict::new(py);
    let mode = match change {
        Change::Keep => return Ok(()),
        Change::Stop => {
            super::trace_opening::forget();
            kwargs.set_item("enabled", py.None())?;
            return memory.call_method("_record_memory_history", (), Some(&kwargs)).map(drop);
        }
        Change::Start(mode) => {
            // The allocator's state just before the history starts: the exact sizes of the blocks
            // made before it (see trace_opening).
            super::trace_opening::take(memory, MAX_ENTRIES, now_us());
            mode
        }
        Change::Switch(mode) => mode,
    };
    kwargs.set_item("max_entries", MAX_ENTRIES)?;
    kwargs.set_item("stacks", "python")?;
    match mode {
        // Stacks at each allocation and free: what the peak's sites and the diffs read.
        HistoryMode::Stacks => kwargs.set_item("context", "all")?,
        HistoryMode::Events => kwargs.set_item("context", py.None())?,
    }
    memory.call_method("_record_memory_history", ("all",), Some(&kwargs)).map(drop)
}

/// How a client's share of the recording began.
pub(super) struct Joined {
    /// The ring buffer's size where gpuexp runs the recording (None: the user's).
    pub(super) max_entries: Option<u64>,
    pub(super) notes: Vec<String>,
}

/// A client joins the recording in `mode` (torch must have CUDA initialised: its allocator
/// keeps no setting for a device it has not). Err: why there is no recording.
pub(super) fn join(py: Python, mode: HistoryMode) -> Result<Joined, String> {
    let (torch, memory) = memory_module(py)?;
    let mut notes = Vec::new();
    let first_with_stacks = mode == HistoryMode::Stacks && lease().clients_of(HistoryMode::Stacks) == 0;
    if first_with_stacks {
        notes.extend(module_paths(py, "install"));
    }
    let change = lease().join(mode, || history_enabled(&torch));
    if let Err(e) = apply(py, &memory, change) {
        if matches!(change, Change::Start(_)) {
            super::trace_opening::forget();
        }
        lease().join_failed(mode);
        if first_with_stacks {
            notes.extend(module_paths(py, "uninstall"));
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
pub(super) fn leave(py: Python, mode: HistoryMode) -> Option<String> {
    let change = lease().leave(mode);
    let mut unhooked = None;
    if mode == HistoryMode::Stacks && lease().clients_of(HistoryMode::Stacks) == 0 {
        unhooked = module_paths(py, "uninstall");
    }
    if change == Change::Keep {
        return unhooked;
    }
    let (_, memory) = memory_module(py).ok()?;
    apply(py, &memory, change)
        .err()
        .map(|e| format!("trace: torch's recording could not be changed ({e})"))
        .or(unhooked)
}

/// Joins (or starts) the recording, with stacks, for a traced experiment that opens now. Torch's
/// allocator keeps no setting for devices it has not initialised, so CUDA is initialised first:
/// its context then belongs to the start figures, not to the experiment.
pub(super) fn open(py: Python) -> (TraceWindow, Vec<String>) {
    let mut notes = Vec::new();
    let opened_us = now_us();
    let unavailable = |why: String| TraceWindow { opened_us, max_entries: None, unavailable: Some(why) };
    let torch = PyTorch::find(py);
    if let Err(why) = memory_module(py) {
        return (unavailable(why), notes);
    }
    if torch.cuda().is_none() {
        let initialised = torch.torch.as_ref().map(|t| t.getattr("cuda").and_then(|c| c.call_method0("init")));
        if let Some(Err(e)) = initialised {
            return (unavailable(format!("trace=True: CUDA could not be initialised ({e})")), notes);
        }
        notes.push("trace=True initialised CUDA: its context is in the start figures".into());
    }
    match join(py, HistoryMode::Stacks) {
        Ok(joined) => {
            notes.extend(joined.notes);
            (TraceWindow { opened_us, max_entries: joined.max_entries, unavailable: None }, notes)
        }
        Err(why) => (unavailable(format!("trace=True: {why}")), notes),
    }
}

/// Opens a traced experiment's share (`open`) and its place in the sampled stacks: its first
/// step records stacks, later ones as the sampler decides (`trace_sampling`).
pub(super) fn open_experiment(py: Python) -> (TraceWindow, Vec<String>) {
    let (window, notes) = open(py);
    if window.unavailable.is_none() {
        super::trace_sampling::begin(py, window.opened_us);
    }
    (window, notes)
}

/// Sampled stacks: on the steps not sampled the recording runs without stacks (the lease's
/// ceiling; every client keeps its share) and the module hooks come off; on a sampled step both
/// come back. Returns whether the recording records stacks then: also where it is the user's
/// (never switched), or where the switch failed and it still does.
pub(super) fn set_stacks(py: Python, on: bool) -> bool {
    let change = lease().set_ceiling((!on).then_some(HistoryMode::Events));
    if change != Change::Keep {
        let applied = memory_module(py).and_then(|(_, memory)| apply(py, &memory, change).map_err(|e| e.to_string()));
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
        let _ = module_paths(py, if with_stacks { "install" } else { "uninstall" });
    }
    with_stacks
}

/// How many clients with stacks share the recording: open traced experiments and the cell log.
pub(super) fn open_shares() -> usize {
    lease().clients_of(HistoryMode::Stacks)
}

/// Torch's snapshot now, pickled (protocol 4, as memory_viz and Mosaic read it): the format the
/// core reads, whether it comes from this process or from a file. What makes its replay exact
/// (the state at the recording's start, the experiment's `window`) goes in under `gpuexp`.
pub(super) fn snapshot_pickle(py: Python, window: Option<&WindowKey>) -> Result<Vec<u8>, String> {
    let (_, memory) = memory_module(py)?;
    let snapshot = memory.call_method0("_snapshot").map_err(|e| format!("torch's snapshot failed: {e}"))?;
    super::trace_opening::annotate(py, &snapshot, window).map_err(|e| format!("torch's snapshot: {e}"))?;
    let pickled = py
        .import("pickle")
        .and_then(|pickle| pickle.call_method1("dumps", (snapshot, 4)))
        .map_err(|e| format!("torch's snapshot could not be pickled: {e}"))?;
    pickled.extract::<Vec<u8>>().map_err(|e| e.to_string())
}

/// A traced experiment's (or the cell log's) share ends. Returns a note where changing the
/// recording failed.
pub(super) fn close(py: Python) -> Option<String> {
    leave(py, HistoryMode::Stacks)
}
