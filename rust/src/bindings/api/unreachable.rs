//! Experiments that nothing refers to any more, found where their teardown can't run (by the
//! cycle collector, on another thread): the core's rules are in `scope/unreachable.rs`; this
//! file tells the core how the last reference went, what the user's names hold at a cell's end,
//! and runs the teardowns once a safe point comes.

use std::collections::BTreeSet;

use pyo3::prelude::*;

use crate::bindings::namespace::identities;
use crate::bindings::registry::registry;
use crate::bindings::report::ReportPy;
use crate::bindings::scope::finish_unreachable_at;
use crate::scope::{Dropped, Finish, SafePoint, ScopeId};

/// The experiment's last reference went (its `__del__` runs): returns whether to finish it now.
/// Otherwise the core keeps it for the next safe point (see [`crate::scope::Finish`]).
#[pyfunction]
#[pyo3(signature = (id, *, by_collector, on_main_thread, in_shell))]
pub(in crate::bindings) fn dropped(id: ScopeId, by_collector: bool, on_main_thread: bool, in_shell: bool) -> bool {
    registry().dropped(id, Dropped { by_collector, on_main_thread, in_shell }) == Finish::Now
}

#[pyfunction]
pub(in crate::bindings) fn unreachable_waiting() -> bool {
    registry().unreachable_waiting()
}

/// A cell has ended: `sighted`, the open experiments one of the user's names still leads to;
/// `bound`, the names the cell's own code binds; `adapter`, the user's namespace.
#[pyfunction]
pub(in crate::bindings) fn cell_ended_for_scopes(
    adapter: Bound<PyAny>,
    sighted: BTreeSet<ScopeId>,
    bound: BTreeSet<String>,
) -> PyResult<()> {
    let names = identities(&adapter)?;
    registry().cell_ended(&sighted, names, &bound);
    Ok(())
}

/// Finishes the experiments found unreachable whose teardown may run at `at` ("cell_end",
/// "opening", "exit"). Returns their reports, innermost first, and whether an interrupt was held.
#[pyfunction]
pub(in crate::bindings) fn finish_unreachable(py: Python, at: &str) -> PyResult<(Vec<ReportPy>, bool)> {
    finish_unreachable_at(py, SafePoint::parse(at)?)
}
