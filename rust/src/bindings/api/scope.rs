//! Experiment scopes as Python sees them: `open_scope`, `finish`, `keep` and the live report.
//! The order of an experiment's life and every decision in it are the core's
//! (`crate::scope::lifecycle`); [`PyWorld`] does each of its steps over Python, torch and the
//! user's namespace, and [`ScopeHandles`] is what an open experiment holds on this side.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyString, PyWeakrefMethods, PyWeakrefReference};

use crate::bindings::cell_trace;
use crate::bindings::holders::{self, hunt_roots, tensors_or_arrays_imported, Buffer};
use crate::bindings::host_trace::{self, HostFinding, HostWindow};
use crate::bindings::interrupts;
use crate::bindings::namespace::{identities, system_names, user_names, Baseline, NamespaceAtTeardown};
use crate::bindings::rank_gpu;
use crate::bindings::ranks;
use crate::bindings::registry::{registry, unknown};
use crate::bindings::report::{CellRecordPy, ReportPy, SnapshotPy};
use crate::bindings::snapshot::{check_devices, opening_snapshot, reset_counters, take_snapshot, update_sampler};
use crate::bindings::torch::{apply_limit, release, restore_limit, PyTorch};
use crate::bindings::trace;
use crate::bindings::trace_recording::{self, TraceWindow};
use crate::monitor::{self, Sample};
use crate::report::{Param, Params, Report};
use crate::scope::lifecycle::{self, Request, World};
use crate::scope::{Identities, Owner, Registry, ScopeId};
use crate::snapshot::{GpuSelection, Snapshot};
use crate::teardown::{self, NameState, Step, Teardown};
use crate::trace::HolderStorages;
use crate::uninspectable::Uninspectable;

/// What an open experiment holds on the Python side, in its record in the core's registry.
#[derive(Default)]
pub(in crate::bindings) struct ScopeHandles {
    /// The experiment object, for the cell events that notice `del exp` (see `open_experiments`).
    experiment: Option<Py<PyWeakrefReference>>,
    /// None outside any namespace (a function body in a script): nothing to delete there.
    /// Shared, so that `keep()` reads it with the registry unlocked: reading runs Python code,
    /// which may finish another scope (a `__del__`), and that takes the registry.
    baseline: Option<Arc<Baseline>>,
    /// Tensor storages and arrays reachable when the scope opened: a leak hunt at finish names
    /// only what came after.
    buffers: HashSet<Buffer>,
    /// What that walk could not inspect: said in the report's notes.
    skipped: Uninspectable,
    /// Torch's per-process memory fraction of each GPU before the scope's `limit`, restored at finish.
    limited: Vec<(u32, f64)>,
    /// The scope's monitor (`monitor=True`), stopped at finish; its samples go in the report.
    monitor: Option<monitor::Monitor>,
    /// The scope's share of torch's allocation history (`trace=True`), read at finish.
    trace: Option<TraceWindow>,
    /// Its tracemalloc snapshot at opening (`trace="host"`), compared at finish...
    host_trace: Option<HostWindow>,
    /// ...into what it found, read into the report once the teardown has run.
    host_found: Option<HostFinding>,
    /// The storages each holder the leak hunt found keeps on a GPU, for the trace's sites.
    storages: Vec<HolderStorages>,
}

/// The steps of an experiment's life over Python. `interrupts` is held by the core's runner
/// around every step that needs it.
pub(in crate::bindings) struct PyWorld<'py> {
    py: Python<'py>,
    interrupts: Option<interrupts::HeldInterrupts<'py>>,
    /// The opening's namespace (None: none to delete from) and the experiment object.
    adapter: Option<Bound<'py, PyAny>>,
    experiment: Option<Bound<'py, PyAny>>,
    /// Torch as the start snapshot found it, for the reset of its peak counters just after.
    torch: Option<PyTorch<'py>>,
}

impl<'py> PyWorld<'py> {
    pub(in crate::bindings) fn new(py: Python<'py>) -> PyWorld<'py> {
        PyWorld { py, interrupts: None, adapter: None, experiment: None, torch: None }
    }

    fn interrupts(&self) -> &interrupts::HeldInterrupts<'py> {
        self.interrupts.as_ref().expect("the lifecycle holds interrupts around the steps that let them through")
    }
}

