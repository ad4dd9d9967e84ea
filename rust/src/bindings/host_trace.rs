//! Host memory by source line for experiments opened with `trace="host"` or `"all"`, through
//! `tracemalloc`: a snapshot at opening and one at finish (before the teardown deletes
//! anything), their difference handed to `crate::trace::host` as plain frames and sizes.
//! gpuexp starts tracemalloc where it is not tracing and stops it after the last experiment
//! that needed it, since tracing slows every allocation; a tracemalloc the user started is
//! shared and left running (`crate::recording_lease` decides, as for torch's history).

use std::collections::HashMap;

use pyo3::exceptions::PyKeyboardInterrupt;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyList, PyString};

use super::interrupts::Held;
use super::trace::PyNamer;
use crate::fork::{Guard, PerProcess};
use crate::recording_lease::{Change, Lease};
use crate::report::Report;
use crate::trace::{self, HostGrowth, HostTrace, SiteRule, TraceKinds, HOST_FRAMES, TOP_SITES};

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
static TRACING: PerProcess<Lease<()>> = PerProcess::new(Lease::new);

fn tracing() -> Guard<'static, Lease<()>> {
    TRACING.lock()
}

/// One experiment's share of the host tracing: what was live at its opening, counted negative,
/// and a marker allocated then, whose trace is gone at finish if tracemalloc was stopped since.
pub(super) struct HostWindow {
    start: Result<(HostGrowth, Py<PyAny>), String>,
}

/// Joins (or starts) tracemalloc for an experiment that opens now and reads what is live (with
/// the interrupts `held` let through: a tracemalloc of the user's may hold many traces);
/// returns notes for the start.
pub(super) fn open(py: Python, held: &Held) -> (HostWindow, Vec<String>) {
    let mut notes = Vec::new();
    let start = (|| -> PyResult<(HostGrowth, Py<PyAny>)> {
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
        let mut live = HostGrowth::default();
        held.let_through(py, || tally_live(py, &mut live, -1))?;
        let marker = PyByteArray::new(py, &[0; 8]).into_any().unbind();
        Ok((live, marker))
    })();
    let start = start.map_err(|e| {
        if e.is_instance_of::<PyKeyboardInterrupt>(py) {
            "trace: interrupted while tracemalloc's traces were read at opening, so there is no host table".into()
        } else {
            format!("trace: tracemalloc's snapshot at opening failed ({e})")
        }
    });
    (HostWindow { start }, notes)
}

/// Adds what tracemalloc traces now to `growth`, `sign` times each trace's size and count. Reads
/// tracemalloc's raw traces (the list `take_snapshot` wraps), grouped by traceback in Rust: its
/// `compare_to` builds Python objects for each trace, which took minutes at half a million.
/// Checks for signals as it goes, so the stop button ends it once interrupts are let through.
fn tally_live(py: Python, growth: &mut HostGrowth, sign: i64) -> PyResult<()> {
    let tracemalloc = py.import("tracemalloc")?;
    let own: String = tracemalloc.getattr("__file__")?.extract()?;
    growth.frames = tracemalloc.call_method0("get_traceback_limit")?.extract()?;
    let traces = tracemalloc.call_method0("_get_traces")?;
    let traces = traces.cast::<PyList>()?;
    // tracemalloc hands each distinct traceback out as one tuple: grouped by that tuple first,
    // each traceback's frames are read once.
    let mut by_traceback: HashMap<usize, (Bound<PyAny>, i64, i64)> = HashMap::new();
    for (index, trace) in traces.iter().enumerate() {
        if index % 16_384 == 0 {
            py.check_signals()?;
        }
        // (domain, size, traceback, total frames); the traceback innermost first.
        let size: i64 = trace.get_item(1)?.extract()?;
        let traceback = trace.get_item(2)?;
        let entry = by_traceback.entry(traceback.as_ptr() as usize).or_insert((traceback, 0, 0));
        entry.1 += size;
        entry.2 += 1;
    }
    // Filenames are interned by tracemalloc too: each is read once.
    let mut frames: HashMap<(usize, u32), u32> = HashMap::new();
    for (index, (traceback, bytes, count)) in by_traceback.into_values().enumerate() {
        if index % 4_096 == 0 {
            py.check_signals()?;
        }
        let mut stack = Vec::new();
        for frame in traceback.try_iter()? {
            let frame = frame?;
            let filename = frame.get_item(0)?;
            let line: u32 = frame.get_item(1)?.extract().unwrap_or(0);
            let key = (filename.as_ptr() as usize, line);
            let id = match frames.get(&key) {
                Some(&id) => id,
                None => {
                    let id = growth.stacks.intern_frame(&filename.extract::<String>()?, line, "");
                    frames.insert(key, id);
                    id
                }
            };
            stack.push(id);
        }
        // tracemalloc's own allocations (its snapshot's objects) are not the user's.
        if stack.first().is_some_and(|&frame| growth.stacks.frame_filename(frame) == own) {
            continue;
        }
        let stack = growth.stacks.intern_stack(&stack);
        growth.tally(stack, sign * bytes, sign * count);
    }
    Ok(())
}

