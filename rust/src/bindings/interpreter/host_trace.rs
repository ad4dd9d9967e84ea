//! Host memory by source line for experiments opened with `trace="host"` or `"all"`, through
//! `tracemalloc`: `crate::host_tracing` runs the opening and the finish over [`PyTracemalloc`],
//! which only calls Python's module and groups its raw traces.

use std::collections::HashMap;

use pyo3::exceptions::PyKeyboardInterrupt;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyList, PyString};

use crate::bindings::interrupts::HeldInterrupts;
use crate::bindings::trace::PyNamer;
use crate::host_tracing::{self, Failure, Tracemalloc};
use crate::trace::{self, HostGrowth, TraceKinds, HOST_FRAMES};

/// `trace=`: True, False, "cuda", "host" or "all" (None: the setting's default).
pub(in crate::bindings) fn trace_kinds(value: &Bound<PyAny>) -> PyResult<TraceKinds> {
    if let Ok(flag) = value.cast::<PyBool>() {
        return Ok(TraceKinds::from_bool(flag.is_true()));
    }
    if let Ok(text) = value.cast::<PyString>() {
        return Ok(TraceKinds::parse(&text.to_cow()?)?);
    }
    let shown = value.repr().map_or_else(|_| "?".into(), |r| r.to_string());
    Err(trace::kinds::rejected(&shown).into())
}

pub(in crate::bindings) type HostWindow = host_tracing::HostWindow<Py<PyAny>>;
pub(in crate::bindings) use crate::host_tracing::HostFinding;

/// Python's tracemalloc, with the interrupts `held` let through while its traces are read (a
/// tracemalloc of the user's may hold many).
struct PyTracemalloc<'a, 'py> {
    py: Python<'py>,
    held: &'a HeldInterrupts<'py>,
}

impl From<PyErr> for Failure {
    fn from(error: PyErr) -> Failure {
        Python::attach(|py| {
            if error.is_instance_of::<PyKeyboardInterrupt>(py) {
                Failure::Interrupted
            } else {
                Failure::Failed(error.to_string())
            }
        })
    }
}

impl PyTracemalloc<'_, '_> {
    fn call(&self, method: &str) -> PyResult<Bound<'_, PyAny>> {
        self.py.import("tracemalloc")?.call_method0(method)
    }
}

impl Tracemalloc for PyTracemalloc<'_, '_> {
    type Marker = Py<PyAny>;

    fn is_tracing(&self) -> Result<bool, Failure> {
        Ok(self.call("is_tracing")?.extract::<bool>()?)
    }

    fn start(&self) -> Result<(), Failure> {
        Ok(self.py.import("tracemalloc")?.call_method1("start", (HOST_FRAMES,)).map(drop)?)
    }

    fn stop(&self) -> Result<(), Failure> {
        Ok(self.call("stop").map(drop)?)
    }

    fn tally_live(&self, growth: &mut HostGrowth, sign: i64) -> Result<(), Failure> {
        Ok(self.held.let_through(self.py, || tally_live(self.py, growth, sign))?)
    }

    fn marker(&self) -> Result<Py<PyAny>, Failure> {
        Ok(PyByteArray::new(self.py, &[0; 8]).into_any().unbind())
    }

    fn traces(&self, marker: &Py<PyAny>) -> Result<bool, Failure> {
        let traceback = self.py.import("tracemalloc")?.call_method1("get_object_traceback", (marker,))?;
        Ok(!traceback.is_none())
    }
}

/// Joins (or starts) tracemalloc for an experiment that opens now and reads what is live;
/// returns notes for the start.
pub(in crate::bindings) fn open(py: Python, held: &HeldInterrupts) -> (HostWindow, Vec<String>) {
    host_tracing::open(&PyTracemalloc { py, held })
}

/// Reads the growth since `window` opened, before the teardown deletes anything (interrupts let
/// through as `held` says).
pub(in crate::bindings) fn finish(py: Python, window: HostWindow, held: &HeldInterrupts) -> HostFinding {
    host_tracing::finish(&PyTracemalloc { py, held }, window, &PyNamer::new(py))
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