/// Torch's release steps and snapshots of the scope's devices, for the core's teardown.
struct Releaser<'py> {
    py: Python<'py>,
    selection: GpuSelection,
}

impl teardown::Release for Releaser<'_> {
    fn release(&mut self, step: Step) -> Result<(), String> {
        release(self.py, step).map_err(|e| e.to_string())
    }

    fn snapshot(&mut self) -> Snapshot {
        take_snapshot(self.py, &self.selection).0
    }
}

impl World for PyWorld<'_> {
    type Held = ScopeHandles;
    type Error = PyErr;

    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        registry()
    }
    fn unknown(id: ScopeId) -> PyErr {
        unknown(id)
    }
    fn new_held(&mut self) -> ScopeHandles {
        let experiment = self.experiment.as_ref().and_then(|e| PyWeakrefReference::new(e).ok()).map(Bound::unbind);
        ScopeHandles { experiment, ..ScopeHandles::default() }
    }
    fn hold_interrupts(&mut self) {
        self.interrupts = Some(interrupts::hold(self.py));
    }
    fn release_interrupts(&mut self) -> bool {
        self.interrupts.take().is_some_and(|held| held.release(self.py))
    }

    fn prepare_publishing(&mut self) -> PyResult<()> {
        ranks::prepare_publishing(self.py)
    }
    fn own_gpu(&mut self) -> Option<(u32, String)> {
        rank_gpu::own_gpu(self.py).map(|(index, because)| (index, because.describe().to_string()))
    }
    fn check_devices(&mut self, wanted: &[u32]) -> PyResult<()> {
        check_devices(self.py, wanted)
    }
    fn start_trace(&mut self, held: &mut ScopeHandles) -> Vec<String> {
        let (window, notes) = trace_recording::open_experiment(self.py);
        held.trace = Some(window);
        notes
    }
    fn take_inventory(&mut self, held: &mut ScopeHandles) -> PyResult<()> {
        if let Some(adapter) = self.adapter.as_ref().filter(|_| tensors_or_arrays_imported(self.py)) {
            (held.buffers, held.skipped) = holders::inventory(self.py, hunt_roots(adapter)?)?;
        }
        Ok(())
    }
    fn pin(&mut self, held: &mut ScopeHandles) -> PyResult<()> {
        if let Some(adapter) = &self.adapter {
            held.baseline = Some(Arc::new(Baseline::take(adapter, self.experiment.as_ref())?));
        }
        Ok(())
    }
    fn apply_limit(&mut self, held: &mut ScopeHandles, selection: &GpuSelection, limit: u64) -> PyResult<()> {
        held.limited = apply_limit(self.py, selection, limit)?;
        Ok(())
    }
    fn start_monitor(&mut self, held: &mut ScopeHandles, interval: Duration, gpus: bool) -> PyResult<()> {
        held.monitor = Some(monitor::Monitor::start(interval, None, gpus)?);
        Ok(())
    }
    fn start_host_trace(&mut self, held: &mut ScopeHandles) -> Vec<String> {
        let (window, notes) = host_trace::open(self.py, self.interrupts());
        held.host_trace = Some(window);
        notes
    }
    fn start_snapshot(&mut self, selection: &GpuSelection) -> Snapshot {
        let (start, torch) = opening_snapshot(self.py, selection, take_snapshot);
        self.torch = Some(torch);
        start
    }
    fn reset_counters(&mut self, start: &Snapshot) {
        if let Some(torch) = self.torch.take() {
            reset_counters(&torch, start);
        }
    }
    fn arm_recorder(&mut self) {
        crate::bindings::recorder::arm_recorder(self.py);
    }

    fn collect_garbage(&mut self) -> PyResult<()> {
        release(self.py, Step::CollectGarbage)
    }
    fn identities(&mut self, id: ScopeId) -> PyResult<Identities> {
        match baseline_of(id) {
            Some(baseline) => identities(&baseline.adapter(self.py)),
            None => Ok(Identities::default()),
        }
    }
    fn names_since_opening(&mut self, id: ScopeId) -> PyResult<Vec<NameState>> {
        match baseline_of(id) {
            Some(baseline) => baseline.judged(self.py),
            None => Ok(Vec::new()),
        }
    }
    fn snapshot(&mut self, selection: &GpuSelection) -> Snapshot {
        take_snapshot(self.py, selection).0
    }
    fn finish_host_trace(&mut self, held: &mut ScopeHandles) {
        held.host_found = held.host_trace.take().map(|window| host_trace::finish(self.py, window, self.interrupts()));
    }
    fn teardown(
        &mut self,
        held: &mut ScopeHandles,
        selection: &GpuSelection,
        keep: &BTreeSet<String>,
        names: bool,
    ) -> Teardown {
        let mut judged =
            held.baseline.as_deref().filter(|_| names).map(|baseline| NamespaceAtTeardown { py: self.py, baseline });
        let namespace = judged.as_mut().map(|j| j as &mut dyn teardown::Namespace);
        teardown::run(namespace, &mut Releaser { py: self.py, selection: selection.clone() }, keep)
    }
    fn inventory_notes(&self, held: &ScopeHandles) -> Vec<String> {
        held.skipped.note().into_iter().collect()
    }
    fn restore_limit(&mut self, held: &mut ScopeHandles) -> PyResult<()> {
        restore_limit(self.py, &held.limited)
    }
    fn stop_monitor(&mut self, held: &mut ScopeHandles) -> Vec<Sample> {
        let Some(mut monitor) = held.monitor.take() else { return Vec::new() };
        self.py.detach(|| monitor.stop());
        monitor.samples()
    }
    fn hunt_leaks(&mut self, held: &mut ScopeHandles, report: &mut Report) -> PyResult<()> {
        let adapter = held.baseline.as_ref().map(|b| b.adapter(self.py));
        (report.holders, held.storages) = holders::hunt_leaks(self.py, report, adapter.as_ref(), &held.buffers)?;
        Ok(())
    }
    fn drop_pins(&mut self, held: &mut ScopeHandles) {
        // What the report still reads stays; the rest (the pins first) goes now.
        let ScopeHandles { trace, host_found, storages, .. } = std::mem::take(held);
        *held = ScopeHandles { trace, host_found, storages, ..ScopeHandles::default() };
    }
    fn complete_trace(&mut self, held: &mut ScopeHandles, report: &mut Report) {
        if let Some(window) = held.trace.take() {
            trace::complete_report(self.py, window, report, &held.storages);
        }
    }
    fn complete_host_trace(&mut self, held: &mut ScopeHandles, report: &mut Report) {
        if let Some(found) = held.host_found.take() {
            found.complete_report(report);
        }
    }
    fn complete_ranks(&mut self, report: &mut Report) {
        ranks::complete_report(self.py, report);
    }
    fn update_sampler(&mut self) {
        update_sampler(self.py, None);
    }
    fn settle_recording(&mut self) {
        cell_trace::settle(self.py);
        crate::bindings::recorder::settle(self.py);
    }

    fn publish(&mut self, id: ScopeId, report: &Report) -> Vec<String> {
        ranks::publish_report(self.py, id, report)
    }
}

