//! The Python module `gpuexp._core`: the only place that knows PyO3. It reads torch through
//! its Python API, pins the namespace by identity, and runs teardown's steps in Rust's order.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyModule, PyWeakrefReference};

mod hunter;
// First: the others use its `shown_as_table!`.
#[macro_use]
mod types;
mod batch_size;
mod cell_log;
mod ranks;
mod timeline;

use batch_size::*;
use cell_log::*;
use ranks::*;
use timeline::*;
use types::*;

use hunter::{Buffer, Memory};

use crate::cli;
use crate::finder;
use crate::monitor;
use crate::report::{self, CellRecord, Holders, Names, Report, Span};
use crate::sampler;
use crate::scope::{Finishing, Kind, Registry, ScopeId};
use crate::snapshot::{host, nvml, own_pids, GpuReading, GpuSelection, NvmlSource, Snapshot, TorchProbe, TorchStats};
use crate::teardown::{self, Binding, NameState, Step};

static REGISTRY: LazyLock<Mutex<Registry>> = LazyLock::new(|| Mutex::new(Registry::default()));

/// Never held while Python code runs: teardown can run `__del__` methods that call back in.
fn registry() -> MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

// ---- torch, through its Python API -------------------------------------------------------

/// Torch as the user's process has it: looked up in `sys.modules`, never imported.
struct PyTorch<'py> {
    torch: Option<Bound<'py, PyAny>>,
    cuda_initialised: bool,
}

impl<'py> PyTorch<'py> {
    fn find(py: Python<'py>) -> PyTorch<'py> {
        let torch =
            py.import("sys").and_then(|sys| sys.getattr("modules")).and_then(|modules| modules.get_item("torch")).ok();
        // `is_initialized` only reads a flag: it creates no CUDA context.
        let cuda_initialised = torch
            .as_ref()
            .and_then(|t| t.getattr("cuda").ok()?.call_method0("is_initialized").ok()?.extract::<bool>().ok())
            .unwrap_or(false);
        PyTorch { torch, cuda_initialised }
    }

    fn cuda(&self) -> Option<Bound<'py, PyAny>> {
        self.cuda_initialised.then(|| self.torch.as_ref()?.getattr("cuda").ok()).flatten()
    }

    fn read_stats(&self, index: u32) -> PyResult<TorchStats> {
        let torch = self.torch.as_ref().expect("called only when imported");
        // The nested dict straight from C++; `torch.cuda.memory_stats` flattens it in Python, which costs more than the rest of a snapshot.
        let nested = torch.getattr("_C")?.call_method1("_cuda_memoryStats", (index,));
        let Ok(stats) = nested else { return flat_stats(torch, index) };
        let get = |group: &str, field: &str| -> PyResult<u64> {
            stats.get_item(group)?.get_item("all")?.get_item(field)?.extract()
        };
        Ok(TorchStats {
            allocated: get("allocated_bytes", "current")?,
            reserved: get("reserved_bytes", "current")?,
            peak_allocated: get("allocated_bytes", "peak")?,
            peak_reserved: get("reserved_bytes", "peak")?,
            num_ooms: stats.get_item("num_ooms")?.extract()?,
        })
    }

