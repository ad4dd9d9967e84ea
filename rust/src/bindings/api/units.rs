//! Sizes and intervals read as people write them, for the Python side's arguments.

use pyo3::prelude::*;
use pyo3::types::PyBool;

use crate::units;

/// Bytes from "24GiB", "512MiB" or a number.
#[pyfunction]
pub(in crate::bindings) fn parse_size(text: &str) -> PyResult<u64> {
    Ok(units::parse_size(text)?)
}

/// Seconds from 0.1, "100ms", "1s" or "2min": a number is seconds, anything else is read as text.
#[pyfunction]
pub(in crate::bindings) fn parse_interval(interval: &Bound<PyAny>) -> PyResult<f64> {
    let parsed = match interval.extract::<f64>() {
        // True is an int to Python, but no one means one second by it.
        Ok(seconds) if !interval.is_instance_of::<PyBool>() => units::interval_of_seconds(seconds),
        _ => units::parse_interval(&interval.str()?.to_cow()?),
    };
    Ok(parsed?.as_secs_f64())
}
