//! What holds memory (`gpuexp.holders()`, and the names a finished experiment's report gives for
//! memory that did not come back). The walk's rules, the tables it makes and which memories a
//! finished experiment hunts are the core's (`holders_walk`); here are its Python sides: the
//! roots (`hunt_roots`), the objects (`python_heap`), the live tensors the collector knows, and
//! which tensors modules and optimizers hold. Nothing found is kept: the result is paths and sizes.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::bindings::hunt_roots::{namespace_roots, world_roots, PyRoot};
use crate::bindings::python_heap::{tensor_piece, Collected, PythonHeap};
use crate::bindings::report::HoldersPy;
use crate::bindings::snapshot::take_snapshot;
use crate::bindings::torch::PyTorch;
use crate::holders_walk::{self, add_torch_figures, no_such_gpu, Leaks, Survey, BOUNDS, LEAK_MIN_BYTES};
pub(in crate::bindings) use crate::holders_walk::{sum_roles, Buffer, Memory};
use crate::report::{Holders, Report, Role};
use crate::snapshot::GpuSelection;
use crate::trace::HolderStorages;
use crate::uninspectable::Uninspectable;

/// What the collector knows: every live tensor storage in a memory, and every generator and
/// coroutine paused at a `yield` or an `await` (their frames are roots).
struct CollectorView<'py> {
    live: HashMap<Buffer, u64>,
    suspended: Vec<Bound<'py, PyAny>>,
}

fn collector_view<'py>(py: Python<'py>, heap: &mut PythonHeap<'py>, memory: &Memory) -> PyResult<CollectorView<'py>> {
    let mut view = CollectorView { live: HashMap::new(), suspended: Vec::new() };
    let objects = py.import("gc")?.call_method0("get_objects")?.cast_into::<PyList>()?;
    for object in objects.iter() {
        match heap.collected(&object) {
            Collected::Tensor => {
                if let Ok(Some(piece)) = tensor_piece(&object, memory) {
                    view.live.insert(piece.buffer, piece.bytes);
                }
            }
            Collected::Suspended => view.suspended.push(object),
            Collected::Other => {}
        }
    }
    Ok(view)
}

/// Runs `hunt` with warnings silenced: some library globals warn on any attribute access
/// (deprecated aliases), and a hunt is not the user's code.
fn quietly<'py, T>(py: Python<'py>, hunt: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    let warnings = py.import("warnings")?;
    let quiet = warnings.call_method0("catch_warnings")?;
    quiet.call_method0("__enter__")?;
    warnings.call_method1("simplefilter", ("ignore",))?;
    let result = hunt();
    quiet.call_method1("__exit__", (py.None(), py.None(), py.None()))?;
    result
}

/// Walks from `roots`, then every other place objects live (threads, modules, suspended
/// frames, hooks), to every tensor (and, on the host, every array) in `memory`; `exclude` are
/// buffers that existed before (an experiment's start).
pub fn survey<'py>(
    py: Python<'py>,
    memory: &Memory,
    mut roots: Vec<PyRoot<'py>>,
    exclude: &HashSet<Buffer>,
) -> PyResult<Survey<Bound<'py, PyAny>>> {
    quietly(py, || {
        let mut heap = PythonHeap::new(py, memory.clone())?;
        let CollectorView { live, suspended } = collector_view(py, &mut heap, memory)?;
        roots.extend(world_roots(py, suspended)?);
        Ok(holders_walk::survey(&mut heap, memory, roots, live, exclude, BOUNDS))
    })
}

/// Finds what holds the memory of `memory`, largest first; `exclude` are buffers that existed
/// before (an experiment's start), `min_bytes` the smallest worth naming. Also returns the
/// bytes of every Python tensor there, for what no Python tensor accounts for, and the storages
/// each named holder keeps on a GPU.
pub fn hunt<'py>(
    py: Python<'py>,
    memory: Memory,
    roots: Vec<PyRoot<'py>>,
    min_bytes: u64,
    exclude: &HashSet<Buffer>,
) -> PyResult<(Holders, u64, Vec<HolderStorages>)> {
    let started = Instant::now();
    let survey = survey(py, &memory, roots, exclude)?;
    let roles = sum_roles(&survey, &roles_of(py, &survey.owners, &memory)?, exclude);
    let holders = survey.holders(&memory, roles, min_bytes, exclude, started.elapsed().as_secs_f64());
    let storages = survey.holder_storages(&memory, &holders);
    Ok((holders, survey.python_bytes(), storages))
}