/// The pins a scope took at opening, while it is open.
fn baseline_of(id: ScopeId) -> Option<Arc<Baseline>> {
    registry().attached::<ScopeHandles>(id).and_then(|h| h.baseline.clone())
}

/// In a forked child: the parent's open scopes are not the child's (see
/// [`lifecycle::forget_in_child`]). The one fork reset of the registry and its records.
pub(in crate::bindings) fn forget_in_child() {
    lifecycle::forget_in_child(&mut registry());
}

/// The open experiments (their teardown not begun) whose objects are alive, by scope id.
#[pyfunction]
pub(in crate::bindings) fn open_experiments(py: Python) -> HashMap<ScopeId, Bound<PyAny>> {
    // Weak references cloned under the lock; upgraded, which may free nothing, once it is given back.
    let weak: Vec<(ScopeId, Py<PyWeakrefReference>)> = registry()
        .all_attached::<ScopeHandles>()
        .filter_map(|(id, held)| Some((id, held.experiment.as_ref()?.clone_ref(py))))
        .collect();
    weak.into_iter().filter_map(|(id, weak)| Some((id, weak.bind(py).upgrade()?))).collect()
}

/// Opens a scope; returns its id, the state it starts from, the reports of the scopes it
/// replaced (see [`crate::scope::Registry::replaced_by`]; `on_stack`: the open scopes whose code
/// is still running, never replaced by name), which finish first keeping `in_use`:
/// names the constructor's cell binds above the constructor, and whether an interrupt came
/// while it opened (held until then: see `interrupts`). `adapter` is None outside any
/// namespace (a function body in a script): the scope then measures and reports but deletes nothing.
/// `tool`: gpuexp opens it for one of its tools (a trainer's callback), see [`Owner`].
#[pyfunction]
#[pyo3(signature = (name=None, *, gpu=true, devices=None, adapter=None, owner=None, cell_log=true, limit=None,
                    monitor_s=None, handles=BTreeSet::new(), in_use=BTreeSet::new(), on_stack=BTreeSet::new(), params=None,
                    trace=None, tool=false))]
