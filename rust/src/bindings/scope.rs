//! Experiment scopes: opening one (pins, limit, monitor, start snapshot) and finishing it
//! (the core's teardown over the user's namespace, the report, the holders of what did not
//! come back).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyString};

use super::cell_trace;
use super::holders::{self, hunt_roots, tensors_or_arrays_imported, Buffer};
use super::host_trace::{self, HostWindow};
use super::interrupts;
use super::namespace::{system_names, user_names, Baseline, Judged};
use super::rank_gpu;
use super::ranks;
use super::registry::{registry, unknown};
use super::report::{CellRecordPy, ReportPy, SnapshotPy};
use super::snapshot::{check_devices, opening_snapshot, reset_counters, selection, take_snapshot, update_sampler};
use super::torch::{apply_limit, release, restore_limit};
use super::trace;
use super::trace_recording::{self, TraceWindow};
use crate::monitor;
use crate::report::{Details, Param, Params, Report};
use crate::scope::{Finishing, Kind, Opening, Owner, SafePoint, ScopeId};
use crate::snapshot::{GpuSelection, Snapshot};
use crate::teardown::{self, Step};
use crate::trace::TraceKinds;
use crate::uninspectable::Uninspectable;
use crate::units;

/// What an open scope holds on the Python side.
struct Held {
    /// None outside any namespace (a function body in a script): nothing to delete there.
    /// Shared, so that `keep()` reads it with `HELD` unlocked: reading runs Python code, which
    /// may finish another scope (a `__del__`), and that takes `HELD`.
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
    /// Its tracemalloc snapshot at opening (`trace="host"`), compared at finish.
    host_trace: Option<HostWindow>,
}

/// The pins a scope took at opening, while it is open.
pub(super) fn baseline_of(id: ScopeId) -> Option<Arc<Baseline>> {
    held().get(&id).and_then(|h| h.baseline.clone())
}

static HELD: LazyLock<Mutex<HashMap<ScopeId, Held>>> = LazyLock::new(|| Mutex::new(HashMap::new()));

fn held() -> MutexGuard<'static, HashMap<ScopeId, Held>> {
    HELD.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// In a forked child: the parent's open scopes are not the child's. Their monitors' threads
