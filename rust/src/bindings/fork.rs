//! `os.register_at_fork`'s hooks: background threads are kept out of NVML across a fork, and a
//! forked child starts clean: no open scope, no cell log, no history, no reference into the
//! parent's namespace, no sampler thread it would wait for, no store of the parent's.

use pyo3::prelude::*;

use super::ranks;
use super::scope;
use crate::fork;
use crate::peak_sampler;

/// The GIL stays held: the background threads never take it, and no other Python thread
/// should run now.
#[pyfunction]
pub(super) fn before_fork() {
    peak_sampler::hold_for_fork();
    fork::hold();
}

#[pyfunction]
pub(super) fn after_fork_in_parent() {
    fork::release();
    peak_sampler::release_after_fork(false);
}

/// Threads and sockets of the parent are forgotten, never joined or closed, since they don't
/// exist here or aren't ours.
#[pyfunction]
pub(super) fn after_fork_in_child() {
    fork::release();
    peak_sampler::release_after_fork(true);
    scope::forget_in_child();
    ranks::forget_in_child();
}
