//! `gpuexp.explain`: how one device's memory adds up. The leak hunter's walk finds every tensor
//! with the path to it and the modules and optimizers on the way; their parameters, gradients,
//! buffers and state are told apart here; torch's allocator and NVML give the totals.

use std::collections::HashSet;
use std::time::Instant;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::bindings::error::NvmlUnavailable;
use crate::bindings::holders::{hunt_roots, roles_of, sum_roles, survey, Buffer, Memory};
use crate::bindings::rank_gpu;
use crate::bindings::report::json_to_python;
use crate::bindings::snapshot::take_snapshot;
use crate::error::Error;
use crate::explain::{Explanation, Found, GpuFigures, OtherProcess, Reading};
use crate::snapshot::{host, nvml, own_pids, GpuSelection};
use crate::uninspectable::Uninspectable;

fn gpu_figures(py: Python, index: u32) -> PyResult<GpuFigures> {
    let (snapshot, torch) = take_snapshot(py, &GpuSelection::Only(vec![index]));
    let gpu = snapshot.gpus.iter().find(|g| g.torch_index == index).ok_or_else(|| match nvml::available() {
        Err(Error::NoDriver(why)) => NvmlUnavailable::new_err(format!(
            "explain({index}): {why}, so this machine has no GPU to explain: explain('cpu') explains host memory"
        )),
        Err(why) => PyErr::from(why),
        Ok(()) => {
            PyValueError::new_err(format!("cuda:{index} is not a visible GPU: name one torch sees, e.g. explain(0)"))
        }
    })?;
    let stats = gpu.torch.unwrap_or_default();
    // The nested dict straight from C++, as snapshots read it: no CUDA context is created.
    let fragmented = match (torch.cuda(), torch.torch.as_ref()) {
        (Some(_), Some(module)) => module
            .getattr("_C")?
            .call_method1("_cuda_memoryStats", (index,))?
            .get_item("inactive_split_bytes")?
            .get_item("all")?
            .get_item("current")?
            .extract()?,
        _ => 0,
    };
    let others = nvml::other_processes(&gpu.uuid, &own_pids())
        .into_iter()
        .map(|(pid, bytes)| OtherProcess { pid, bytes })
        .collect();
    Ok(GpuFigures {
        torch_index: index,
        nvml_index: gpu.nvml_index,
        name: gpu.name.clone(),
        uuid: gpu.uuid.clone(),
        total: gpu.total,
        allocated: stats.allocated,
        reserved: stats.reserved,
        fragmented,
        process_used: gpu.process_used,
        device_used: gpu.device_used,
        others,
        nccl_grown: rank_gpu::nccl_share(index),
    })
}

/// How one device's memory adds up, in bytes by category (``gpuexp.explain()``). ``str()`` and
/// ``_repr_html_`` are its table.
#[pyclass(name = "Explanation", module = "gpuexp", frozen)]
pub(in crate::bindings) struct ExplanationPy(Explanation);

#[pymethods]
impl ExplanationPy {
    /// The device explained: ``cuda:N`` or ``cpu``.
    #[getter]
    fn device(&self) -> &str {
        &self.0.device
    }
    /// Bytes by category: parameters, gradients, optimizer_state, buffers, other_tensors,
    /// no_python_tensor, torch_cache, not_torch (None where a category does not apply).
    #[getter]
    fn categories<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        json_to_python(py, &serde_json::to_string(&self.0.categories).expect("categories serialise"))
    }
    /// The paths of the other tensors, largest first.
    #[getter]
    fn paths(&self) -> Vec<String> {
        self.0.holders.iter().map(|h| h.path.clone()).collect()
    }
    /// What the table alone would not say: a figure NVML withholds, parts that exceed a total, how
    /// many objects were visited.
    #[getter]
    fn notes(&self) -> Vec<String> {
        self.0.notes.clone()
    }
}

shown_as_table!(ExplanationPy, |this| &this.0, this.0.grid());

/// Explains a GPU's memory (by torch index) or, with None, the host's.
#[pyfunction]
#[pyo3(signature = (memory, adapter=None))]
pub(in crate::bindings) fn explain(
    py: Python,
    memory: Option<u32>,
    adapter: Option<Bound<PyAny>>,
) -> PyResult<ExplanationPy> {
    let started = Instant::now();
    let (memory, device) = match memory {
        Some(index) => (Memory::Cuda(index), format!("cuda:{index}")),
        None => (Memory::Host, "cpu".to_string()),
    };
    let roots = match &adapter {
        Some(adapter) => hunt_roots(adapter)?,
        None => Vec::new(),
    };
    let none = HashSet::new();
    let survey = survey(py, &memory, roots, &none)?;
    let roles = roles_of(py, &survey.owners, &memory)?;
    let sums = sum_roles(&survey, &roles, &none);
    let holders = survey.held.iter().filter(|(b, _)| !roles.contains_key(b)).map(|(_, h)| h.clone()).collect();
    let reached: HashSet<&Buffer> = survey.found.keys().chain(roles.keys()).collect();
    let unreachable = survey.live.iter().filter(|(b, _)| !reached.contains(b)).map(|(_, bytes)| bytes).sum();
    let reading = match memory {
        Memory::Cuda(index) => Reading::Gpu(gpu_figures(py, index)?),
        _ => Reading::Host { rss: host::read().rss },
    };
    let found = Found {
        roles: sums,
        holders,
        unreachable,
        objects_visited: survey.objects_visited,
        seconds: started.elapsed().as_secs_f64(),
    };
    let mut explanation = Explanation::new(&device, reading, found);
    explanation.notes.extend(Uninspectable { count: survey.skipped, first: None }.note());
    Ok(ExplanationPy(explanation))
}