    /// Resets torch's peak counters on the devices a snapshot covered. The C function, not
    /// `torch.cuda.reset_peak_memory_stats`, which gpuexp wraps to notice the user's resets.
    fn reset_peaks(&self, snapshot: &Snapshot) {
        let Some(c) = self.cuda().and_then(|_| self.torch.as_ref()?.getattr("_C").ok()) else { return };
        for gpu in snapshot.gpus.iter().filter(|g| g.torch.is_some()) {
            let _ = c.call_method1("_cuda_resetPeakMemoryStats", (gpu.torch_index,));
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
        static UUIDS: Mutex<Option<(u32, Vec<String>)>> = Mutex::new(None);
        let cuda = self.cuda()?;
        let pid = std::process::id();
        let mut cached = UUIDS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((owner, uuids)) = cached.as_ref() {
            if *owner == pid {
                return Some(uuids.clone());
            }
        }
        let count: u32 = cuda.call_method0("device_count").ok()?.extract().ok()?;
        let uuids = (0..count)
            .map(|i| {
                let props = cuda.call_method1("get_device_properties", (i,)).ok()?;
                props.getattr("uuid").ok()?.str().ok().map(|s| s.to_string())
            })
            .collect::<Option<Vec<String>>>()?;
        *cached = Some((pid, uuids.clone()));
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

fn take_snapshot<'py>(py: Python<'py>, selection: &GpuSelection) -> (Snapshot, PyTorch<'py>) {
    snapshot_from(py, selection, &|_, device, pids| nvml::read(device, pids))
}

/// A snapshot for the per-cell log: NVML figures from the sampler's latest sample (at most
/// two intervals old) where it has one, since reading the driver again after every cell
/// would cost more than the rest of the cell log.
fn take_cell_snapshot<'py>(py: Python<'py>, selection: &GpuSelection) -> (Snapshot, PyTorch<'py>) {
    snapshot_from(py, selection, &|ident, device, pids| match sampler::latest(&ident.uuid) {
        Some(reading) => Ok(reading),
        None => nvml::read(device, pids),
    })
}

/// A snapshot with its NVML figures from `read_nvml`, and peaks raised to what the sampler saw.
fn snapshot_from<'py>(py: Python<'py>, selection: &GpuSelection, read_nvml: &NvmlSource) -> (Snapshot, PyTorch<'py>) {
    let torch = PyTorch::find(py);
    let mut snapshot = Snapshot::take(selection, &torch, read_nvml);
    sampler::apply(&mut snapshot);
    (snapshot, torch)
}

/// Starts new peak windows: what the counters saw was just folded into the open windows.
fn reset_counters(torch: &PyTorch, snapshot: &Snapshot) {
    host::reset_peak();
    torch.reset_peaks(snapshot);
    sampler::reset(snapshot);
}

/// Runs the sampler over what gpuexp needs now. While a window is open or about to open
/// (`opening`), or the cell log is on, that is host RSS where VmHWM can't be reset, and the
/// GPUs when a window or the log covers them. The thread stays up between logged cells, so a
/// cell never pays for starting it. Returns whether a thread was started anew.
///
/// The caller must not hold the registry: the GIL is released here, and a thread that held
/// the registry while waiting for the GIL back would deadlock with one holding the GIL while
/// waiting for the registry.
fn update_sampler(py: Python, opening: Option<&Snapshot>) -> bool {
    let sources = {
        let registry = registry();
        let log_gpus = registry.cell_log_active() && registry.cell_selection() != GpuSelection::None;
        let needed = opening.is_some() || registry.has_windows() || registry.cell_log_active();
        let gpu_wanted = registry.has_gpu_windows() || log_gpus || opening.is_some_and(|s| !s.gpus.is_empty());
        let gpus = match opening {
            _ if !(needed && gpu_wanted) => Vec::new(),
            Some(s) if !s.gpus.is_empty() => s.gpus.iter().map(|g| g.uuid.clone()).collect(),
            _ => sampler::sampled_gpus(),
        };
        sampler::Sources { host: needed && !host::peak_reset_supported(), gpus }
    };
    // Joining with the GIL held would be safe too (the sampler never takes it), but other
    // Python threads need not wait for the join.
    py.detach(|| sampler::ensure(sources))
}

/// The snapshot a window opens at, taken by `take`. A sampler started for it starts first,
/// so that the thread's own memory (its stack, NVML's per-thread state) is not charged to
/// the window.
fn opening_snapshot<'py>(
    py: Python<'py>,
    selection: &GpuSelection,
    take: fn(Python<'py>, &GpuSelection) -> (Snapshot, PyTorch<'py>),
) -> (Snapshot, PyTorch<'py>) {
    let (probe, torch) = take(py, selection);
    if update_sampler(py, Some(&probe)) {
        take(py, selection)
    } else {
        (probe, torch)
    }
}

// ---- identity pins -------------------------------------------------------------------------

/// Remembers which object a name held, without keeping big objects alive: a weak reference
/// where the type allows one (tensors, arrays, modules), a strong one otherwise (ints, lists),
/// because an address alone can be reused by a new object after the old one is freed.
enum Pin {
    Weak(Py<PyWeakrefReference>),
    Strong(Py<PyAny>),
}

impl Pin {
    fn new(object: &Bound<PyAny>) -> Pin {
        match PyWeakrefReference::new(object) {
            Ok(weak) => Pin::Weak(weak.unbind()),
            Err(_) => Pin::Strong(object.clone().unbind()),
        }
    }

