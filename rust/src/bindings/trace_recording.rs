//! Torch's CUDA allocation history for experiments opened with `trace=True`, through
//! `torch.cuda.memory` (looked up, never imported). gpuexp starts the recording where none runs
//! and stops it when the last traced experiment that needed it finishes, so no allocator hook
//! outlives the experiments (pytorch #153571: hooks left behind slow every later allocation).
//! A recording the user or a framework started is shared and left exactly as it was. While any
//! traced experiment is open, module hooks mark allocations with their `nn.Module` path.

use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::torch::PyTorch;

/// Entries the ring buffer keeps: a GPT-2 training step recorded about 1,700 and a resnet50
/// step about 2,000 on an H100 (../shared/gpu/README.md's measurements of torch's history), so
/// 200,000 cover about a hundred steps at a few hundred bytes of host memory each.
const MAX_ENTRIES: u64 = 200_000;

/// What this process's traced experiments share: how many are open, and whether gpuexp
/// started the recording (then it stops it after the last one).
struct Recording {
    pid: u32,
    open: usize,
    started_by_gpuexp: bool,
    max_entries: u64,
}

static RECORDING: Mutex<Option<Recording>> = Mutex::new(None);

fn recording() -> std::sync::MutexGuard<'static, Option<Recording>> {
    let mut guard = RECORDING.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    // A forked child's torch records nothing of the parent's: its own count starts at zero.
    if guard.as_ref().is_some_and(|r| r.pid != crate::fork::pid()) {
        *guard = None;
    }
    guard
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

/// Joins (or starts) the recording for an experiment that opens now. Torch's allocator keeps no
/// setting for devices it has not initialised, so CUDA is initialised first: its context then
/// belongs to the start figures, not to the experiment.
pub(super) fn open(py: Python) -> (TraceWindow, Vec<String>) {
    let mut notes = Vec::new();
    let opened_us = now_us();
    let unavailable = |why: String| TraceWindow { opened_us, max_entries: None, unavailable: Some(why) };
    let (torch, memory) = match memory_module(py) {
        Ok(found) => found,
        Err(why) => return (unavailable(why), notes),
    };
    if torch.cuda().is_none() {
        let initialised = torch.torch.as_ref().map(|t| t.getattr("cuda").and_then(|c| c.call_method0("init")));
        if let Some(Err(e)) = initialised {
            return (unavailable(format!("trace=True: CUDA could not be initialised ({e})")), notes);
        }
        notes.push("trace=True initialised CUDA: its context is in the start figures".into());
    }
    let mut shared = recording();
    if let Some(running) = shared.as_mut() {
        running.open += 1;
        let max_entries = running.started_by_gpuexp.then_some(running.max_entries);
        return (TraceWindow { opened_us, max_entries, unavailable: None }, notes);
    }
    notes.extend(module_paths(py, "install"));
    if history_enabled(&torch) {
        *shared = Some(Recording { pid: crate::fork::pid(), open: 1, started_by_gpuexp: false, max_entries: 0 });
        notes.push("trace: shares the allocation history already being recorded, and leaves it as it was".into());
        return (TraceWindow { opened_us, max_entries: None, unavailable: None }, notes);
    }
    let max_entries = MAX_ENTRIES;
    let started = (|| -> PyResult<()> {
        let kwargs = PyDict::new(py);
        kwargs.set_item("max_entries", max_entries)?;
        kwargs.set_item("stacks", "python")?;
        memory.call_method("_record_memory_history", ("all",), Some(&kwargs))?;
        Ok(())
    })();
    match started {
        Ok(()) => {
            *shared = Some(Recording { pid: crate::fork::pid(), open: 1, started_by_gpuexp: true, max_entries });
            (TraceWindow { opened_us, max_entries: Some(max_entries), unavailable: None }, notes)
        }
        Err(e) => {
            notes.extend(module_paths(py, "uninstall"));
            (unavailable(format!("trace=True: torch did not start recording ({e})")), notes)
        }
    }
}

/// How many share the recording gpuexp knows of: open traced experiments and the cell log.
pub(super) fn open_shares() -> usize {
    recording().as_ref().map_or(0, |running| running.open)
}

/// Torch's snapshot now, pickled (protocol 4, as memory_viz and Mosaic read it): the format the
/// core reads, whether it comes from this process or from a file.
pub(super) fn snapshot_pickle(py: Python) -> Result<Vec<u8>, String> {
    let (_, memory) = memory_module(py)?;
    let snapshot = memory.call_method0("_snapshot").map_err(|e| format!("torch's snapshot failed: {e}"))?;
    let pickled = py
        .import("pickle")
        .and_then(|pickle| pickle.call_method1("dumps", (snapshot, 4)))
        .map_err(|e| format!("torch's snapshot could not be pickled: {e}"))?;
    pickled.extract::<Vec<u8>>().map_err(|e| e.to_string())
}

/// An experiment's share ends; the last one to leave a recording gpuexp started stops it.
/// Returns a note where stopping failed.
pub(super) fn close(py: Python) -> Option<String> {
    let mut shared = recording();
    let running = shared.as_mut()?;
    running.open = running.open.saturating_sub(1);
    if running.open > 0 {
        return None;
    }
    let started_by_gpuexp = running.started_by_gpuexp;
    *shared = None;
    drop(shared);
    let unhooked = module_paths(py, "uninstall");
    if !started_by_gpuexp {
        return unhooked;
    }
    let (_, memory) = memory_module(py).ok()?;
    let kwargs = PyDict::new(py);
    kwargs
        .set_item("enabled", py.None())
        .and_then(|()| memory.call_method("_record_memory_history", (), Some(&kwargs)))
        .err()
        .map(|e| format!("trace: torch's recording could not be stopped ({e})"))
}
