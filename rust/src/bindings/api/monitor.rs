//! The monitor: a timeline of the host and every GPU recorded by a native thread.
//! `gpuexp.Monitor` starts and stops one, and adds `to_pandas()` and `plot()`.

use pyo3::prelude::*;

use crate::{monitor, units};

/// The native recorder behind ``gpuexp.Monitor``: it starts at construction, sampling the host
/// and every GPU each ``interval_s`` from a native thread, and appends each sample to ``path``
/// when given.
#[pyclass(name = "Monitor", module = "gpuexp")]
pub(in crate::bindings) struct MonitorPy(monitor::Monitor);

#[pymethods]
impl MonitorPy {
    #[new]
    #[pyo3(signature = (interval_s, path=None, gpus=true))]
    fn new(py: Python, interval_s: f64, path: Option<std::path::PathBuf>, gpus: bool) -> PyResult<Self> {
        let interval = units::interval_of_seconds(interval_s)?;
        // Opening a file and NVML may wait (a slow disk, a network mount): never with the GIL held.
        Ok(MonitorPy(py.detach(|| monitor::Monitor::start(interval, path, gpus))?))
    }

    /// Refuses what `Monitor(...)` would refuse at start, without starting or writing anything.
    #[staticmethod]
    #[pyo3(signature = (interval_s, path=None))]
    fn check(py: Python, interval_s: f64, path: Option<std::path::PathBuf>) -> PyResult<()> {
        let interval = units::interval_of_seconds(interval_s)?;
        Ok(py.detach(|| monitor::Monitor::check(interval, path.as_deref()))?)
    }

    /// The samples so far, as a JSON list (the Python side turns it into dicts).
    fn samples_json(&self) -> String {
        serde_json::to_string(&self.0.samples()).expect("samples always serialise")
    }

    /// Whether the recording thread still runs.
    #[getter]
    fn running(&self) -> bool {
        self.0.is_running()
    }

    /// Why the recording stopped early (a write to ``path`` failed, ...); None while it is well.
    #[getter]
    fn failure(&self) -> Option<String> {
        self.0.failure()
    }

    /// Stops the recording thread and waits for it; the samples stay.
    fn stop(&mut self, py: Python) {
        let monitor = &mut self.0;
        py.detach(|| monitor.stop());
    }
}