    fn holds(&self, object: &Bound<PyAny>) -> bool {
        match self {
            Pin::Weak(weak) => weak.bind(object.py()).upgrade().is_some_and(|held| held.is(object)),
            Pin::Strong(held) => object.is(held),
        }
    }
}

/// The Python side of an open scope: its namespace adapter and identity baselines.
struct Pins {
    /// The glue object from `gpuexp.ipython`: `namespace`, `system_names()`, `hidden_refs()`, `drop_hidden()`.
    adapter: Option<Py<PyAny>>,
    names: HashMap<String, Pin>,
    hidden: HashMap<String, Pin>,
    owner: Option<Pin>,
    /// Tensor storages and arrays reachable when the scope opened: a leak hunt at finish names
    /// only what came after.
    buffers: HashSet<Buffer>,
    /// Torch's per-process memory fraction of each GPU before the scope's `limit`, restored at finish.
    limited: Vec<(u32, f64)>,
    /// The scope's timeline (`timeline=True`), stopped at finish and kept in its report.
    timeline: Option<monitor::Monitor>,
}

static PINS: LazyLock<Mutex<HashMap<ScopeId, Pins>>> = LazyLock::new(|| Mutex::new(HashMap::new()));

fn pins() -> MutexGuard<'static, HashMap<ScopeId, Pins>> {
    PINS.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn namespace<'py>(adapter: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyDict>>> {
    let namespace = adapter.getattr("namespace")?;
    if namespace.is_none() {
        return Ok(None);
    }
    Ok(Some(namespace.cast_into::<PyDict>()?))
}

fn system_names(adapter: &Bound<PyAny>) -> PyResult<HashSet<String>> {
    adapter.call_method0("system_names")?.try_iter()?.map(|n| n?.extract()).collect()
}

fn user_names<'py>(adapter: &Bound<'py, PyAny>) -> PyResult<Vec<(String, Bound<'py, PyAny>)>> {
    let Some(namespace) = namespace(adapter)? else { return Ok(Vec::new()) };
    let system = system_names(adapter)?;
    let mut names = Vec::with_capacity(namespace.len());
    for (key, value) in namespace.iter() {
        let Ok(name) = key.extract::<String>() else { continue };
        if !teardown::is_system_name(&name, &system) {
            names.push((name, value));
        }
    }
    Ok(names)
}

fn hidden_refs<'py>(adapter: &Bound<'py, PyAny>) -> PyResult<Vec<(String, Bound<'py, PyAny>)>> {
    let refs = adapter.call_method0("hidden_refs")?.cast_into::<PyDict>()?;
    refs.iter().map(|(label, object)| Ok((label.extract()?, object))).collect()
}

/// Caps torch's allocations on the scope's GPUs at `limit` bytes each (its per-process memory
/// fraction), to rehearse a smaller card; returns the fractions to restore.
fn apply_limit(py: Python, selection: &GpuSelection, limit: u64) -> PyResult<Vec<(u32, f64)>> {
    let torch = PyTorch::find(py);
    let Some(torch_module) = torch.torch.as_ref() else {
        return Err(PyValueError::new_err("limit= caps torch's allocations: import torch first"));
    };
    let cuda = torch_module.getattr("cuda")?;
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
                report::bytes(limit),
                report::bytes(total)
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

/// `limit=` of the batch-size finder: the same cap as an experiment's, on these GPUs; returns
/// what `restore_memory_limit` puts back.
#[pyfunction]
fn limit_memory(py: Python, devices: Vec<u32>, limit: u64) -> PyResult<Vec<(u32, f64)>> {
    apply_limit(py, &GpuSelection::Only(devices), limit)
}

#[pyfunction]
fn restore_memory_limit(py: Python, limited: Vec<(u32, f64)>) -> PyResult<()> {
    restore_limit(py, &limited)
}

fn restore_limit(py: Python, limited: &[(u32, f64)]) -> PyResult<()> {
    if limited.is_empty() {
        return Ok(());
    }
    let cuda = py.import("torch")?.getattr("cuda")?;
    for (device, fraction) in limited {
        cuda.call_method1("set_per_process_memory_fraction", (*fraction, *device))?;
    }
    Ok(())
}

/// Where a leak hunt starts: the notebook's names, then IPython's hidden references.
fn hunt_roots<'py>(adapter: &Bound<'py, PyAny>) -> PyResult<Vec<(String, Bound<'py, PyAny>)>> {
    let mut roots = user_names(adapter)?;
    roots.sort_by(|a, b| a.0.cmp(&b.0));
    roots.extend(hidden_refs(adapter)?);
    Ok(roots)
}

