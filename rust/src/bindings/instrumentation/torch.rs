//! Torch through its Python API: looked up in `sys.modules`, never imported. Its allocator
//! statistics, the per-process memory cap behind `limit=`, and the steps that give memory back.

use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyString};

use crate::fork::PerProcess;
use crate::snapshot::{GpuSelection, Snapshot, TorchProbe, TorchStats};
use crate::teardown::Step;
use crate::units;

/// Torch as the user's process has it: looked up in `sys.modules`, never imported.
pub(in crate::bindings) struct PyTorch<'py> {
    pub(in crate::bindings) torch: Option<Bound<'py, PyAny>>,
    cuda_initialised: bool,
}

impl<'py> PyTorch<'py> {
    pub(in crate::bindings) fn find(py: Python<'py>) -> PyTorch<'py> {
        // Every cell of the cell log starts here, so the names are interned and sys.modules is
        // looked up once: building them anew each time cost more than the lookups.
        static SYS_MODULES: PyOnceLock<Py<PyDict>> = PyOnceLock::new();
        let modules = SYS_MODULES.get_or_try_init(py, || -> PyResult<Py<PyDict>> {
            let modules = py.import(intern!(py, "sys"))?.getattr(intern!(py, "modules"))?;
            Ok(modules.cast_into::<PyDict>()?.unbind())
        });
        let torch = modules.ok().and_then(|modules| modules.bind(py).get_item(intern!(py, "torch")).ok().flatten());
        // `is_initialized` only reads a flag: it creates no CUDA context.
        let cuda_initialised = torch
            .as_ref()
            .and_then(|t| {
                let cuda = t.getattr(intern!(py, "cuda")).ok()?;
                cuda.call_method0(intern!(py, "is_initialized")).ok()?.extract::<bool>().ok()
            })
            .unwrap_or(false);
        PyTorch { torch, cuda_initialised }
    }

    pub(in crate::bindings) fn cuda(&self) -> Option<Bound<'py, PyAny>> {
        let torch = self.torch.as_ref().filter(|_| self.cuda_initialised)?;
        torch.getattr(intern!(torch.py(), "cuda")).ok()
    }

    fn c_module(&self) -> Option<Bound<'py, PyAny>> {
        let torch = self.torch.as_ref()?;
        torch.getattr(intern!(torch.py(), "_C")).ok()
    }

    pub(in crate::bindings) fn read_stats(&self, index: u32) -> PyResult<TorchStats> {
        let torch = self.torch.as_ref().expect("called only when imported");
        let py = torch.py();
        // The nested dict straight from C++; `torch.cuda.memory_stats` flattens it in Python, which costs more than the rest of a snapshot.
        let nested = torch.getattr(intern!(py, "_C"))?.call_method1(intern!(py, "_cuda_memoryStats"), (index,));
        let Ok(stats) = nested else { return flat_stats(torch, index) };
        let all = |group: &Bound<'py, PyString>| stats.get_item(group)?.get_item(intern!(py, "all"));
        let (allocated, reserved) = (all(intern!(py, "allocated_bytes"))?, all(intern!(py, "reserved_bytes"))?);
        let (current, peak) = (intern!(py, "current"), intern!(py, "peak"));
        Ok(TorchStats {
            allocated: allocated.get_item(current)?.extract()?,
            reserved: reserved.get_item(current)?.extract()?,
            peak_allocated: allocated.get_item(peak)?.extract()?,
            peak_reserved: reserved.get_item(peak)?.extract()?,
            num_ooms: stats.get_item(intern!(py, "num_ooms"))?.extract()?,
        })
    }

    /// Resets torch's peak counters on the devices a snapshot covered, only where a peak gpuexp
    /// reads is above its current figure: elsewhere the reset would change nothing it reads.
    /// The C function, not `torch.cuda.reset_peak_memory_stats`, which gpuexp wraps to notice
    /// the user's resets.
    pub(in crate::bindings) fn reset_peaks(&self, snapshot: &Snapshot) {
        let at_peak = |t: &TorchStats| t.peak_allocated <= t.allocated && t.peak_reserved <= t.reserved;
        let mut above_peak = snapshot.gpus.iter().filter(|g| g.torch.is_some_and(|t| !at_peak(&t))).peekable();
        if above_peak.peek().is_none() {
            return;
        }
        let Some(c) = self.c_module().filter(|_| self.cuda_initialised) else { return };
        let reset = intern!(c.py(), "_cuda_resetPeakMemoryStats");
        for gpu in above_peak {
            let _ = c.call_method1(reset, (gpu.torch_index,));
        }
    }
}

