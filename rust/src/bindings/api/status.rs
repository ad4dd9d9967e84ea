//! The `gpuexp` command's `status` and `watch`, rendered in Rust.

use pyo3::prelude::*;

use crate::status;
use crate::watch;

/// ``gpuexp status``: the driver, and every GPU with its compute processes (when asked). Raises
/// NvmlUnavailable without a driver.
#[pyclass(name = "GpuStatus", module = "gpuexp", frozen)]
pub(in crate::bindings) struct GpuStatusPy(status::Status);

#[pymethods]
impl GpuStatusPy {
    #[new]
    #[pyo3(signature = (cuda_order=false, processes=true))]
    fn new(cuda_order: bool, processes: bool) -> PyResult<Self> {
        Ok(GpuStatusPy(status::Status::read(cuda_order, processes)?))
    }

    /// The newest CUDA version the driver supports, e.g. "13.0".
    #[getter]
    fn cuda(&self) -> &str {
        &self.0.cuda
    }

    fn __len__(&self) -> usize {
        self.0.devices.len()
    }

    /// The driver and every GPU as JSON text, as ``gpuexp status --json`` prints it.
    fn to_json(&self) -> String {
        serde_json::to_string(&self.0).expect("a status always serialises")
    }

    fn __str__(&self) -> String {
        self.0.to_text()
    }
}

/// ``gpuexp watch``: devices opened once, then a refresh every interval, written from Rust.
/// Raises NvmlUnavailable without a driver; ``style`` is "live", "csv" or "json".
#[pyclass(name = "Watch", module = "gpuexp", frozen)]
pub(in crate::bindings) struct WatchPy(watch::Watch);

#[pymethods]
impl WatchPy {
    #[new]
    fn new(cuda_order: bool, style: &str, interval_s: f64) -> PyResult<Self> {
        let (style, interval) = (style.parse()?, watch::refresh_interval(interval_s)?);
        Ok(WatchPy(watch::Watch::open(cuda_order, style, interval)?))
    }

    /// Runs until Ctrl-C (KeyboardInterrupt) or until standard output closes, writing to ``log``
    /// too when given; ``redraw`` clears the screen before each refresh.
    #[pyo3(signature = (log=None, redraw=false))]
    fn run(&self, py: Python, log: Option<std::path::PathBuf>, redraw: bool) -> PyResult<()> {
        let mut output = watch::Output::open(log.as_deref(), redraw)?;
        let mut interrupted = None;
        let ran = self.0.run(&mut output, |left| {
            py.detach(|| watch::nap(left));
            match py.check_signals() {
                Ok(()) => true,
                Err(signal) => {
                    interrupted = Some(signal);
                    false
                }
            }
        });
        ran?;
        interrupted.map_or(Ok(()), Err)
    }
}