#[allow(clippy::too_many_arguments)] // one per keyword of GPUExperiment
pub(in crate::bindings) fn open_scope<'py>(
    py: Python<'py>,
    name: Option<String>,
    gpu: bool,
    devices: Option<Vec<u32>>,
    adapter: Option<Bound<'py, PyAny>>,
    owner: Option<Bound<'py, PyAny>>,
    cell_log: bool,
    limit: Option<u64>,
    monitor_s: Option<f64>,
    handles: BTreeSet<String>,
    in_use: BTreeSet<String>,
    on_stack: BTreeSet<ScopeId>,
    params: Option<Bound<PyDict>>,
    trace: Option<Bound<PyAny>>,
    tool: bool,
) -> PyResult<(ScopeId, SnapshotPy, Vec<ReportPy>, bool)> {
    let request = Request {
        name,
        gpu,
        devices,
        in_namespace: adapter.is_some(),
        cell_log,
        limit,
        monitor_s,
        handles,
        in_use,
        on_stack,
        params: params.as_ref().map(params_from).transpose()?,
        trace: trace.as_ref().map(host_trace::trace_kinds).transpose()?,
        owner: if tool { Owner::Tool } else { Owner::User },
        owner_identity: owner.as_ref().map(|o| o.as_ptr() as u64),
        on_main_thread: interrupts::on_main_thread(py)?,
    };
    let mut world = PyWorld { adapter, experiment: owner, ..PyWorld::new(py) };
    let opened = lifecycle::open(&mut world, request)?;
    let start = SnapshotPy { snapshot: opened.start, title: opened.title };
    Ok((opened.id, start, opened.replaced.into_iter().map(ReportPy).collect(), opened.interrupted))
}

/// `params={"bs": 64, "opt": "adam"}`: names with numbers, text or booleans, in the given order.
fn params_from(dict: &Bound<PyDict>) -> PyResult<Params> {
    let mut params = Params::default();
    for (key, value) in dict.iter() {
        let key: String = key.extract().map_err(|_| {
            PyTypeError::new_err(format!(
                "params= keys are names such as \"bs\"; got {}",
                key.repr().map_or_else(|_| "?".into(), |r| r.to_string())
            ))
        })?;
        // Numbers of any kind that says it is one (numpy's too): integers stay integers, and
        // numpy's bool is a bool, not the 1.0 its __float__ gives.
        let param = if value.is_instance_of::<PyBool>() || is_numpy_bool(&value) {
            Param::Bool(value.is_truthy()?)
        } else if let Ok(text) = value.cast::<PyString>() {
            Param::Text(text.to_string())
        } else if let Ok(int) = value.extract::<i64>() {
            Param::Int(int)
        } else if let Ok(float) = value.extract::<f64>() {
            Param::finite(&key, float)?
        } else {
            return Err(PyTypeError::new_err(format!(
                "params={{{key:?}: {}}}: a param is a number, a string or a bool, e.g. params={{\"bs\": 64}}",
                value.repr()?
            )));
        };
        params.set(&key, param);
    }
    Ok(params)
}

