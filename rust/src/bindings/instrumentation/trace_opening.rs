//! The allocator's state when gpuexp starts torch's allocation history, kept with the recording
//! and put into every snapshot of it under the key `gpuexp` (read by `crate::trace::opening`):
//! blocks from before the recording that it sees freed then have their exact sizes. Taken with
//! the history still off, the snapshot holds only the segments and costs about 0.2 ms.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::bindings::report::json_to_python;
use crate::fork::{Guard, PerProcess};
use crate::trace::annotation;
pub(in crate::bindings) use crate::trace::WindowKey;

/// (the state's `segments` list, when it was taken, the recording's cap).
struct State {
    segments: Py<PyAny>,
    time_us: i64,
    max_entries: u64,
}

/// A forked child's torch has none of the parent's recording.
static OPENING: PerProcess<Option<State>> = PerProcess::new(|| None);

fn opening() -> Guard<'static, Option<State>> {
    OPENING.lock()
}

/// Takes the state at `time_us`, just before gpuexp starts a recording capped at `max_entries`
/// (`memory` is `torch.cuda.memory`). A failure only leaves the sizes of older blocks to be inferred.
pub(in crate::bindings) fn take(memory: &Bound<PyAny>, max_entries: u64, time_us: i64) {
    let segments = memory.call_method0("_snapshot").and_then(|state| state.get_item("segments"));
    *opening() = segments.ok().map(|segments| State { segments: segments.unbind(), time_us, max_entries });
}

/// The recording gpuexp started has stopped: its state no longer describes any history.
pub(in crate::bindings) fn forget() {
    *opening() = None;
}

/// Adds the `gpuexp` key to torch's snapshot dict: the opening state where gpuexp started this
/// recording, then what `crate::trace::annotation` writes (the experiment's window where one is
/// given, and the step marks of sampled stacks).
pub(in crate::bindings) fn annotate(py: Python, snapshot: &Bound<PyAny>, window: Option<&WindowKey>) -> PyResult<()> {
    let key = PyDict::new(py);
    if let Some(state) = opening().as_ref() {
        let opening = PyDict::new(py);
        opening.set_item("time_us", state.time_us)?;
        opening.set_item("max_entries", state.max_entries)?;
        opening.set_item("segments", state.segments.bind(py))?;
        key.set_item("opening", opening)?;
    }
    let plain = annotation(window, &crate::bindings::trace_sampling::marks());
    if !plain.is_empty() {
        key.update(json_to_python(py, &serde_json::Value::Object(plain).to_string())?.cast::<PyDict>()?.as_mapping())?;
    }
    if !key.is_empty() {
        snapshot.set_item("gpuexp", key)?;
    }
    Ok(())
}
