//! The kernel's one registry of scopes, cell windows and reports, behind a lock.

use std::sync::{LazyLock, Mutex, MutexGuard};

use pyo3::exceptions::PyKeyError;
use pyo3::PyErr;

use crate::scope::{Registry, ScopeId};

static REGISTRY: LazyLock<Mutex<Registry>> = LazyLock::new(|| Mutex::new(Registry::default()));

/// Never held while Python code runs: teardown can run `__del__` methods that call back in.
pub(in crate::bindings) fn registry() -> MutexGuard<'static, Registry> {
    crate::locks::lock(&REGISTRY)
}

pub(in crate::bindings) fn unknown(id: ScopeId) -> PyErr {
    PyKeyError::new_err(format!("no experiment scope with id {id}"))
}
