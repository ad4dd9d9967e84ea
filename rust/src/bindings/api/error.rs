//! Errors cross into Python here, once: each kind of core error becomes one Python exception.

use pyo3::create_exception;
use pyo3::exceptions::{PyKeyboardInterrupt, PyModuleNotFoundError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::PyErr;

use crate::error::Error;

create_exception!(
    gpuexp,
    NvmlUnavailable,
    PyRuntimeError,
    "A RuntimeError: NVIDIA's management library (NVML) could not be opened: no NVIDIA driver on\nthis machine, or none this process can load."
);

/// The `?` at every call site: no driver → NvmlUnavailable (a RuntimeError), a failed NVML call
/// → RuntimeError, bad input → ValueError, a file or the terminal → OSError, a stop asked for
/// → KeyboardInterrupt (where the bindings have no interrupt of Python's own to raise).
impl From<Error> for PyErr {
    fn from(error: Error) -> PyErr {
        match error {
            Error::NoDriver(message) => NvmlUnavailable::new_err(message),
            Error::Nvml(message) => PyRuntimeError::new_err(message),
            Error::InvalidArgument(message) => PyValueError::new_err(message),
            Error::Io(message) => PyOSError::new_err(message),
            Error::Interrupted => PyKeyboardInterrupt::new_err(()),
        }
    }
}

/// An optional library a method draws with (pandas, matplotlib): its absence says what to install.
pub(in crate::bindings) fn optional<'py>(
    py: Python<'py>,
    module: &str,
    method: &str,
) -> PyResult<Bound<'py, PyModule>> {
    py.import(module).map_err(|error| {
        if error.is_instance_of::<PyModuleNotFoundError>(py) {
            PyModuleNotFoundError::new_err(format!("{method} needs {module}: pip install {module}"))
        } else {
            error
        }
    })
}

create_exception!(
    gpuexp,
    NoEstimate,
    PyRuntimeError,
    "A RuntimeError: the step could not run under fake tensors, so no estimate was made; the\nmessage names the operator and why."
);