fn flat_stats(torch: &Bound<PyAny>, index: u32) -> PyResult<TorchStats> {
    let stats = torch.getattr("cuda")?.call_method1("memory_stats", (index,))?;
    let get =
        |key: &str| -> PyResult<u64> { Ok(stats.get_item(key).ok().map(|v| v.extract()).transpose()?.unwrap_or(0)) };
    Ok(TorchStats {
        allocated: get("allocated_bytes.all.current")?,
        reserved: get("reserved_bytes.all.current")?,
        peak_allocated: get("allocated_bytes.all.peak")?,
        peak_reserved: get("reserved_bytes.all.peak")?,
        num_ooms: get("num_ooms")?,
    })
}

impl TorchProbe for PyTorch<'_> {
    fn imported(&self) -> bool {
        self.torch.is_some()
    }

    fn device_uuids(&self) -> Option<Vec<String>> {
        // Torch's devices are fixed once CUDA is initialised, so they are read once per process.
        static UUIDS: PerProcess<Option<Vec<String>>> = PerProcess::new(|| None);
        let cuda = self.cuda()?;
        let mut cached = UUIDS.lock();
        if let Some(uuids) = cached.as_ref() {
            return Some(uuids.clone());
        }
        let count: u32 = cuda.call_method0("device_count").ok()?.extract().ok()?;
        let uuids = (0..count)
            .map(|i| {
                let props = cuda.call_method1("get_device_properties", (i,)).ok()?;
                props.getattr("uuid").ok()?.str().ok().map(|s| s.to_string())
            })
            .collect::<Option<Vec<String>>>()?;
        *cached = Some(uuids.clone());
        Some(uuids)
    }

    fn stats(&self, torch_index: u32) -> Option<TorchStats> {
        self.torch.as_ref()?;
        if !self.cuda_initialised {
            return Some(TorchStats::default());
        }
        self.read_stats(torch_index).ok()
    }
}

/// Caps torch's allocations on the scope's GPUs at `limit` bytes each (its per-process memory
/// fraction), to rehearse a smaller card; returns the fractions to restore.
pub(in crate::bindings) fn apply_limit(py: Python, selection: &GpuSelection, limit: u64) -> PyResult<Vec<(u32, f64)>> {
    let torch = PyTorch::find(py);
    let Some(torch_module) = torch.torch.as_ref() else {
        return Err(PyValueError::new_err("limit= caps torch's allocations: import torch first"));
    };
    let cuda = torch_module.getattr("cuda")?;
    // `is_available` asks the driver for a device count: it creates no CUDA context.
    if !cuda.call_method0("is_available")?.extract::<bool>()? {
        return Err(PyValueError::new_err(
            "limit= caps torch's CUDA allocations, but torch sees no CUDA GPU here: drop limit=, \
             or run on a machine where torch.cuda.is_available() is True",
        ));
    }
    let count: u32 = cuda.call_method0("device_count")?.extract()?;
    let devices: Vec<u32> = match selection {
        GpuSelection::Only(devices) => devices.clone(),
        GpuSelection::AllVisible => (0..count).collect(),
        GpuSelection::None => return Err(PyValueError::new_err("limit= applies to GPUs: use GPUExperiment")),
    };
    let memory = cuda.getattr("memory")?;
    let mut previous = Vec::new();
    for device in devices {
        let total: u64 = cuda.call_method1("get_device_properties", (device,))?.getattr("total_memory")?.extract()?;
        if limit > total {
            return Err(PyValueError::new_err(format!(
                "limit={} is more than cuda:{device} has ({}): pass a smaller size",
                units::bytes(limit),
                units::bytes(total)
            )));
        }
        let before = match memory.getattr("get_per_process_memory_fraction") {
            Ok(get) => get.call1((device,))?.extract()?,
            Err(_) => 1.0,
        };
        cuda.call_method1("set_per_process_memory_fraction", (limit as f64 / total as f64, device))?;
        previous.push((device, before));
    }
    Ok(previous)
}

pub(in crate::bindings) fn restore_limit(py: Python, limited: &[(u32, f64)]) -> PyResult<()> {
    if limited.is_empty() {
        return Ok(());
    }
    let cuda = py.import("torch")?.getattr("cuda")?;
    for (device, fraction) in limited {
        cuda.call_method1("set_per_process_memory_fraction", (*fraction, *device))?;
    }
    Ok(())
}

/// One of the steps that give memory back once nothing refers to it ([`teardown::RELEASE`]).
pub(in crate::bindings) fn release(py: Python, step: Step) -> PyResult<()> {
    let torch = PyTorch::find(py);
    match (step, torch.cuda()) {
        (Step::CollectGarbage, _) => py.import("gc")?.call_method0("collect").map(drop),
        (Step::FreeCublasWorkspaces, Some(_)) => {
            let c = torch.torch.as_ref().expect("cuda implies torch").getattr("_C")?;
            if c.hasattr("_cuda_clearCublasWorkspaces")? {
                c.call_method0("_cuda_clearCublasWorkspaces")?;
            }
            Ok(())
        }
        (Step::EmptyCache, Some(cuda)) => cuda.call_method0("empty_cache").map(drop),
        _ => Ok(()),
    }
}
