//! Forks, as Python sees them. The core's hook (`crate::fork`) sees every fork and keeps NVML
//! and the sampler clean across it; state kept in a `PerProcess` is fresh in a child by itself.
//! What is left here is the bindings' state that is not yet kept so, which
//! `os.register_at_fork` forgets in a child: no open scope, no cell log, no history, no
//! reference into the parent's namespace.

use pyo3::prelude::*;

use crate::bindings::scope;
use crate::fork;

/// Whether this process was forked from one that had gpuexp loaded (a rank forked from a
/// kernel): it runs no cells, and the shell is the parent's.
#[pyfunction]
pub(in crate::bindings) fn is_forked_child() -> bool {
    fork::is_forked_child()
}

/// Threads and sockets of the parent are forgotten, never joined or closed, since they don't
/// exist here or aren't ours.
#[pyfunction]
pub(in crate::bindings) fn after_fork_in_child() {
    scope::forget_in_child();
}
