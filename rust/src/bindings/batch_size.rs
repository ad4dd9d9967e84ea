//! The batch-size finder, driven from Python one trial at a time, and what it measures with.

use super::*;
use crate::snapshot::Gauge;

/// The search of `gpuexp.find_batch_size`, driven from Python one trial at a time. Its table
/// is the result a user sees.
#[pyclass(name = "BatchSizeResult", module = "gpuexp")]
pub(super) struct BatchSearchPy(pub(super) finder::Search);

#[pymethods]
impl BatchSearchPy {
    #[new]
    #[pyo3(signature = (start, max, usable, margin=0.05, power_of_two=false, multiple_of=1, verifications=2, steps_per_trial=2))]
    #[allow(clippy::too_many_arguments)] // one per keyword of find_batch_size
    fn new(
        start: u64,
        max: u64,
        usable: u64,
        margin: f64,
        power_of_two: bool,
        multiple_of: u64,
        verifications: u32,
        steps_per_trial: u32,
    ) -> PyResult<Self> {
        if !(0.0..1.0).contains(&margin) {
            return Err(PyValueError::new_err(format!(
                "margin must be a share below 1, e.g. margin=0.05; got {margin}"
            )));
        }
        let settings =
            finder::Settings { start, max, usable, margin, power_of_two, multiple_of, verifications, steps_per_trial };
        finder::Search::new(settings).map(BatchSearchPy).map_err(PyValueError::new_err)
    }

    /// The next trial as (batch size, why), or None when the search is done.
    fn next_trial(&mut self) -> Option<(u64, String)> {
        match self.0.next_trial() {
            finder::Next::Try(batch, role) => Some((batch, role.label().to_string())),
            finder::Next::Done => None,
        }
    }

    /// Records a trial: `peaks` are torch's exact peak allocated and reserved, None after an
    /// out-of-memory error.
    fn record(&mut self, batch: u64, role: &str, peaks: Option<(u64, u64)>, seconds: f64) -> PyResult<()> {
        let Some(role) = finder::Role::ALL.into_iter().find(|r| r.label() == role) else {
            return Err(PyValueError::new_err(format!("unknown trial role {role:?}")));
        };
        let outcome = match peaks {
            Some((peak, reserved)) => finder::Outcome::Fit { peak, reserved },
            None => finder::Outcome::OutOfMemory,
        };
        self.0.record(finder::Trial { batch, outcome, seconds, role });
        Ok(())
    }

    /// The largest batch size that ran within the budget (None if none did).
    #[getter]
    fn batch_size(&self) -> Option<u64> {
        self.0.batch_size
    }
    #[getter]
    fn trials(&self) -> usize {
        self.0.trials.len()
    }
    #[getter]
    fn verdict(&self) -> &str {
        &self.0.verdict
    }
}

shown_as_table!(BatchSearchPy, |this| &this.0, this.0.grid());

/// Opens a peak window for one trial on a GPU; returns its id.
#[pyfunction]
pub(super) fn measure_begin(py: Python) -> u64 {
    let (start, torch) = take_snapshot(py, &GpuSelection::AllVisible);
    let window = registry().open_window(&start);
    reset_counters(&torch, &start);
    window
}

/// Closes a trial's window: torch's exact peaks allocated and reserved on the GPU during it.
#[pyfunction]
pub(super) fn measure_end(py: Python, window: u64, device: u32) -> PyResult<Option<(u64, u64)>> {
    let (end, _) = take_snapshot(py, &GpuSelection::AllVisible);
    let mut registry = registry();
    let Some(gpu) = end.gpus.iter().find(|g| g.torch_index == device) else {
        registry.peaks.close(window);
        return Err(PyValueError::new_err(format!("cuda:{device} is not a visible GPU")));
    };
    let gauges = [Gauge::TorchAllocated(gpu.uuid.clone()), Gauge::TorchReserved(gpu.uuid.clone())];
    let [allocated, reserved] = registry.close_window(window, &end, gauges);
    Ok(allocated.zip(reserved))
}

/// What a step's torch peak may use on a GPU: what torch holds plus what NVML has free, or `limit`.
#[pyfunction]
#[pyo3(signature = (device, limit=None))]
pub(super) fn usable_memory(py: Python, device: u32, limit: Option<u64>) -> PyResult<u64> {
    let (now, _) = take_snapshot(py, &GpuSelection::AllVisible);
    let gpu =
        now.gpus.iter().find(|g| g.torch_index == device).ok_or_else(|| {
            PyValueError::new_err(format!("cuda:{device} is not a visible GPU (or NVML cannot read it)"))
        })?;
    let torch = gpu.torch.unwrap_or_default();
    Ok(limit.unwrap_or(torch.reserved + gpu.free))
}

/// Bytes from "24GiB", "512MiB" or a number.
#[pyfunction]
pub(super) fn parse_size(text: &str) -> PyResult<u64> {
    units::parse_size(text).map_err(PyValueError::new_err)
}

/// gc and torch's cache, between trials and after a failed one (cuBLAS's workspaces stay).
#[pyfunction]
pub(super) fn release_between_trials(py: Python) -> PyResult<()> {
    teardown::BETWEEN_TRIALS.iter().try_for_each(|step| release(py, *step))
}
