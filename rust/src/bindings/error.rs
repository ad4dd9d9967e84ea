//! Errors cross into Python here, once: each kind of core error becomes one Python exception.

use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;

create_exception!(
    gpuexp,
    NvmlUnavailable,
    PyRuntimeError,
    "NVIDIA's management library (NVML) could not be opened: no NVIDIA driver on this machine, or none this process can load."
);
