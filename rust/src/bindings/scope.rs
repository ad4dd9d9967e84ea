//! Experiment scopes: opening one (pins, limit, monitor, start snapshot) and finishing it
//! (teardown in Rust's order, the report, the holders of what did not come back).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyModule;

use super::holders::{self, hunt_roots, tensors_or_arrays_imported, Buffer};
use super::namespace::{hidden_refs, namespace, pin_all, user_names, Pin};
use super::registry::{registry, unknown};
use super::report::{CellRecordPy, ReportPy, SnapshotPy};
use super::snapshot::{check_devices, opening_snapshot, reset_counters, selection, take_snapshot, update_sampler};
use super::torch::{apply_limit, release, restore_limit};
use crate::monitor;
use crate::report::{Names, Report, Span};
use crate::scope::{Finishing, Kind, Opening, ScopeId};
use crate::snapshot::GpuSelection;
use crate::teardown::{self, Binding, NameState, Step};

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
    /// The scope's monitor (`monitor=True`), stopped at finish; its samples go in the report.
    monitor: Option<monitor::Monitor>,
}

static PINS: LazyLock<Mutex<HashMap<ScopeId, Pins>>> = LazyLock::new(|| Mutex::new(HashMap::new()));

fn pins() -> MutexGuard<'static, HashMap<ScopeId, Pins>> {
    PINS.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Opens a scope; returns its id, the state it starts from, and the reports of the scopes it
/// replaced (see [`crate::scope::Registry::replaced_by`]), which finish first keeping `in_use`:
/// names the constructor's cell binds above the constructor. `adapter` is None outside any
/// namespace (a function body in a script): the scope then measures and reports but deletes nothing.
#[pyfunction]
#[pyo3(signature = (name=None, *, gpu=true, devices=None, adapter=None, owner=None, cell_log=true, limit=None,
                    monitor_s=None, handles=BTreeSet::new(), in_use=BTreeSet::new()))]
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
) -> PyResult<(ScopeId, SnapshotPy, Vec<ReportPy>)> {
    let mut replaced = Vec::new();
    for id in registry().replaced_by(name.as_deref(), &handles) {
        replaced.extend(finish(py, id, in_use.iter().cloned().collect())?);
    }
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
            Some(a) if tensors_or_arrays_imported(py) => holders::inventory(py, hunt_roots(a)?)?,
            _ => HashSet::new(),
        },
        adapter: adapter.map(Bound::unbind),
        owner: owner.as_ref().map(Pin::new),
        limited: match limit {
            Some(limit) => apply_limit(py, &selection, limit)?,
            None => Vec::new(),
        },
        monitor: match monitor_s {
            Some(seconds) => {
                let interval = std::time::Duration::try_from_secs_f64(seconds)
                    .map_err(|_| PyValueError::new_err("monitor= takes an interval such as \"100ms\""))?;
                Some(monitor::Monitor::start(interval, None, gpu)?)
            }
            None => None,
        },
    };
    let (start, torch) = opening_snapshot(py, &selection, take_snapshot);
    let (id, title) = {
        let mut registry = registry();
        let name = registry.name_or_default(name);
        let kind = if gpu { Kind::Gpu } else { Kind::Cpu };
        let title = format!("{name} · started");
        let id = registry.open(Opening { name, kind, selection, start: start.clone(), cell_log, limit, handles });
        (id, title)
    };
    reset_counters(&torch, &start);
    pins().insert(id, baseline);
    Ok((id, SnapshotPy { snapshot: start, title }, replaced))
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
    teardown::check_keep(&names, |n| existing.contains(n), &created)?;
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
pub(super) fn finish(py: Python, id: ScopeId, keep: Vec<String>) -> PyResult<Vec<ReportPy>> {
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
        if let Some(mut monitor) = pins.monitor.take() {
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
    let adapter = scope_pins.as_ref().and_then(|p| p.adapter.as_ref()).map(|a| a.bind(py).clone());
    let before = scope_pins.as_ref().map(|p| &p.buffers);
    match holders::hunt_leaks(py, &report, adapter.as_ref(), before.unwrap_or(&HashSet::new())) {
        Ok(still_held) => report.still_held = still_held,
        Err(e) => report.notes.push(format!("the leak hunt failed: {e}")),
    }
    drop(scope_pins);
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