/// don't exist here, so they are forgotten, never joined.
pub(super) fn forget_in_child() {
    for (_, mut scope_held) in std::mem::take(&mut *held()) {
        if let Some(monitor) = scope_held.monitor.take() {
            std::mem::forget(monitor);
        }
        // The pins refer into the parent's namespace: they go without running Python code.
        std::mem::forget(scope_held.baseline.take());
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
pub(super) fn open_scope(
    py: Python,
    name: Option<String>,
    gpu: bool,
    devices: Option<Vec<u32>>,
    adapter: Option<Bound<PyAny>>,
    owner: Option<Bound<PyAny>>,
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
    let opened_by = if tool { Owner::Tool } else { Owner::User };
    let params = params.as_ref().map(params_from).transpose()?;
    let trace = trace.as_ref().map(host_trace::trace_kinds).transpose()?;
    let kinds = TraceKinds::for_scope(trace, registry().trace_by_default, gpu)?;
    // Before interrupts are held: opening a rank's store may wait on the network or a disk.
    ranks::prepare_publishing(py)?;
    let interrupt = interrupts::hold(py);
    let mut to_publish = Vec::new();
    // A closure, so that every error path still gives the held interrupt back below.
    let open = || -> PyResult<(ScopeId, SnapshotPy, Vec<ReportPy>)> {
        // Outside a notebook, the experiments found unreachable since the last safe point go first.
        let mut replaced = finish_due(py, &interrupt, SafePoint::Opening, &mut to_publish)?;
        // Collected first: finishing takes the registry's lock, which a guard alive in the loop's
        // head would still hold.
        let replaced_ids = registry().replaced_by(name.as_deref(), &handles, &on_stack, opened_by);
        for id in replaced_ids {
            let keep = in_use.iter().cloned().collect();
            replaced.extend(finish_with_inner(py, &interrupt, id, keep, false, &mut to_publish)?);
        }
        // A rank covers its own GPU unless `devices=` names others: on a node of 8, the other
        // seven would be idle rows in every rank's report and in `ranks()`.
        let own = if gpu && devices.is_none() { rank_gpu::own_gpu(py) } else { None };
        let selection = selection(gpu, devices.or_else(|| own.map(|(index, _)| vec![index])));
        if let GpuSelection::Only(wanted) = &selection {
            check_devices(py, wanted)?;
        }
        // Before the start snapshot: a trace may initialise CUDA, whose context is no scope's doing.
        let trace = kinds.cuda().then(|| trace_recording::open_experiment(py));
        let (trace, mut trace_notes) = match trace {
            Some((window, notes)) => (Some(window), notes),
            None => (None, Vec::new()),
        };
        let (buffers, skipped) = match &adapter {
            Some(a) if tensors_or_arrays_imported(py) => holders::inventory(py, hunt_roots(a)?)?,
            _ => (HashSet::new(), Uninspectable::default()),
        };
        // Pins are made before the start snapshot so their own memory is not charged to the scope.
        let scope_held = Held {
            baseline: adapter.as_ref().map(|a| Baseline::take(a, owner.as_ref()).map(Arc::new)).transpose()?,
            buffers,
            skipped,
            limited: match limit {
                Some(limit) => apply_limit(py, &selection, limit)?,
                None => Vec::new(),
            },
            monitor: match monitor_s {
                Some(seconds) => Some(monitor::Monitor::start(units::interval_of_seconds(seconds)?, None, gpu)?),
                None => None,
            },
            trace,
            host_trace: None,
        };
        // After the pins and the inventory: gpuexp's own objects are not the experiment's growth.
        let host_trace = kinds.host().then(|| {
            let (window, notes) = host_trace::open(py, &interrupt);
            trace_notes.extend(notes);
            window
        });
        let scope_held = Held { host_trace, ..scope_held };
        let (mut start, torch) = opening_snapshot(py, &selection, take_snapshot);
        start.notes.extend(trace_notes);
        if let Some((index, because)) = own {
            start
                .notes
                .push(format!("a rank: covers cuda:{index} only, {}; devices= names others", because.describe()));
        }
        let (id, title) = {
            let mut registry = registry();
            let name = registry.name_or_default(name);
            let kind = if gpu { Kind::Gpu } else { Kind::Cpu };
            let title = format!("{name} · started");
            let id = registry.open(Opening {
                name,
                kind,
                selection,
                start: start.clone(),
                cell_log,
                limit,
                handles,
                params,
                owner: opened_by,
            });
            (id, title)
        };
        reset_counters(&torch, &start);
        held().insert(id, scope_held);
        super::recorder::arm_recorder(py);
        Ok((id, SnapshotPy { snapshot: start, title }, replaced))
    };
    let opened = open();
    let interrupted = interrupt.release(py);
    let amended = publish(py, &to_publish);
    let (id, start, replaced) = opened?;
    Ok((id, start, with_notes(replaced, &amended), interrupted))
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
            // JSON has no NaN nor infinity: stored, they would read back as null.
            if !float.is_finite() {
                return Err(PyValueError::new_err(format!(
                    "params={{{key:?}: {float}}}: a param must be a finite number (JSON, where reports go, \
                     has no {float}); pass it as text, e.g. params={{{key:?}: \"{float}\"}}"
                )));
            }
            Param::Float(float)
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
pub(super) fn scope_name(id: ScopeId) -> PyResult<String> {
    let registry = registry();
    if let Some(scope) = registry.scope(id) {
        return Ok(scope.name.clone());
    }
    registry.report(id).map(|r| r.name.clone()).ok_or_else(|| unknown(id))
}

#[pyfunction]
pub(super) fn is_open(id: ScopeId) -> bool {
    registry().scope(id).is_some_and(|s| !s.closing)
}

/// Protects names from deletion; each must exist now.
#[pyfunction]
pub(super) fn keep(py: Python, id: ScopeId, names: Vec<String>) -> PyResult<()> {
    let baseline = {
        let held = held();
        let Some(scope_held) = held.get(&id) else {
            return Err(PyValueError::new_err(
                "keep(): this experiment has already finished; nothing more will be deleted.",
            ));
        };
        scope_held.baseline.clone()
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
pub(super) fn finish(
    py: Python,
    id: ScopeId,
    keep: Vec<String>,
    during_reset: bool,
) -> PyResult<(Vec<ReportPy>, bool)> {
    let held = interrupts::hold(py);
    let mut to_publish = Vec::new();
    let finished = finish_with_inner(py, &held, id, keep, during_reset, &mut to_publish);
    let interrupted = held.release(py);
    let amended = publish(py, &to_publish);
    Ok((with_notes(finished?, &amended), interrupted))
}

/// Publishes the reports a teardown completed, in a rank, once the held interrupt is given
/// back: a store may wait, and only gpuexp's own bookkeeping runs with interrupts held. What
/// a store's failure adds to a report is kept in the history; returns each report so amended,
/// after its version before.
pub(super) fn publish(py: Python, ids: &[ScopeId]) -> Vec<(Arc<Report>, Arc<Report>)> {
    let mut amended = Vec::new();
    for &id in ids {
        let Some(report) = registry().report(id) else { continue };
        let notes = ranks::publish_report(py, id, &report);
        if let Some(with_notes) = registry().add_notes(id, notes) {
            amended.push((report, with_notes));
        }
    }
    amended
}

/// The reports to hand back, each in its version with the notes publishing added.
pub(super) fn with_notes(reports: Vec<ReportPy>, amended: &[(Arc<Report>, Arc<Report>)]) -> Vec<ReportPy> {
    let latest = |r: ReportPy| match amended.iter().find(|(before, _)| Arc::ptr_eq(before, &r.0)) {
        Some((_, after)) => ReportPy(after.clone()),
        None => r,
    };
    reports.into_iter().map(latest).collect()
}

/// `during_reset`: see [`finish`]. `to_publish` gets the scopes whose teardown this call completed: [`publish`] sends them on.
/// `interrupts`: those held meanwhile, let through where work may be dropped (`host_trace`).
pub(super) fn finish_with_inner(
    py: Python,
    interrupts: &interrupts::Held,
    id: ScopeId,
    keep: Vec<String>,
    during_reset: bool,
    to_publish: &mut Vec<ScopeId>,
) -> PyResult<Vec<ReportPy>> {
    let inner = registry().inner_of(id);
    let mut finished = Vec::new();
    for inner_id in inner {
        finished.extend(finish_with_inner(py, interrupts, inner_id, keep.clone(), during_reset, to_publish)?);
    }
    if let Some(scope) = registry().scope_mut(id) {
        scope.keep.extend(keep);
    }
    keep_what_came_after(py, id)?;
    let scope = match registry().begin_finish(id) {
        Finishing::Finished(report) => return Ok(vec![ReportPy(report)]),
        Finishing::InProgress => return Ok(finished),
        Finishing::Unknown => return Err(unknown(id)),
        Finishing::Ready(scope) => scope,
    };
    let mut scope_held = held().remove(&id);
    let (before, _) = take_snapshot(py, &scope.selection);
    registry().peaks.observe(&before);
    // Before the teardown: what the experiment's code made and still held, not what it leaked.
    let host =
        scope_held.as_mut().and_then(|h| h.host_trace.take()).map(|window| host_trace::finish(py, window, interrupts));

    let mut judged = scope_held
        .as_ref()
        .and_then(|h| h.baseline.as_ref())
        .filter(|_| !during_reset)
        .map(|baseline| Judged { py, baseline });
    let namespace = judged.as_mut().map(|j| j as &mut dyn teardown::Namespace);
    let mut releaser = Releaser { py, selection: scope.selection.clone() };
    let done = teardown::run(namespace, &mut releaser, &scope.keep);

    let mut details = Details { names: done.names, notes: done.notes, ..Details::default() };
    if during_reset {
        details
            .notes
            .push("finished by %reset: the reset deletes names itself, so gpuexp deleted none and lists none (what the reset keeps stays)".into());
    }
    if let Some(scope_held) = scope_held.as_mut() {
        details.notes.extend(scope_held.skipped.note());
        if let Err(e) = restore_limit(py, &scope_held.limited) {
            details.notes.push(format!("restoring torch's memory fraction failed: {e}"));
        }
        if let Some(mut monitor) = scope_held.monitor.take() {
            py.detach(|| monitor.stop());
            details.monitor = monitor.samples();
        }
    }
    let mut report = registry().report_of(&scope, &before, Some(&done.end), details);
    // The hunt runs Python code, so the registry is not held (see `registry`).
    let adapter = scope_held.as_ref().and_then(|h| h.baseline.as_ref()).map(|b| b.adapter(py));
    let buffers = scope_held.as_ref().map(|h| &h.buffers);
    let storages = match holders::hunt_leaks(py, &report, adapter.as_ref(), buffers.unwrap_or(&HashSet::new())) {
        Ok((found, storages)) => {
            report.holders = found;
            storages
        }
        Err(e) => {
            report.notes.push(format!("the leak hunt failed: {e}"));
            Vec::new()
        }
    };
    let trace = scope_held.as_mut().and_then(|h| h.trace.take());
    drop(scope_held);
    if let Some(window) = trace {
        trace::complete_report(py, window, &mut report, &storages);
    }
    if let Some(host) = host {
        host.complete_report(&mut report);
    }
    ranks::complete_report(py, &mut report);
    finished.push(ReportPy(registry().complete(id, report)));
    to_publish.push(id);
    update_sampler(py, None);
    // The cell log this scope kept on may have held a share of the recording.
    cell_trace::settle(py);
    super::recorder::settle(py);
    Ok(finished)
}

/// The report of a scope as it stands: live while open, final once finished.
#[pyfunction]
pub(super) fn scope_report(py: Python, id: ScopeId) -> PyResult<ReportPy> {
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
    Ok(ReportPy(Arc::new(registry.report_of(scope, &now, None, Details::default()))))
}

/// The records of the cells that ran while a scope was open.
#[pyfunction]
pub(super) fn scope_cells(id: ScopeId) -> PyResult<Vec<CellRecordPy>> {
    let registry = registry();
    let all_gpus = registry.cell_log_all_gpus;
    let records = match registry.scope(id) {
        Some(scope) => registry.cells_of(scope),
        None => registry.report(id).ok_or_else(|| unknown(id))?.cells.clone(),
    };
    Ok(records.into_iter().map(|r| CellRecordPy { record: Arc::new(r), all_gpus }).collect())
}

/// The teardowns due `at` this point, run with interrupts held by the caller. A teardown's own
/// `gc.collect()` may find another experiment unreachable: it is due here too. One that waits
/// behind a scope opened inside it gets one collection first, since that scope may be garbage
/// the collector has not found yet. Each round finishes every scope it took (a finished one
/// leaves the open scopes) or stops at an error.
pub(super) fn finish_due(
    py: Python,
    interrupts: &interrupts::Held,
    at: SafePoint,
    to_publish: &mut Vec<ScopeId>,
) -> PyResult<Vec<ReportPy>> {
    let mut finished = Vec::new();
    let mut collected = false;
    loop {
        let due = registry().due(at);
        if due.is_empty() {
            if collected || !registry().unreachable_waiting() {
                return Ok(finished);
            }
            release(py, Step::CollectGarbage)?;
            collected = true;
        }
        for id in due {
            finished.extend(finish_with_inner(py, interrupts, id, Vec::new(), false, to_publish)?);
        }
    }
}

/// Before the teardown of a scope found unreachable: the names bound since one of the user's
/// names last led to it are kept, and its report says why (judged now, against the user's names
/// as they are).
pub(super) fn keep_what_came_after(py: Python, id: ScopeId) -> PyResult<()> {
    if registry().scope(id).is_none_or(|s| s.unreachable.is_none()) {
        return Ok(());
    }
    let now = match baseline_of(id) {
        Some(baseline) => super::namespace::identities(&baseline.adapter(py))?,
        None => Default::default(),
    };
    let mut registry = registry();
    if let Some((kept, note)) = registry.kept_when_unreachable(id, &now) {
        if let Some(scope) = registry.scope_mut(id) {
            scope.keep.extend(kept);
            scope.notes.push(note);
        }
    }
    Ok(())
}