fn tensors_or_arrays_imported(py: Python) -> bool {
    let Ok(modules) = py.import("sys").and_then(|sys| sys.getattr("modules")) else { return false };
    ["torch", "numpy"].iter().any(|name| modules.contains(*name).unwrap_or(false))
}

/// Names what still holds memory the scope created, where its end shows memory not back.
fn hunt_leaks(py: Python, report: &Report, pins: Option<&Pins>) -> PyResult<Vec<Holders>> {
    const GPU_SLACK: i64 = 1 << 20;
    const HOST_SLACK: i64 = 64 << 20;
    let Some(pins) = pins else { return Ok(Vec::new()) };
    let Some(adapter) = pins.adapter.as_ref().map(|a| a.bind(py)) else { return Ok(Vec::new()) };
    if !tensors_or_arrays_imported(py) {
        return Ok(Vec::new());
    }
    let kept_above_start =
        |m: &report::Metric, slack: i64| m.end.is_some_and(|end| end as i64 - m.start as i64 >= slack);
    let mut memories: Vec<Memory> = report
        .gpus
        .iter()
        .filter(|gpu| gpu.torch_allocated.as_ref().is_some_and(|m| kept_above_start(m, GPU_SLACK)))
        .map(|gpu| Memory::Cuda(gpu.torch_index))
        .collect();
    if kept_above_start(&report.host.rss, HOST_SLACK) {
        memories.push(Memory::Host);
    }
    let mut found = Vec::new();
    for memory in memories {
        let (holders, _) = hunter::hunt(py, memory, hunt_roots(adapter)?, 1 << 20, &pins.buffers)?;
        if !holders.holders.is_empty() || holders.unreachable > 0 {
            found.push(holders);
        }
    }
    Ok(found)
}

/// What holds memory on a GPU (by torch index) or the host, largest first.
#[pyfunction]
#[pyo3(signature = (memory, min_bytes, adapter=None))]
fn holders(py: Python, memory: Option<u32>, min_bytes: u64, adapter: Option<Bound<PyAny>>) -> PyResult<HoldersPy> {
    let memory = match memory {
        Some(index) => Memory::Cuda(index),
        None => Memory::Host,
    };
    let roots = match &adapter {
        Some(a) => hunt_roots(a)?,
        None => Vec::new(),
    };
    let (mut found, python_bytes) = hunter::hunt(py, memory.clone(), roots, min_bytes, &HashSet::new())?;
    if let Memory::Cuda(index) = memory {
        let torch = PyTorch::find(py);
        if torch.cuda().is_some() {
            if let Ok(stats) = torch.read_stats(index) {
                found.no_python_tensor = Some(stats.allocated.saturating_sub(python_bytes));
                found.cached = Some(stats.reserved.saturating_sub(stats.allocated));
            }
        }
    }
    Ok(HoldersPy(found))
}

fn pin_all(refs: Vec<(String, Bound<PyAny>)>) -> HashMap<String, Pin> {
    refs.into_iter().map(|(name, object)| (name, Pin::new(&object))).collect()
}

// ---- scopes --------------------------------------------------------------------------------

fn selection(gpu: bool, devices: Option<Vec<u32>>) -> GpuSelection {
    match (gpu, devices) {
        (false, _) => GpuSelection::None,
        (true, None) => GpuSelection::AllVisible,
        (true, Some(devices)) => GpuSelection::Only(devices),
    }
}

