//! Host memory by source line for experiments opened with `trace="host"` or `"all"`, through
//! `tracemalloc`: a snapshot at opening and one at finish (before the teardown deletes
//! anything), their difference handed to `crate::trace::host` as plain frames and sizes.
//! gpuexp starts tracemalloc where it is not tracing and stops it after the last experiment
//! that needed it, since tracing slows every allocation; a tracemalloc the user started is
//! shared and left running (`crate::recording_lease` decides, as for torch's history).

use std::sync::{Mutex, MutexGuard};

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyString};

use super::trace::PyNamer;
use crate::recording_lease::{Change, Lease};
use crate::report::Report;
use crate::trace::{self, HostGrowth, HostTrace, HostTraceback, SiteRule, TraceKinds, HOST_FRAMES, TOP_SITES};

/// `trace=`: True, False, "cuda", "host" or "all" (None: the setting's default).
pub(super) fn trace_kinds(value: &Bound<PyAny>) -> PyResult<TraceKinds> {
    if let Ok(flag) = value.cast::<PyBool>() {
        return Ok(TraceKinds::from_bool(flag.is_true()));
    }
    if let Ok(text) = value.cast::<PyString>() {
        return Ok(TraceKinds::parse(&text.to_cow()?)?);
    }
    let shown = value.repr().map_or_else(|_| "?".into(), |r| r.to_string());
    Err(trace::kinds::rejected(&shown).into())
}

/// The experiments that trace the host share tracemalloc (it has one mode).
static TRACING: Mutex<Lease<()>> = Mutex::new(Lease::new());

fn tracing() -> MutexGuard<'static, Lease<()>> {
    let mut guard = TRACING.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    guard.in_process(crate::fork::pid());
    guard
}

/// One experiment's share of the host tracing: tracemalloc's snapshot at its opening.
pub(super) struct HostWindow {
    start: Result<Py<PyAny>, String>,
}

/// Joins (or starts) tracemalloc for an experiment that opens now and takes its opening
/// snapshot; returns notes for the start.
pub(super) fn open(py: Python) -> (HostWindow, Vec<String>) {
    let mut notes = Vec::new();
    let start = (|| -> PyResult<Py<PyAny>> {
        let tracemalloc = py.import("tracemalloc")?;
        let mut users = false;
        let change = tracing().join((), || {
            users = tracemalloc.call_method0("is_tracing").and_then(|t| t.extract::<bool>()).unwrap_or(false);
            users
        });
        if users {
            notes.push("trace: shares the tracemalloc already tracing, and leaves it running".into());
        }
        if change == Change::Start(()) {
            if let Err(e) = tracemalloc.call_method1("start", (HOST_FRAMES,)) {
                tracing().join_failed(());
                return Err(e);
            }
        }
        Ok(tracemalloc.call_method0("take_snapshot")?.unbind())
    })();
    let start = start.map_err(|e| format!("trace: tracemalloc's snapshot at opening failed ({e})"));
    (HostWindow { start }, notes)
}

/// tracemalloc's own allocations (the opening snapshot, kept until finish) are not the user's.
fn without_tracemalloc<'py>(snapshot: &Bound<'py, PyAny>, own: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    snapshot.call_method1("filter_traces", (vec![own.clone()],))
}

/// What grew from `start` to now, per traceback, as the core reads it.
fn growth(py: Python, start: &Bound<PyAny>) -> PyResult<HostGrowth> {
    let tracemalloc = py.import("tracemalloc")?;
    let own = tracemalloc.getattr("Filter")?.call1((false, tracemalloc.getattr("__file__")?))?;
    let end = without_tracemalloc(&tracemalloc.call_method0("take_snapshot")?, &own)?;
    let start = without_tracemalloc(start, &own)?;
    let mut growth =
        HostGrowth { frames: tracemalloc.call_method0("get_traceback_limit")?.extract()?, ..HostGrowth::default() };
    for difference in end.call_method1("compare_to", (start, "traceback"))?.try_iter()? {
        let difference = difference?;
        let bytes: i64 = difference.getattr("size_diff")?.extract()?;
        let count: i64 = difference.getattr("count_diff")?.extract()?;
        if bytes == 0 && count == 0 {
            continue;
        }
        // A Traceback lists its frames oldest first; the core reads them innermost first.
        let mut frames = Vec::new();
        for frame in difference.getattr("traceback")?.try_iter()? {
            let frame = frame?;
            let filename: String = frame.getattr("filename")?.extract()?;
            let line: u32 = frame.getattr("lineno")?.extract().unwrap_or(0);
            frames.push(growth.stacks.intern_frame(&filename, line, ""));
        }
        frames.reverse();
        growth.tracebacks.push(HostTraceback { stack: growth.stacks.intern_stack(&frames), bytes, count });
    }
    Ok(growth)
}

/// The host's growth by site at finish, or why there is none; the tracing ends where this was
/// its last experiment.
pub(super) struct HostFinding {
    trace: Option<HostTrace>,
    notes: Vec<String>,
}

/// Reads the growth since `window` opened, before the teardown deletes anything.
pub(super) fn finish(py: Python, window: HostWindow) -> HostFinding {
    let read = window.start.and_then(|start| {
        growth(py, start.bind(py)).map_err(|e| format!("trace: reading tracemalloc at finish failed ({e})"))
    });
    let mut finding = match read {
        Ok(growth) => {
            let namer = PyNamer::new(py);
            let trace = trace::host_sites(&growth, &SiteRule::default(), &namer, TOP_SITES, Vec::new());
            HostFinding { trace: Some(trace), notes: Vec::new() }
        }
        Err(why) => HostFinding { trace: None, notes: vec![why] },
    };
    finding.notes.extend(close(py));
    finding
}

impl HostFinding {
    pub(super) fn complete_report(self, report: &mut Report) {
        report.host_trace = self.trace;
        report.notes.extend(self.notes);
    }
}

/// An experiment's share ends; the last one to leave a tracemalloc gpuexp started stops it.
fn close(py: Python) -> Option<String> {
    if tracing().leave(()) != Change::Stop {
        return None;
    }
    py.import("tracemalloc")
        .and_then(|tracemalloc| tracemalloc.call_method0("stop"))
        .err()
        .map(|e| format!("trace: tracemalloc could not be stopped ({e})"))
}
