//! The Python faces of what gpuexp shows: reports, metrics, cell records, diagnoses, holders,
//! snapshots. Each is shown as a table (text and HTML) and serialises to JSON.

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::report::{self, CellRecord, Holders, Report};
use crate::snapshot::Snapshot;
use crate::units;

/// `to_json()`, `to_dict()`, `str()` (the text table), `repr()` and `_repr_html_` (the same
/// table in HTML) for a type that is shown as a table: `$value` is what serialises, `$grid`
/// the table, both written in terms of `$this`.
macro_rules! shown_as_table {
    ($type:ty, |$this:ident| $value:expr, $grid:expr) => {
        #[pymethods]
        impl $type {
            /// The same data as JSON text (its schema: docs/json.md).
            fn to_json(&self) -> String {
                let $this = self;
                serde_json::to_string_pretty($value).expect("what gpuexp shows always serialises")
            }
            /// The same data as dicts, lists, numbers and strings: ``json.loads(self.to_json())``.
            fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
                $crate::bindings::report::json_to_python(py, &self.to_json())
            }
            fn __str__(&self) -> String {
                let $this = self;
                $grid.to_text()
            }
            fn __repr__(&self) -> String {
                self.__str__()
            }
            /// The table as HTML, which Jupyter shows.
            fn _repr_html_(&self) -> String {
                let $this = self;
                $grid.to_html()
            }
        }
    };
}

/// Read-only attributes, each a `#[getter]` with its docstring: `name: Type = value`, the value
/// written in terms of `$this`.
macro_rules! getters {
    ($type:ty, |$this:ident| { $($(#[$doc:meta])* $name:ident: $ret:ty = $value:expr;)* }) => {
        #[pymethods]
        impl $type {
            $(
                $(#[$doc])*
                #[getter]
                fn $name(&self) -> $ret {
                    let $this = self;
                    $value
                }
            )*
        }
    };
}

pub(in crate::bindings) fn json_to_python<'py>(py: Python<'py>, json: &str) -> PyResult<Bound<'py, PyAny>> {
    py.import("json")?.call_method1("loads", (json,))
}

/// Core data as Python's dicts, lists, numbers and strings, in its JSON shape.
pub(in crate::bindings) fn to_python<'py>(
    py: Python<'py>,
    value: &impl serde::Serialize,
) -> PyResult<Bound<'py, PyAny>> {
    json_to_python(py, &serde_json::to_string(value).expect("what gpuexp shows always serialises"))
}

/// One figure of a report (host RSS, torch allocated, NVML process, ...), in bytes.
#[pyclass(name = "Metric", module = "gpuexp", frozen)]
pub(in crate::bindings) struct MetricPy(report::Metric);

getters!(MetricPy, |this| {
    /// When the scope opened.
    start: u64 = this.0.start;
    /// Just before the teardown deleted anything (now, while the scope is open).
    before_teardown: u64 = this.0.before_teardown;
    /// After the teardown; None while the scope is open.
    end: Option<u64> = this.0.end;
    /// The highest it went during the scope.
    peak: u64 = this.0.peak;
    /// before_teardown - start; can be negative.
    consumed: i64 = this.0.consumed;
    /// before_teardown - end: what the teardown gave back; None while open.
    reclaimed: Option<i64> = this.0.reclaimed;
    /// reclaimed / consumed; None while open or when nothing was consumed.
    reclaimed_share: Option<f64> = this.0.reclaimed_share();
});

#[pymethods]
impl MetricPy {
    fn __repr__(&self) -> String {
        let m = &self.0;
        format!(
            "Metric(start={}, peak={}, consumed={}, reclaimed={})",
            units::bytes(m.start),
            units::bytes(m.peak),
            units::signed_bytes(m.consumed),
            m.reclaimed.map(units::signed_bytes).unwrap_or_else(|| "—".into())
        )
    }
}

/// The host's figures in a report (``report.host``).
#[pyclass(name = "HostReport", module = "gpuexp", frozen)]
pub(in crate::bindings) struct HostReportPy(report::HostReport);

getters!(HostReportPy, |this| {
    /// This process's resident memory.
    rss: MetricPy = MetricPy(this.0.rss);
    /// What the host can still give, capped by the cgroup's headroom where a limit applies.
    available: u64 = this.0.available;
    /// The system's total memory.
    total: u64 = this.0.total;
    /// The cgroup's memory limit; None where there is none.
    cgroup_limit: Option<u64> = this.0.cgroup_limit;
});