/// Opens a scope; returns its id and the state it starts from. `adapter` is None outside any
/// namespace (a function body in a script): the scope then measures and reports but deletes nothing.
#[pyfunction]
#[pyo3(signature = (name=None, *, gpu=true, devices=None, adapter=None, owner=None, cell_log=true, limit=None, timeline_s=None))]
#[allow(clippy::too_many_arguments)]
fn open_scope(
    py: Python,
    name: Option<String>,
    gpu: bool,
    devices: Option<Vec<u32>>,
    adapter: Option<Bound<PyAny>>,
    owner: Option<Bound<PyAny>>,
    cell_log: bool,
    limit: Option<u64>,
    timeline_s: Option<f64>,
) -> PyResult<(ScopeId, SnapshotPy)> {
    let selection = selection(gpu, devices);
    if let GpuSelection::Only(wanted) = &selection {
        check_devices(py, wanted)?;
    }
    // Pins are made before the start snapshot so their own memory is not charged to the scope.
    let baseline = Pins {
        names: match &adapter {
            Some(a) => pin_all(user_names(a)?),
            None => HashMap::new(),
        },
        hidden: match &adapter {
            Some(a) => pin_all(hidden_refs(a)?),
            None => HashMap::new(),
        },
        buffers: match &adapter {
            Some(a) if tensors_or_arrays_imported(py) => hunter::inventory(py, hunt_roots(a)?)?,
            _ => HashSet::new(),
        },
        adapter: adapter.map(Bound::unbind),
        owner: owner.as_ref().map(Pin::new),
        limited: match limit {
            Some(limit) => apply_limit(py, &selection, limit)?,
            None => Vec::new(),
        },
        timeline: match timeline_s {
            Some(seconds) => {
                let interval = std::time::Duration::try_from_secs_f64(seconds)
                    .map_err(|_| PyValueError::new_err("timeline= takes an interval such as \"100ms\""))?;
                Some(monitor::Monitor::start(interval, None, gpu).map_err(PyValueError::new_err)?)
            }
            None => None,
        },
    };
    prepare_publishing(py);
    let (start, torch) = opening_snapshot(py, &selection, take_snapshot);
    let (id, title) = {
        let mut registry = registry();
        let name = registry.name_or_default(name);
        let kind = if gpu { Kind::Gpu } else { Kind::Cpu };
        let title = format!("{name} · started");
        let id = registry.open(name, kind, selection, start.clone(), cell_log);
        if let Some(scope) = registry.scope_mut(id) {
            scope.limit = limit;
        }
        (id, title)
    };
    reset_counters(&torch, &start);
    pins().insert(id, baseline);
    Ok((id, SnapshotPy { snapshot: start, title }))
}

fn check_devices(py: Python, wanted: &[u32]) -> PyResult<()> {
    let (all, _) = take_snapshot(py, &GpuSelection::AllVisible);
    if nvml::available().is_err() {
        return Ok(());
    }
    let visible: Vec<u32> = all.gpus.iter().map(|g| g.torch_index).collect();
    match wanted.iter().find(|d| !visible.contains(d)) {
        None => Ok(()),
        Some(bad) => Err(PyValueError::new_err(format!(
            "devices=[{bad}]: no such GPU. Visible GPUs (torch indices): {visible:?}; \
             pass indices from that list, or devices=None for all of them."
        ))),
    }
}

/// The user's names (not IPython's) bound to `object` in the adapter's namespace.
#[pyfunction]
fn bound_names(adapter: &Bound<PyAny>, object: &Bound<PyAny>) -> PyResult<Vec<String>> {
    Ok(user_names(adapter)?.into_iter().filter(|(_, value)| value.is(object)).map(|(name, _)| name).collect())
}

#[pyfunction]
fn scope_name(id: ScopeId) -> PyResult<String> {
    let registry = registry();
    if let Some(scope) = registry.scope(id) {
        return Ok(scope.name.clone());
    }
    registry.report(id).map(|r| r.name.clone()).ok_or_else(|| unknown(id))
}

fn unknown(id: ScopeId) -> PyErr {
    PyKeyError::new_err(format!("no experiment scope with id {id}"))
}

/// The open scope of that name, if any.
#[pyfunction]
fn open_scope_named(name: &str) -> Option<ScopeId> {
    registry().open_named(name)
}

#[pyfunction]
fn is_open(id: ScopeId) -> bool {
    registry().scope(id).is_some_and(|s| !s.closing)
}

/// Protects names from deletion; each must exist now.
#[pyfunction]
fn keep(py: Python, id: ScopeId, names: Vec<String>) -> PyResult<()> {
    let created: Vec<String>;
    let existing: HashSet<String>;
    {
        let pins = pins();
        let Some(scope_pins) = pins.get(&id) else {
            return Err(PyValueError::new_err(
                "keep(): this experiment has already finished; nothing more will be deleted.",
            ));
        };
        let adapter = scope_pins.adapter.as_ref().map(|a| a.bind(py).clone());
        let current = match &adapter {
            Some(a) => user_names(a)?,
            None => Vec::new(),
        };
        created = current.iter().filter(|(n, _)| !scope_pins.names.contains_key(n)).map(|(n, _)| n.clone()).collect();
        existing = current.into_iter().map(|(n, _)| n).collect();
    }
    teardown::check_keep(&names, |n| existing.contains(n), &created).map_err(PyValueError::new_err)?;
    let mut registry = registry();
    let scope = registry.scope_mut(id).ok_or_else(|| unknown(id))?;
    scope.keep.extend(names);
    Ok(())
}

