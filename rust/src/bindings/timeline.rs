//! The timeline (`gpuexp.Monitor`, `timeline=True`) and what the `gpuexp` command reads.

use super::*;

/// A timeline recorded by a native thread; `gpuexp.Monitor` is its Python face.
#[pyclass(name = "Timeline", module = "gpuexp")]
pub(super) struct TimelinePy(pub(super) monitor::Monitor);

#[pymethods]
impl TimelinePy {
    #[new]
    #[pyo3(signature = (interval_s, path=None, gpus=true))]
    fn new(interval_s: f64, path: Option<std::path::PathBuf>, gpus: bool) -> PyResult<Self> {
        let interval = std::time::Duration::try_from_secs_f64(interval_s)
            .map_err(|_| PyValueError::new_err(format!("interval must be a positive time such as \"100ms\"; got {interval_s} s")))?;
        monitor::Monitor::start(interval, path, gpus).map(TimelinePy).map_err(PyValueError::new_err)
    }

    /// The samples so far, as a JSON list (the Python side turns it into dicts).
    fn samples_json(&self) -> String {
        serde_json::to_string(&self.0.samples()).expect("samples always serialise")
    }

    #[getter]
    fn running(&self) -> bool {
        self.0.is_running()
    }

    #[getter]
    fn failure(&self) -> Option<String> {
        self.0.failure()
    }

    fn stop(&mut self, py: Python) {
        let monitor = &mut self.0;
        py.detach(|| monitor.stop());
    }
}

/// Bytes in binary units, as every gpuexp table writes them ("1.50 GiB").
#[pyfunction]
pub(super) fn format_bytes(n: u64) -> String {
    report::bytes(n)
}

/// `gpuexp status`: the driver, and every GPU with its compute processes (when asked), as JSON.
#[pyfunction]
#[pyo3(signature = (cuda_order=false, processes=true))]
pub(super) fn gpu_status(cuda_order: bool, processes: bool) -> PyResult<String> {
    let (driver, cuda) = nvml::driver_versions().map_err(pyo3::exceptions::PyRuntimeError::new_err)?;
    let devices = nvml::device_status(cuda_order, processes).map_err(pyo3::exceptions::PyRuntimeError::new_err)?;
    let order = if cuda_order { "cuda" } else { "nvml" };
    Ok(serde_json::json!({"driver": driver, "cuda": cuda, "order": order, "devices": devices}).to_string())
}