/// The host's growth by site at finish, or why there is none; the tracing ends where this was
/// its last experiment.
pub(super) struct HostFinding {
    trace: Option<HostTrace>,
    notes: Vec<String>,
}

/// Whether the tracing that `marker`'s experiment opened under still runs: tracemalloc forgets
/// every trace when stopped, so a marker without one means it was stopped since (and perhaps
/// started again, by the user's code: then that tracing is theirs).
enum Since {
    Running,
    Stopped,
    Restarted,
}

fn since(py: Python, marker: &Py<PyAny>) -> PyResult<Since> {
    let tracemalloc = py.import("tracemalloc")?;
    if !tracemalloc.call_method0("is_tracing")?.extract::<bool>()? {
        return Ok(Since::Stopped);
    }
    let traced = !tracemalloc.call_method1("get_object_traceback", (marker,))?.is_none();
    Ok(if traced { Since::Running } else { Since::Restarted })
}

/// Reads the growth since `window` opened, before the teardown deletes anything. Interrupts are
/// let through while tracemalloc's traces are read (`held`): the stop button then ends the
/// reading, and the experiment finishes without the host table.
pub(super) fn finish(py: Python, window: HostWindow, held: &Held) -> HostFinding {
    let mut notes = Vec::new();
    let read = window.start.and_then(|(mut growth, marker)| {
        let since = since(py, &marker).map_err(|e| format!("trace: reading tracemalloc at finish failed ({e})"))?;
        drop(marker);
        match since {
            Since::Running => {}
            Since::Stopped => {
                return Err("trace: tracemalloc was stopped during the experiment (tracemalloc.stop()), so there is \
                            no host table"
                    .into())
            }
            Since::Restarted => {
                notes.push(restarted());
                // What was live at opening was forgotten at the stop: everything live now came after it.
                growth = HostGrowth::default();
            }
        }
        match held.let_through(py, || tally_live(py, &mut growth, 1)) {
            Ok(()) => Ok(growth),
            Err(e) if e.is_instance_of::<PyKeyboardInterrupt>(py) => Err(
                "trace: interrupted while the host's allocations were compared, so there is no host table (the rest \
                 of the experiment finished as usual)"
                    .into(),
            ),
            Err(e) => Err(format!("trace: reading tracemalloc at finish failed ({e})")),
        }
    });
    let mut finding = match read {
        Ok(growth) => {
            let namer = PyNamer::new(py);
            let trace = trace::host_sites(&growth, &SiteRule::default(), &namer, TOP_SITES, Vec::new());
            HostFinding { trace: Some(trace), notes }
        }
        Err(why) => {
            notes.push(why);
            HostFinding { trace: None, notes }
        }
    };
    finding.notes.extend(close(py));
    finding
}

/// A tracemalloc stopped and started again while an experiment traced is someone else's: gpuexp
/// leaves it running from then on.
fn restarted() -> String {
    tracing().disown();
    "trace: tracemalloc was stopped and started again during the experiment (by your code?): the host table \
     covers what was allocated since, and that tracing is left running"
        .into()
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