/// Finishes a scope, and first every scope opened inside it. Returns the reports of the
/// scopes it finished, innermost first; empty when this scope's teardown is already under way.
/// `keep` adds names to protect, without the existence check of `keep()`: a replacing
/// constructor passes the names its cell still uses.
#[pyfunction]
#[pyo3(signature = (id, keep=Vec::new()))]
fn finish(py: Python, id: ScopeId, keep: Vec<String>) -> PyResult<Vec<ReportPy>> {
    let inner = registry().inner_of(id);
    let mut finished = Vec::new();
    for inner_id in inner {
        finished.extend(finish(py, inner_id, keep.clone())?);
    }
    if let Some(scope) = registry().scope_mut(id) {
        scope.keep.extend(keep);
    }
    let scope = match registry().begin_finish(id) {
        Finishing::Finished(report) => return Ok(vec![ReportPy(report)]),
        Finishing::InProgress => return Ok(finished),
        Finishing::Unknown => return Err(unknown(id)),
        Finishing::Ready(scope) => scope,
    };
    let mut scope_pins = pins().remove(&id);
    let (before, _) = take_snapshot(py, &scope.selection);
    registry().peaks.observe(&before);

    let mut names = Names::default();
    let mut notes = Vec::new();
    let mut end = None;
    for step in teardown::ORDER {
        let done = match step {
            Step::DeleteNames => delete_names(py, scope_pins.as_ref(), &scope.keep, &mut names),
            Step::DropHiddenRefs => drop_hidden_refs(py, scope_pins.as_ref(), &mut names),
            Step::CollectGarbage | Step::FreeCublasWorkspaces | Step::EmptyCache => release(py, step),
            Step::EndSnapshot => {
                end = Some(take_snapshot(py, &scope.selection).0);
                Ok(())
            }
        };
        if let Err(e) = done {
            notes.push(format!("teardown step {step:?} failed: {e}"));
        }
    }
    let end = end.expect("EndSnapshot is a step of every teardown");
    let mut timeline = Vec::new();
    if let Some(pins) = scope_pins.as_mut() {
        if let Err(e) = restore_limit(py, &pins.limited) {
            notes.push(format!("restoring torch's memory fraction failed: {e}"));
        }
        if let Some(mut monitor) = pins.timeline.take() {
            py.detach(|| monitor.stop());
            timeline = monitor.samples();
        }
    }
    let mut report = {
        let registry = registry();
        let mut report = Report::build(
            &scope.name,
            scope.kind == Kind::Gpu,
            Span { start: &scope.start, before_teardown: &before, end: Some(&end) },
            |gauge| registry.peaks.peak(id, gauge),
            names,
        );
        report.cells = registry.cells_of(&scope);
        report.limit = scope.limit;
        report.timeline = timeline;
        report
    };
    report.notes.extend(notes);
    // The hunt runs Python code, so the registry is not held (see `registry`).
    match hunt_leaks(py, &report, scope_pins.as_ref()) {
        Ok(still_held) => report.still_held = still_held,
        Err(e) => report.notes.push(format!("the leak hunt failed: {e}")),
    }
    drop(scope_pins);
    complete_report(py, id, &mut report);
    finished.push(ReportPy(registry().complete(id, report)));
    update_sampler(py, None);
    Ok(finished)
}

fn delete_names(py: Python, pins: Option<&Pins>, keep: &BTreeSet<String>, names: &mut Names) -> PyResult<()> {
    let Some(pins) = pins else { return Ok(()) };
    let Some(adapter) = pins.adapter.as_ref().map(|a| a.bind(py)) else { return Ok(()) };
    let Some(namespace) = namespace(adapter)? else { return Ok(()) };
    let states = user_names(adapter)?.into_iter().map(|(name, value)| {
        let binding = match pins.names.get(&name) {
            None => Binding::Created,
            Some(pin) if pin.holds(&value) => Binding::Unchanged,
            Some(_) => Binding::Rebound,
        };
        NameState {
            is_module: value.is_instance_of::<PyModule>(),
            is_owner: pins.owner.as_ref().is_some_and(|owner| owner.holds(&value)),
            name,
            binding,
        }
    });
    let plan = teardown::plan(states.collect::<Vec<_>>(), keep);
    for name in plan.delete.iter().chain(&plan.rebound) {
        // A `__del__` run by an earlier deletion may have removed it already.
        if namespace.contains(name)? {
            namespace.del_item(name)?;
        }
    }
    names.deleted = plan.delete;
    names.rebound = plan.rebound;
    names.kept = plan.kept;
    Ok(())
}