/// One GPU's figures in a report (``report.gpus``).
#[pyclass(name = "GpuReport", module = "gpuexp", frozen)]
pub(in crate::bindings) struct GpuReportPy(report::GpuReport);

getters!(GpuReportPy, |this| {
    /// N in ``cuda:N``.
    torch_index: u32 = this.0.torch_index;
    /// The GPU's index in NVML's order (nvidia-smi's).
    nvml_index: u32 = this.0.nvml_index;
    /// The GPU's UUID, as nvidia-smi shows it (``GPU-…``).
    uuid: String = this.0.uuid.clone();
    /// The GPU's model, e.g. "NVIDIA H100 80GB HBM3".
    name: String = this.0.name.clone();
    /// The GPU's memory, in bytes.
    total: u64 = this.0.total;
    /// What torch's tensors occupy; None when torch was never imported.
    torch_allocated: Option<MetricPy> = this.0.torch_allocated.map(MetricPy);
    /// What torch's caching allocator holds (allocated plus its cache); None when torch was
    /// never imported.
    torch_reserved: Option<MetricPy> = this.0.torch_reserved.map(MetricPy);
    /// NVML's figure for this process; None where the driver doesn't list it.
    process_used: Option<MetricPy> = this.0.process_used.map(MetricPy);
    /// NVML's figure for the device; None if NVML could not read it.
    device_used: Option<MetricPy> = this.0.device_used.map(MetricPy);
    /// The CUDA out-of-memory errors torch counted during the scope.
    num_ooms: Option<u64> = this.0.num_ooms;
});

/// What an experiment found (``exp.data``, ``exp.finish()``, ``gpuexp.history()``): its figures,
/// what its teardown did, and its notes. Sizes are in bytes. ``str()`` is the text table.
#[pyclass(name = "Report", module = "gpuexp", frozen)]
#[derive(Clone)]
pub(in crate::bindings) struct ReportPy(pub(in crate::bindings) Arc<Report>);

getters!(ReportPy, |this| {
    /// The experiment's name (``exp-N`` when it was given none).
    name: &str = &this.0.name;
    /// False while the scope is open.
    finished: bool = this.0.finished;
    /// When the scope opened, RFC 3339 UTC.
    started_at: &str = &this.0.started_at;
    /// When it finished; None while open.
    finished_at: Option<&str> = this.0.finished_at.as_deref();
    /// Seconds from opening to finishing (so far, while open).
    duration_s: f64 = this.0.duration_s;
    /// The names the teardown deleted.
    deleted: Vec<String> = this.0.names.deleted.clone();
    /// Names from before the scope that it rebound to other objects (deleted too).
    rebound: Vec<String> = this.0.names.rebound.clone();
    /// Names left alone: modules, ``keep()``, names the constructor cell still uses.
    kept: Vec<String> = this.0.names.kept.clone();
    /// IPython's references the teardown dropped: ``Out[n]``, ``_``, the last exception, ...
    cleared: Vec<String> = this.0.names.cleared.clone();
    /// Names the teardown meant to delete that are still bound, each with why.
    not_deleted: Vec<String> = this.0.names.not_deleted.clone();
    /// Entries the scope made that look like IPython's (``_1``, ``__cache__``), left in place.
    left: Vec<String> = this.0.names.left.clone();
    /// What the table alone would not say: a figure missing and why, memory still held, ...
    notes: Vec<String> = this.0.notes.clone();
    /// Host RSS and memory.
    host: HostReportPy = HostReportPy(this.0.host.clone());
    /// One per GPU the experiment covers.
    gpus: Vec<GpuReportPy> = this.0.gpus.iter().cloned().map(GpuReportPy).collect();
});

shown_as_table!(ReportPy, |this| this.0.as_ref(), this.0.as_ref());

/// A report is data that never changes: a copy is the report itself, and a pickle is its JSON
/// (the cell log and the monitor's timeline included).
#[pymethods]
impl ReportPy {
    /// Pickled as its JSON (``report_from_json``).
    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyAny>, (String,))> {
        let json = serde_json::to_string(self.0.as_ref()).expect("reports serialise");
        Ok((py.import("gpuexp._core")?.getattr("report_from_json")?, (json,)))
    }
    /// The report itself: it never changes.
    fn __copy__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }
    /// The report itself: it never changes.
    fn __deepcopy__<'py>(slf: PyRef<'py, Self>, _memo: Bound<'py, PyAny>) -> PyRef<'py, Self> {
        slf
    }
}

