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

pub(super) fn json_to_python<'py>(py: Python<'py>, json: &str) -> PyResult<Bound<'py, PyAny>> {
    py.import("json")?.call_method1("loads", (json,))
}

/// One figure of a report (host RSS, torch allocated, NVML process, ...), in bytes.
#[pyclass(name = "Metric", module = "gpuexp", frozen, get_all)]
#[derive(Clone)]
pub(super) struct MetricPy {
    /// When the scope opened.
    pub(super) start: u64,
    /// Just before the teardown deleted anything (now, while the scope is open).
    pub(super) before_teardown: u64,
    /// After the teardown; None while the scope is open.
    pub(super) end: Option<u64>,
    /// The highest it went during the scope.
    pub(super) peak: u64,
    /// before_teardown - start; can be negative.
    pub(super) consumed: i64,
    /// before_teardown - end: what the teardown gave back; None while open.
    pub(super) reclaimed: Option<i64>,
    /// reclaimed / consumed; None while open or when nothing was consumed.
    pub(super) reclaimed_share: Option<f64>,
}

impl From<&report::Metric> for MetricPy {
    fn from(m: &report::Metric) -> Self {
        MetricPy {
            start: m.start,
            before_teardown: m.before_teardown,
            end: m.end,
            peak: m.peak,
            consumed: m.consumed,
            reclaimed: m.reclaimed,
            reclaimed_share: m.reclaimed_share(),
        }
    }
}

#[pymethods]
impl MetricPy {
    fn __repr__(&self) -> String {
        format!(
            "Metric(start={}, peak={}, consumed={}, reclaimed={})",
            units::bytes(self.start),
            units::bytes(self.peak),
            units::signed_bytes(self.consumed),
            self.reclaimed.map(units::signed_bytes).unwrap_or_else(|| "—".into())
        )
    }
}

/// The host's figures in a report (``report.host``).
#[pyclass(name = "HostReport", module = "gpuexp", frozen, get_all)]
#[derive(Clone)]
pub(super) struct HostReportPy {
    /// This process's resident memory.
    pub(super) rss: MetricPy,
    /// What the host can still give, capped by the cgroup's headroom where a limit applies.
    pub(super) available: u64,
    /// The system's total memory.
    pub(super) total: u64,
    /// The cgroup's memory limit; None where there is none.
    pub(super) cgroup_limit: Option<u64>,
}

/// One GPU's figures in a report (``report.gpus``).
#[pyclass(name = "GpuReport", module = "gpuexp", frozen, get_all)]
#[derive(Clone)]
pub(super) struct GpuReportPy {
    /// N in ``cuda:N``.
    pub(super) torch_index: u32,
    /// The GPU's index in NVML's order (nvidia-smi's).
    pub(super) nvml_index: u32,
    /// The GPU's UUID, as nvidia-smi shows it (``GPU-…``).
    pub(super) uuid: String,
    /// The GPU's model, e.g. "NVIDIA H100 80GB HBM3".
    pub(super) name: String,
    /// The GPU's memory, in bytes.
    pub(super) total: u64,
    /// What torch's tensors occupy; None when torch was never imported.
    pub(super) torch_allocated: Option<MetricPy>,
    /// What torch's caching allocator holds (allocated plus its cache); None when torch was
    /// never imported.
    pub(super) torch_reserved: Option<MetricPy>,
    /// NVML's figure for this process; None where the driver doesn't list it.
    pub(super) process_used: Option<MetricPy>,
    /// NVML's figure for the device; None if NVML could not read it.
    pub(super) device_used: Option<MetricPy>,
    /// The CUDA out-of-memory errors torch counted during the scope.
    pub(super) num_ooms: Option<u64>,
}

/// What an experiment found (``exp.data``, ``exp.finish()``, ``gpuexp.history()``): its figures,
/// what its teardown did, and its notes. Sizes are in bytes. ``str()`` is the text table.
#[pyclass(name = "Report", module = "gpuexp", frozen)]
#[derive(Clone)]
pub(super) struct ReportPy(pub(super) Arc<Report>);