/// Drops the hidden references that appeared or changed during the scope: they can only
/// refer to what the scope displayed or raised.
fn drop_hidden_refs(py: Python, pins: Option<&Pins>, names: &mut Names) -> PyResult<()> {
    let Some(pins) = pins else { return Ok(()) };
    let Some(adapter) = pins.adapter.as_ref().map(|a| a.bind(py)) else { return Ok(()) };
    for (label, object) in hidden_refs(adapter)? {
        if pins.hidden.get(&label).is_some_and(|pin| pin.holds(&object)) {
            continue;
        }
        adapter.call_method1("drop_hidden", (&label,))?;
        names.cleared.push(label);
    }
    Ok(())
}

/// One of the steps that give memory back once nothing refers to it ([`teardown::RELEASE`]).
fn release(py: Python, step: Step) -> PyResult<()> {
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

/// The rescue after a CUDA out-of-memory error: the adapter clears the failed cell's frames
/// and the references to its exception, then memory is released as at a teardown. Returns
/// the diagnosis: what was asked for, what the device had, what came back.
#[pyfunction]
#[pyo3(signature = (error, adapter=None))]
fn rescue_oom(py: Python, error: Bound<PyAny>, adapter: Option<Bound<PyAny>>) -> PyResult<OomPy> {
    let message = error.str()?.to_string();
    let (requested, device) = report::parse_oom_message(&message);
    let (before, _) = take_snapshot(py, &GpuSelection::AllVisible);
    let cleared = match &adapter {
        Some(adapter) => adapter.call_method1("drop_exception", (&error,))?.extract()?,
        None => Vec::new(),
    };
    let mut hints = Vec::new();
    for step in teardown::RELEASE {
        if let Err(e) = release(py, step) {
            hints.push(format!("rescue step {step:?} failed: {e}"));
        }
    }
    let (after, _) = take_snapshot(py, &GpuSelection::AllVisible);
    // The device torch's message names; another GPU's figures would only mislead.
    let pick = |s: &Snapshot| -> Option<GpuReading> {
        match device {
            Some(index) => s.gpus.iter().find(|g| g.torch_index == index).cloned(),
            None => s.gpus.first().cloned(),
        }
    };
    let (gpu_before, gpu_after) = (pick(&before), pick(&after));
    let others = gpu_before
        .as_ref()
        .map(|g| nvml::other_processes(&g.uuid, &own_pids()))
        .unwrap_or_default()
        .into_iter()
        .map(|(pid, used)| report::OtherProcess { pid, name: process_name(pid), used })
        .collect();
    let mut diagnosis = report::OomDiagnosis {
        message,
        torch_index: gpu_before.as_ref().map(|g| g.torch_index).or(device),
        requested,
        total: gpu_before.as_ref().map(|g| g.total),
        free_before: gpu_before.as_ref().map(|g| g.free),
        free_after: gpu_after.as_ref().map(|g| g.free),
        torch_allocated_before: gpu_before.as_ref().and_then(|g| g.torch).map(|t| t.allocated),
        torch_allocated_after: gpu_after.as_ref().and_then(|g| g.torch).map(|t| t.allocated),
        torch_reserved_before: gpu_before.as_ref().and_then(|g| g.torch).map(|t| t.reserved),
        process_used_before: gpu_before.as_ref().and_then(|g| g.process_used),
        others,
        hints: Vec::new(),
        cleared,
    };
    diagnosis.hints = diagnosis.hints();
    diagnosis.hints.extend(hints);
    Ok(OomPy(diagnosis))
}

fn process_name(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).map(|n| n.trim().to_string()).unwrap_or_else(|_| "?".into())
}

