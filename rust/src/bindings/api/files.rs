//! The one way Python's writers (the history, a figure) put a file on disk: the core's atomic
//! writer (`crate::files::write_atomically`), with the GIL released while it writes and syncs.

use std::path::PathBuf;

use pyo3::prelude::*;

/// Replaces `path` with `data` atomically: the old file or the new one, never a cut-off one;
/// the old file's mode kept; no temporary file left on failure.
#[pyfunction]
pub(in crate::bindings) fn write_atomically(py: Python, path: PathBuf, data: &[u8]) -> PyResult<()> {
    Ok(py.detach(|| crate::files::write_atomically(&path, data))?)
}
