//! What keeps an experiment to its own running code (the core's rules are in
//! `scope/running.rs`): its `with` blocks, its owner object, a finish on another thread and an
//! opening cut short.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use crate::bindings::registry::registry;
use crate::bindings::report::ReportPy;
use crate::bindings::scope::PyWorld;
use crate::scope::{lifecycle, Finish, ScopeId};

/// A `with` block over the experiment begins (`begins`) or ends.
#[pyfunction]
pub(in crate::bindings) fn scope_entered(id: ScopeId, begins: bool) {
    registry().entered(id, begins);
}

/// Whether the object `identity` (its `id()`) is the one that opened the experiment.
#[pyfunction]
pub(in crate::bindings) fn owned_by(id: ScopeId, identity: u64) -> bool {
    registry().owned_by(id, identity)
}

/// Raises RuntimeError where the object `identity` already owns an open experiment: a second
/// `__init__` on it would leave that one open with no owner.
#[pyfunction]
pub(in crate::bindings) fn refuse_reopening(identity: u64) -> PyResult<()> {
    match registry().open_owned_by(identity).map(|s| s.name.clone()) {
        Some(name) => Err(PyRuntimeError::new_err(format!(
            "this object is experiment {name:?}, still open: __init__ can't open another one in it. Finish it first \
             (exp.finish()), or make a new one: GPUExperiment('other')"
        ))),
        None => Ok(()),
    }
}

/// The experiment was finished on another thread: its teardown waits for the main thread's next
/// safe point. Returns whether that is the running cell's end (else the next opening or exit).
#[pyfunction]
#[pyo3(signature = (id, *, in_shell))]
pub(in crate::bindings) fn finish_off_main_thread(id: ScopeId, in_shell: bool) -> bool {
    registry().finished_off_main_thread(id, in_shell) == Finish::AtCellEnd
}

/// Finishes an experiment whose opening `cut_by` (an error's type) stopped before it was bound
/// to a name, deleting no name. Returns the reports and whether an interrupt came meanwhile.
#[pyfunction]
pub(in crate::bindings) fn finish_cut_opening(
    py: Python,
    id: ScopeId,
    cut_by: &str,
) -> PyResult<(Vec<ReportPy>, bool)> {
    let finished = lifecycle::finish_cut_opening(&mut PyWorld::new(py), id, cut_by)?;
    Ok((finished.reports.into_iter().map(ReportPy).collect(), finished.interrupted))
}