#[pymethods]
impl ReportPy {
    /// The experiment's name (``exp-N`` when it was given none).
    #[getter]
    fn name(&self) -> &str {
        &self.0.name
    }
    /// False while the scope is open.
    #[getter]
    fn finished(&self) -> bool {
        self.0.finished
    }
    /// When the scope opened, RFC 3339 UTC.
    #[getter]
    fn started_at(&self) -> &str {
        &self.0.started_at
    }
    /// When it finished; None while open.
    #[getter]
    fn finished_at(&self) -> Option<&str> {
        self.0.finished_at.as_deref()
    }
    /// Seconds from opening to finishing (so far, while open).
    #[getter]
    fn duration_s(&self) -> f64 {
        self.0.duration_s
    }
    /// The names the teardown deleted.
    #[getter]
    fn deleted(&self) -> Vec<String> {
        self.0.names.deleted.clone()
    }
    /// Names from before the scope that it rebound to other objects (deleted too).
    #[getter]
    fn rebound(&self) -> Vec<String> {
        self.0.names.rebound.clone()
    }
    /// Names left alone: modules, ``keep()``, names the constructor cell still uses.
    #[getter]
    fn kept(&self) -> Vec<String> {
        self.0.names.kept.clone()
    }
    /// IPython's references the teardown dropped: ``Out[n]``, ``_``, the last exception, ...
    #[getter]
    fn cleared(&self) -> Vec<String> {
        self.0.names.cleared.clone()
    }
    /// Names the teardown meant to delete that are still bound, each with why.
    #[getter]
    fn not_deleted(&self) -> Vec<String> {
        self.0.names.not_deleted.clone()
    }
    /// Entries the scope made that look like IPython's (``_1``, ``__cache__``), left in place.
    #[getter]
    fn left(&self) -> Vec<String> {
        self.0.names.left.clone()
    }
    /// What the table alone would not say: a figure missing and why, memory still held, ...
    #[getter]
    fn notes(&self) -> Vec<String> {
        self.0.notes.clone()
    }
    /// Host RSS and memory.
    #[getter]
    fn host(&self) -> HostReportPy {
        let host = &self.0.host;
        HostReportPy {
            rss: (&host.rss).into(),
            available: host.available,
            total: host.total,
            cgroup_limit: host.cgroup_limit,
        }
    }
    /// One per GPU the experiment covers.
    #[getter]
    fn gpus(&self) -> Vec<GpuReportPy> {
        self.0
            .gpus
            .iter()
            .map(|g| GpuReportPy {
                torch_index: g.torch_index,
                nvml_index: g.nvml_index,
                uuid: g.uuid.clone(),
                name: g.name.clone(),
                total: g.total,
                torch_allocated: g.torch_allocated.as_ref().map(Into::into),
                torch_reserved: g.torch_reserved.as_ref().map(Into::into),
                process_used: g.process_used.as_ref().map(Into::into),
                device_used: g.device_used.as_ref().map(Into::into),
                num_ooms: g.num_ooms,
            })
            .collect()
    }
}

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
pub(super) fn report_from_json(json: &str) -> PyResult<ReportPy> {
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
        let samples = json_to_python(py, &serde_json::to_string(&self.0.monitor).expect("samples serialise"))?;
        let title = format!("gpuexp · {}", self.0.name);
        super::error::optional(py, "matplotlib", "plot()")?;
        py.import("gpuexp.monitor")?.call_method1("plot_samples", (samples, path, title))
    }
}

/// One cell of the cell log (``exp.cells``, ``gpuexp.cells()``): what it did to memory. ``str()``
/// is the compact text block, ``_repr_html_`` the HTML one.
#[pyclass(name = "CellRecord", module = "gpuexp", frozen)]
pub(super) struct CellRecordPy {
    pub(super) record: Arc<CellRecord>,
    pub(super) all_gpus: bool,
}

#[pymethods]
impl CellRecordPy {
    /// The cell's number: N in ``In [N]``.
    #[getter]
    fn execution_count(&self) -> u64 {
        self.record.execution_count
    }
    /// How long the cell ran, in seconds.
    #[getter]
    fn wall_s(&self) -> f64 {
        self.record.wall_s
    }
    /// What the block alone would not say, e.g. that torch's peak counters were reset during the cell.
    #[getter]
    fn notes(&self) -> Vec<String> {
        self.record.notes.clone()
    }
}

shown_as_table!(CellRecordPy, |this| this.record.as_ref(), this.record.grid(this.all_gpus));

/// What holds memory, largest first (``gpuexp.holders()``).
#[pyclass(name = "Holders", module = "gpuexp", frozen)]
pub(super) struct HoldersPy(pub(super) Holders);

#[pymethods]
impl HoldersPy {
    /// The paths, largest holder first.
    #[getter]
    fn paths(&self) -> Vec<String> {
        self.0.holders.iter().map(|h| h.path.clone()).collect()
    }
    fn __len__(&self) -> usize {
        self.0.holders.len()
    }
}

shown_as_table!(HoldersPy, |this| &this.0, this.0.grid("holders"));

/// What the OOM rescue shows under a CUDA out-of-memory traceback.
#[pyclass(name = "OomDiagnosis", module = "gpuexp", frozen)]
pub(super) struct OomPy(pub(super) report::OomDiagnosis);

#[pymethods]
impl OomPy {
    /// What the failed allocation asked for, in bytes; None where torch's message doesn't say.
    #[getter]
    fn requested(&self) -> Option<u64> {
        self.0.requested
    }
    /// What a person can do, from the figures: the batch that should fit, ``expandable_segments``
    /// against fragmentation, other processes to stop.
    #[getter]
    fn hints(&self) -> Vec<String> {
        self.0.hints.clone()
    }
    /// Where the training run that raised it stood ("epoch 1, step 7, batch input_ids (8, 128) int64").
    #[getter]
    fn training(&self) -> Option<String> {
        self.0.training.as_ref().map(|p| p.describe())
    }
}

shown_as_table!(OomPy, |this| &this.0, this.0.grid());

/// One reading of the host and every visible GPU (``gpuexp.snapshot()``).
#[pyclass(name = "Snapshot", module = "gpuexp", frozen)]
pub(super) struct SnapshotPy {
    pub(super) snapshot: Snapshot,
    pub(super) title: String,
}

#[pymethods]
impl SnapshotPy {
    /// What the table alone would not say: a figure missing and why.
    #[getter]
    fn notes(&self) -> Vec<String> {
        self.snapshot.notes.clone()
    }
    /// One dict per visible GPU: its identity, NVML's figures and torch's (its JSON shape).
    #[getter]
    fn gpus<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let gpus = serde_json::to_string(&self.snapshot.gpus).expect("readings serialise");
        json_to_python(py, &gpus)?.cast_into::<PyList>().map_err(Into::into)
    }
    /// The host's figures as a dict: RSS, available, total, the cgroup's limit (its JSON shape).
    #[getter]
    fn host<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        json_to_python(py, &serde_json::to_string(&self.snapshot.host).expect("readings serialise"))
    }
}

shown_as_table!(SnapshotPy, |this| &this.snapshot, report::snapshot_grid(&this.snapshot, &this.title));