/// A report back from its JSON (how a pickled ``Report`` loads).
#[pyfunction]
pub(in crate::bindings) fn report_from_json(json: &str) -> PyResult<ReportPy> {
    serde_json::from_str(json)
        .map(|report| ReportPy(Arc::new(report)))
        .map_err(|e| PyValueError::new_err(format!("not the JSON of a gpuexp report: {e}")))
}

#[pymethods]
impl ReportPy {
    /// The timeline of the experiment's monitor (``monitor=True``) as a matplotlib figure, saved
    /// to ``path`` when given.
    #[pyo3(signature = (path=None))]
    fn plot<'py>(&self, py: Python<'py>, path: Option<Bound<'py, PyAny>>) -> PyResult<Bound<'py, PyAny>> {
        if self.0.monitor.is_empty() {
            return Err(PyValueError::new_err(
                "this experiment recorded no timeline: open it with GPUExperiment(..., monitor=True)",
            ));
        }
        let samples = to_python(py, &self.0.monitor)?;
        let title = format!("gpuexp · {}", self.0.name);
        crate::bindings::error::optional(py, "matplotlib", "plot()")?;
        py.import("gpuexp.monitor")?.call_method1("plot_samples", (samples, path, title))
    }
}

/// One cell of the cell log (``exp.cells``, ``gpuexp.cells()``): what it did to memory. ``str()``
/// is the compact text block, ``_repr_html_`` the HTML one.
#[pyclass(name = "CellRecord", module = "gpuexp", frozen)]
pub(in crate::bindings) struct CellRecordPy {
    pub(in crate::bindings) record: Arc<CellRecord>,
    pub(in crate::bindings) all_gpus: bool,
}

getters!(CellRecordPy, |this| {
    /// The cell's number: N in ``In [N]``.
    execution_count: u64 = this.record.execution_count;
    /// How long the cell ran, in seconds.
    wall_s: f64 = this.record.wall_s;
    /// What the block alone would not say, e.g. that torch's peak counters were reset during the cell.
    notes: Vec<String> = this.record.notes.clone();
});

shown_as_table!(CellRecordPy, |this| this.record.as_ref(), this.record.grid(this.all_gpus));

/// What holds memory, largest first (``gpuexp.holders()``).
#[pyclass(name = "Holders", module = "gpuexp", frozen)]
pub(in crate::bindings) struct HoldersPy(pub(in crate::bindings) Holders);

getters!(HoldersPy, |this| {
    /// The paths, largest holder first.
    paths: Vec<String> = this.0.holders.iter().map(|h| h.path.clone()).collect();
});

#[pymethods]
impl HoldersPy {
    fn __len__(&self) -> usize {
        self.0.holders.len()
    }
}

shown_as_table!(HoldersPy, |this| &this.0, this.0.grid("holders"));

/// What the OOM rescue shows under a CUDA out-of-memory traceback.
#[pyclass(name = "OomDiagnosis", module = "gpuexp", frozen)]
pub(in crate::bindings) struct OomPy(pub(in crate::bindings) report::OomDiagnosis);

getters!(OomPy, |this| {
    /// What the failed allocation asked for, in bytes; None where torch's message doesn't say.
    requested: Option<u64> = this.0.requested;
    /// What a person can do, from the figures: the batch that should fit, ``expandable_segments``
    /// against fragmentation, other processes to stop.
    hints: Vec<String> = this.0.hints.clone();
    /// Where the training run that raised it stood ("epoch 1, step 7, batch input_ids (8, 128) int64").
    training: Option<String> = this.0.training.as_ref().map(|p| p.describe());
});

shown_as_table!(OomPy, |this| &this.0, this.0.grid());

/// One reading of the host and every visible GPU (``gpuexp.snapshot()``).
#[pyclass(name = "Snapshot", module = "gpuexp", frozen)]
pub(in crate::bindings) struct SnapshotPy {
    pub(in crate::bindings) snapshot: Snapshot,
    pub(in crate::bindings) title: String,
}

getters!(SnapshotPy, |this| {
    /// What the table alone would not say: a figure missing and why.
    notes: Vec<String> = this.snapshot.notes.clone();
});

#[pymethods]
impl SnapshotPy {
    /// One dict per visible GPU: its identity, NVML's figures and torch's (its JSON shape).
    #[getter]
    fn gpus<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        to_python(py, &self.snapshot.gpus)?.cast_into::<PyList>().map_err(Into::into)
    }
    /// The host's figures as a dict: RSS, available, total, the cgroup's limit (its JSON shape).
    #[getter]
    fn host<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        to_python(py, &self.snapshot.host)
    }
}

shown_as_table!(SnapshotPy, |this| &this.snapshot, report::snapshot_grid(&this.snapshot, &this.title));