/// The report of a scope as it stands: live while open, final once finished.
#[pyfunction]
fn scope_report(py: Python, id: ScopeId) -> PyResult<ReportPy> {
    let selection = {
        let registry = registry();
        if let Some(done) = registry.report(id) {
            return Ok(ReportPy(done));
        }
        registry.scope(id).ok_or_else(|| unknown(id))?.selection.clone()
    };
    let (now, _) = take_snapshot(py, &selection);
    let mut registry = registry();
    registry.peaks.observe(&now);
    let scope = registry.scope(id).ok_or_else(|| unknown(id))?;
    let mut live = Report::build(
        &scope.name,
        scope.kind == Kind::Gpu,
        Span { start: &scope.start, before_teardown: &now, end: None },
        |gauge| registry.peaks.peak(id, gauge),
        Names::default(),
    );
    live.cells = registry.cells_of(scope);
    Ok(ReportPy(Arc::new(live)))
}

#[pymodule]
#[pyo3(name = "_core")]
fn core_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(open_scope, m)?)?;
    m.add_function(wrap_pyfunction!(scope_name, m)?)?;
    m.add_function(wrap_pyfunction!(bound_names, m)?)?;
    m.add_function(wrap_pyfunction!(open_scope_named, m)?)?;
    m.add_function(wrap_pyfunction!(is_open, m)?)?;
    m.add_function(wrap_pyfunction!(keep, m)?)?;
    m.add_function(wrap_pyfunction!(finish, m)?)?;
    m.add_function(wrap_pyfunction!(scope_report, m)?)?;
    m.add_function(wrap_pyfunction!(history, m)?)?;
    m.add_function(wrap_pyfunction!(history_json, m)?)?;
    m.add_function(wrap_pyfunction!(snapshot, m)?)?;
    m.add_function(wrap_pyfunction!(host_peak_exact, m)?)?;
    m.add_function(wrap_pyfunction!(sampler_running, m)?)?;
    m.add_function(wrap_pyfunction!(cell_log_active, m)?)?;
    m.add_function(wrap_pyfunction!(set_standalone_log, m)?)?;
    m.add_function(wrap_pyfunction!(begin_cell, m)?)?;
    m.add_function(wrap_pyfunction!(end_cell, m)?)?;
    m.add_function(wrap_pyfunction!(cells, m)?)?;
    m.add_function(wrap_pyfunction!(scope_cells, m)?)?;
    m.add_function(wrap_pyfunction!(before_user_peak_reset, m)?)?;
    m.add_function(wrap_pyfunction!(config, m)?)?;
    m.add_function(wrap_pyfunction!(shutdown, m)?)?;
    m.add_function(wrap_pyfunction!(rescue_oom, m)?)?;
    m.add_function(wrap_pyfunction!(oom_rescue_enabled, m)?)?;
    m.add_function(wrap_pyfunction!(holders, m)?)?;
    m.add_function(wrap_pyfunction!(measure_begin, m)?)?;
    m.add_function(wrap_pyfunction!(measure_end, m)?)?;
    m.add_function(wrap_pyfunction!(usable_memory, m)?)?;
    m.add_function(wrap_pyfunction!(limit_memory, m)?)?;
    m.add_function(wrap_pyfunction!(restore_memory_limit, m)?)?;
    m.add_function(wrap_pyfunction!(parse_size, m)?)?;
    m.add_function(wrap_pyfunction!(release_between_trials, m)?)?;
    m.add_function(wrap_pyfunction!(gather_ranks, m)?)?;
    m.add_function(wrap_pyfunction!(note_scope_error, m)?)?;
    m.add_function(wrap_pyfunction!(last_publish_s, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_ranks_store, m)?)?;
    m.add_function(wrap_pyfunction!(remove_kernel_ranks_store, m)?)?;
    m.add_function(wrap_pyfunction!(host_ranks_store, m)?)?;
    m.add_function(wrap_pyfunction!(before_fork, m)?)?;
    m.add_function(wrap_pyfunction!(after_fork_in_parent, m)?)?;
    m.add_function(wrap_pyfunction!(after_fork_in_child, m)?)?;
    m.add_class::<RanksPy>()?;
    m.add_class::<BatchSearchPy>()?;
    m.add_class::<TimelinePy>()?;
    m.add_class::<GpuStatusPy>()?;
    m.add_class::<WatchPy>()?;
    m.add_class::<HoldersPy>()?;
    m.add_class::<OomPy>()?;
    m.add_class::<CellRecordPy>()?;
    m.add_class::<ReportPy>()?;
    m.add_class::<MetricPy>()?;
    m.add_class::<HostReportPy>()?;
    m.add_class::<GpuReportPy>()?;
    m.add_class::<SnapshotPy>()?;
    Ok(())
}