fn is_numpy_bool(value: &Bound<PyAny>) -> bool {
    let kind = value.get_type();
    let module = kind.module().map(|m| m.to_string()).unwrap_or_default();
    let name = kind.name().map(|n| n.to_string()).unwrap_or_default();
    module == "numpy" && (name == "bool_" || name == "bool")
}

#[pyfunction]
pub(in crate::bindings) fn scope_name(id: ScopeId) -> PyResult<String> {
    registry().name_of(id).ok_or_else(|| unknown(id))
}

#[pyfunction]
pub(in crate::bindings) fn is_open(id: ScopeId) -> bool {
    registry().scope(id).is_some_and(|s| !s.closing)
}

/// Protects names from deletion; each must exist now.
#[pyfunction]
pub(in crate::bindings) fn keep(py: Python, id: ScopeId, names: Vec<String>) -> PyResult<()> {
    let Some(baseline) = registry().attached::<ScopeHandles>(id).map(|h| h.baseline.clone()) else {
        return Err(PyValueError::new_err(
            "keep(): this experiment has already finished; nothing more will be deleted.",
        ));
    };
    let adapter_and_created = match baseline {
        Some(baseline) => Some((baseline.adapter(py), baseline.created(py)?)),
        None => None,
    };
    let (existing, system, created): (HashSet<String>, HashSet<String>, Vec<String>) = match adapter_and_created {
        Some((adapter, created)) => {
            (user_names(&adapter)?.into_iter().map(|(n, _)| n).collect(), system_names(&adapter)?, created)
        }
        None => (HashSet::new(), HashSet::new(), Vec::new()),
    };
    teardown::check_keep(&names, |n| existing.contains(n), |n| teardown::is_system_name(n, &system), &created)?;
    let mut registry = registry();
    let scope = registry.scope_mut(id).ok_or_else(|| unknown(id))?;
    scope.keep.extend(names);
    Ok(())
}

/// Finishes a scope, and first every scope opened inside it. Returns the reports of the
/// scopes it finished, innermost first (empty when this scope's teardown is already under
/// way), and whether an interrupt came meanwhile: it is held until every step has run, and the
/// caller raises it once the reports are shown. `keep` adds names to protect, without the
/// existence check of `keep()`. `during_reset`: IPython's `%reset` is clearing the namespace
/// and would fail on a name deleted under it, so the teardown leaves every name to the reset.
#[pyfunction]
#[pyo3(signature = (id, keep=Vec::new(), during_reset=false))]
pub(in crate::bindings) fn finish(
    py: Python,
    id: ScopeId,
    keep: Vec<String>,
    during_reset: bool,
) -> PyResult<(Vec<ReportPy>, bool)> {
    let finished = lifecycle::finish(&mut PyWorld::new(py), id, keep.into_iter().collect(), during_reset)?;
    Ok((finished.reports.into_iter().map(ReportPy).collect(), finished.interrupted))
}

/// Finishes the experiments found unreachable whose teardown may run `at` this point.
pub(in crate::bindings) fn finish_unreachable_at(
    py: Python,
    at: crate::scope::SafePoint,
) -> PyResult<(Vec<ReportPy>, bool)> {
    let finished = lifecycle::finish_unreachable(&mut PyWorld::new(py), at)?;
    Ok((finished.reports.into_iter().map(ReportPy).collect(), finished.interrupted))
}

/// The report of a scope as it stands: live while open, final once finished.
#[pyfunction]
pub(in crate::bindings) fn scope_report(py: Python, id: ScopeId) -> PyResult<ReportPy> {
    lifecycle::report_now(&mut PyWorld::new(py), id).map(ReportPy).ok_or_else(|| unknown(id))
}

/// The records of the cells that ran while a scope was open.
#[pyfunction]
pub(in crate::bindings) fn scope_cells(id: ScopeId) -> PyResult<Vec<CellRecordPy>> {
    let registry = registry();
    let all_gpus = registry.cell_log_all_gpus;
    let records = registry.cells_of_id(id).ok_or_else(|| unknown(id))?;
    Ok(records.into_iter().map(|r| CellRecordPy { record: Arc::new(r), all_gpus }).collect())
}