/// Walks from `roots` only (no modules, threads or hooks), to every buffer on any device.
fn walk_from<'py>(py: Python<'py>, roots: Vec<PyRoot<'py>>) -> PyResult<Survey<Bound<'py, PyAny>>> {
    quietly(py, || {
        let mut heap = PythonHeap::new(py, Memory::Any)?;
        Ok(holders_walk::walk(&mut heap, roots, None, &HashSet::new(), BOUNDS))
    })
}

/// The buffers reachable from `roots` now (an experiment's start), so that a later hunt names
/// only what came after, and how many objects the walk could not inspect.
pub fn inventory<'py>(py: Python<'py>, roots: Vec<PyRoot<'py>>) -> PyResult<(HashSet<Buffer>, Uninspectable)> {
    let walked = walk_from(py, roots)?;
    let skipped = Uninspectable { count: walked.skipped, first: None };
    Ok((walked.found.into_keys().collect(), skipped))
}

/// Where a leak hunt starts: the notebook's names, then IPython's hidden references.
pub(in crate::bindings) fn hunt_roots<'py>(adapter: &Bound<'py, PyAny>) -> PyResult<Vec<PyRoot<'py>>> {
    namespace_roots(adapter)
}

pub(in crate::bindings) fn tensors_or_arrays_imported(py: Python) -> bool {
    let Ok(modules) = py.import("sys").and_then(|sys| sys.getattr("modules")) else { return false };
    ["torch", "numpy"].iter().any(|name| modules.contains(*name).unwrap_or(false))
}

/// Names what still holds memory the scope created, where its end shows memory not back.
pub(in crate::bindings) fn hunt_leaks(
    py: Python,
    report: &Report,
    adapter: Option<&Bound<PyAny>>,
    before: &HashSet<Buffer>,
) -> PyResult<Leaks> {
    let Some(adapter) = adapter else { return Ok(Leaks::default()) };
    if !tensors_or_arrays_imported(py) {
        return Ok(Leaks::default());
    }
    holders_walk::hunt_leaks(report, |memory| {
        let (holders, _, kept) = hunt(py, memory, hunt_roots(adapter)?, LEAK_MIN_BYTES, before)?;
        Ok((holders, kept))
    })
}

/// What holds memory on a GPU (by torch index) or the host, largest first.
#[pyfunction]
#[pyo3(signature = (memory, min_bytes, adapter=None))]
pub(in crate::bindings) fn holders(
    py: Python,
    memory: Option<u32>,
    min_bytes: u64,
    adapter: Option<Bound<PyAny>>,
) -> PyResult<HoldersPy> {
    let memory = memory.map_or(Memory::Host, Memory::Cuda);
    if let Memory::Cuda(index) = memory {
        let visible: Vec<u32> =
            take_snapshot(py, &GpuSelection::AllVisible).0.gpus.iter().map(|g| g.torch_index).collect();
        if let Some(refused) = no_such_gpu(index, &visible) {
            return Err(PyValueError::new_err(refused));
        }
    }
    let roots = adapter.as_ref().map(hunt_roots).transpose()?.unwrap_or_default();
    let (mut found, python_bytes, _) = hunt(py, memory.clone(), roots, min_bytes, &HashSet::new())?;
    if let Memory::Cuda(index) = memory {
        let torch = PyTorch::find(py);
        if torch.cuda().is_some() {
            if let Ok(stats) = torch.read_stats(index) {
                add_torch_figures(&mut found, stats.allocated, stats.reserved, python_bytes);
            }
        }
    }
    Ok(HoldersPy(found))
}

/// Each storage in `memory` that a module or optimizer of `owners` holds, with its role and bytes.
pub(in crate::bindings) fn roles_of(
    py: Python,
    owners: &[Bound<PyAny>],
    memory: &Memory,
) -> PyResult<HashMap<Buffer, (Role, u64)>> {
    let [parameters, buffers, gradients, state]: [Vec<Bound<PyAny>>; 4] =
        py.import("gpuexp.owned_tensors")?.call_method1("owned_tensors", (owners,))?.extract()?;
    let by_role = [
        (Role::Parameter, parameters),
        (Role::Buffer, buffers),
        (Role::Gradient, gradients),
        (Role::OptimizerState, state),
    ];
    let mut roles = HashMap::new();
    for (role, tensors) in by_role {
        for tensor in tensors {
            if let Some(piece) = tensor_piece(&tensor, memory)? {
                let (known, _) = roles.entry(piece.buffer).or_insert((role, piece.bytes));
                *known = role.min(*known);
            }
        }
    }
    Ok(roles)
}
