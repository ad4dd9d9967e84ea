//! Torch's CUDA allocation history, through `torch.cuda.memory` (looked up, never imported):
//! `crate::torch_history` runs the recording's lease over [`PyMemory`], which only calls torch
//! and gpuexp's module-path hooks.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::bindings::torch::PyTorch;
use crate::bindings::trace_opening::WindowKey;
use crate::recording_lease::HistoryMode;
use crate::torch_history::{self, Missing, TorchMemory};
pub(in crate::bindings) use crate::torch_history::{now_us, TraceWindow, MAX_ENTRIES};

/// Torch's allocator as this process's Python reaches it.
pub(in crate::bindings) struct PyMemory<'py> {
    py: Python<'py>,
    torch: PyTorch<'py>,
}

impl<'py> PyMemory<'py> {
    pub(in crate::bindings) fn new(py: Python<'py>) -> PyMemory<'py> {
        PyMemory { py, torch: PyTorch::find(py) }
    }

    fn memory(&self) -> Result<Bound<'py, PyAny>, Missing> {
        let module = self.torch.torch.as_ref().ok_or(Missing::Torch)?;
        let cuda = module.getattr("cuda").map_err(|e| Missing::Failed(e.to_string()))?;
        let available = cuda.call_method0("is_available").and_then(|a| a.extract::<bool>()).unwrap_or(false);
        if !available {
            return Err(Missing::CudaGpu);
        }
        cuda.getattr("memory").map_err(|e| Missing::Failed(e.to_string()))
    }
}

impl TorchMemory for PyMemory<'_> {
    fn available(&self) -> Result<(), Missing> {
        self.memory().map(drop)
    }

    fn history_enabled(&self) -> bool {
        history_enabled(&self.torch)
    }

    fn cuda_initialised(&self) -> bool {
        self.torch.cuda().is_some()
    }

    fn init_cuda(&self) -> Result<(), String> {
        let torch = self.torch.torch.as_ref().ok_or("torch is not imported")?;
        torch.getattr("cuda").and_then(|c| c.call_method0("init")).map(drop).map_err(|e| e.to_string())
    }

    fn record(&self, mode: Option<HistoryMode>) -> Result<(), String> {
        let memory = self.memory().map_err(|missing| missing.why())?;
        let kwargs = PyDict::new(self.py);
        let called = (|| {
            let Some(mode) = mode else {
                kwargs.set_item("enabled", self.py.None())?;
                return memory.call_method("_record_memory_history", (), Some(&kwargs)).map(drop);
            };
            kwargs.set_item("max_entries", MAX_ENTRIES)?;
            kwargs.set_item("stacks", "python")?;
            match mode {
                // Stacks at each allocation and free: what the peak's sites and the diffs read.
                HistoryMode::Stacks => kwargs.set_item("context", "all")?,
                HistoryMode::Events => kwargs.set_item("context", self.py.None())?,
            }
            memory.call_method("_record_memory_history", ("all",), Some(&kwargs)).map(drop)
        })();
        called.map_err(|e| e.to_string())
    }

    fn take_opening(&self, time_us: i64) {
        if let Ok(memory) = self.memory() {
            crate::bindings::trace_opening::take(&memory, MAX_ENTRIES, time_us);
        }
    }

    fn forget_opening(&self) {
        crate::bindings::trace_opening::forget();
    }

    /// python/gpuexp/module_paths.py: torch hooks, so that `torch.compile` skips them.
    fn module_paths(&self, install: bool) -> Result<Option<String>, String> {
        let method = if install { "install" } else { "uninstall" };
        let called = self.py.import("gpuexp.module_paths").and_then(|module| module.call_method0(method));
        called.map(|why| why.extract::<Option<String>>().ok().flatten()).map_err(|e| e.to_string())
    }
}

pub(in crate::bindings) fn history_enabled(torch: &PyTorch) -> bool {
    torch
        .torch
        .as_ref()
        .and_then(|t| t.getattr("_C").ok()?.call_method0("_cuda_isHistoryEnabled").ok()?.extract().ok())
        .unwrap_or(false)
}

pub(in crate::bindings) fn open(py: Python) -> (TraceWindow, Vec<String>) {
    torch_history::open(&PyMemory::new(py))
}

/// Opens a traced experiment's share (`open`) and its place in the sampled stacks: its first
/// step records stacks, later ones as the sampler decides (`trace_sampling`).
pub(in crate::bindings) fn open_experiment(py: Python) -> (TraceWindow, Vec<String>) {
    let (window, notes) = open(py);
    if window.unavailable.is_none() {
        crate::bindings::trace_sampling::begin(py, window.opened_us);
    }
    (window, notes)
}

pub(in crate::bindings) fn set_stacks(py: Python, on: bool) -> bool {
    torch_history::set_stacks(&PyMemory::new(py), on)
}

/// Torch's snapshot now, pickled (protocol 4, as memory_viz and Mosaic read it): the format the
/// core reads, whether it comes from this process or from a file. What makes its replay exact
/// (the state at the recording's start, the experiment's `window`) goes in under `gpuexp`.
pub(in crate::bindings) fn snapshot_pickle(py: Python, window: Option<&WindowKey>) -> Result<Vec<u8>, String> {
    let memory = PyMemory::new(py).memory().map_err(|missing| missing.why())?;
    let snapshot = memory.call_method0("_snapshot").map_err(|e| format!("torch's snapshot failed: {e}"))?;
    crate::bindings::trace_opening::annotate(py, &snapshot, window).map_err(|e| format!("torch's snapshot: {e}"))?;
    let pickled = py
        .import("pickle")
        .and_then(|pickle| pickle.call_method1("dumps", (snapshot, 4)))
        .map_err(|e| format!("torch's snapshot could not be pickled: {e}"))?;
    pickled.extract::<Vec<u8>>().map_err(|e| e.to_string())
}

pub(in crate::bindings) fn close(py: Python) -> Option<String> {
    torch_history::close(&PyMemory::new(py))
}
