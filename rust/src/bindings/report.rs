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
            fn to_json(&self) -> String {
                let $this = self;
                serde_json::to_string_pretty($value).expect("what gpuexp shows always serialises")
            }
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

#[pyclass(name = "Metric", module = "gpuexp", frozen, get_all)]
#[derive(Clone)]
pub(super) struct MetricPy {
    pub(super) start: u64,
    pub(super) before_teardown: u64,
    pub(super) end: Option<u64>,
    pub(super) peak: u64,
    pub(super) consumed: i64,
    pub(super) reclaimed: Option<i64>,
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

#[pyclass(name = "HostReport", module = "gpuexp", frozen, get_all)]
#[derive(Clone)]
pub(super) struct HostReportPy {
    pub(super) rss: MetricPy,
    pub(super) available: u64,
    pub(super) total: u64,
    pub(super) cgroup_limit: Option<u64>,
}

#[pyclass(name = "GpuReport", module = "gpuexp", frozen, get_all)]
#[derive(Clone)]
pub(super) struct GpuReportPy {
    pub(super) torch_index: u32,
    pub(super) nvml_index: u32,
    pub(super) uuid: String,
    pub(super) name: String,
    pub(super) total: u64,
    pub(super) torch_allocated: Option<MetricPy>,
    pub(super) torch_reserved: Option<MetricPy>,
    pub(super) process_used: Option<MetricPy>,
    pub(super) device_used: Option<MetricPy>,
    pub(super) num_ooms: Option<u64>,
}

/// What an experiment consumed, reclaimed and peaked at. `str()` is the text table.
#[pyclass(name = "Report", module = "gpuexp", frozen)]
#[derive(Clone)]
pub(super) struct ReportPy(pub(super) Arc<Report>);

#[pymethods]
impl ReportPy {
    #[getter]
    fn name(&self) -> &str {
        &self.0.name
    }
    #[getter]
    fn finished(&self) -> bool {
        self.0.finished
    }
    #[getter]
    fn started_at(&self) -> &str {
        &self.0.started_at
    }
    #[getter]
    fn finished_at(&self) -> Option<&str> {
        self.0.finished_at.as_deref()
    }
    #[getter]
    fn duration_s(&self) -> f64 {
        self.0.duration_s
    }
    #[getter]
    fn deleted(&self) -> Vec<String> {
        self.0.names.deleted.clone()
    }
    #[getter]
    fn rebound(&self) -> Vec<String> {
        self.0.names.rebound.clone()
    }
    #[getter]
    fn kept(&self) -> Vec<String> {
        self.0.names.kept.clone()
    }
    #[getter]
    fn cleared(&self) -> Vec<String> {
        self.0.names.cleared.clone()
    }
    #[getter]
    fn not_deleted(&self) -> Vec<String> {
        self.0.names.not_deleted.clone()
    }
    #[getter]
    fn left(&self) -> Vec<String> {
        self.0.names.left.clone()
    }
    #[getter]
    fn notes(&self) -> Vec<String> {
        self.0.notes.clone()
    }
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
    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyAny>, (String,))> {
        let json = serde_json::to_string(self.0.as_ref()).expect("reports serialise");
        Ok((py.import("gpuexp._core")?.getattr("report_from_json")?, (json,)))
    }
    fn __copy__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }
    fn __deepcopy__<'py>(slf: PyRef<'py, Self>, _memo: Bound<'py, PyAny>) -> PyRef<'py, Self> {
        slf
    }
}

/// A report from the JSON of a pickled one.
#[pyfunction]
pub(super) fn report_from_json(json: &str) -> PyResult<ReportPy> {
    serde_json::from_str(json)
        .map(|report| ReportPy(Arc::new(report)))
        .map_err(|e| PyValueError::new_err(format!("not the JSON of a gpuexp report: {e}")))
}

#[pymethods]
impl ReportPy {
    /// The timeline of the experiment's monitor (`monitor=True`) as one figure; saved to `path` when given.
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

/// What one cell did to memory: `str()` is the compact text block, `_repr_html_` the HTML one.
#[pyclass(name = "CellRecord", module = "gpuexp", frozen)]
pub(super) struct CellRecordPy {
    pub(super) record: Arc<CellRecord>,
    pub(super) all_gpus: bool,
}

#[pymethods]
impl CellRecordPy {
    #[getter]
    fn execution_count(&self) -> u64 {
        self.record.execution_count
    }
    #[getter]
    fn wall_s(&self) -> f64 {
        self.record.wall_s
    }
    #[getter]
    fn notes(&self) -> Vec<String> {
        self.record.notes.clone()
    }
}

shown_as_table!(CellRecordPy, |this| this.record.as_ref(), this.record.grid(this.all_gpus));

/// What holds memory: the result of `gpuexp.holders()`.
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

/// The diagnosis shown under a CUDA out-of-memory traceback.
#[pyclass(name = "OomDiagnosis", module = "gpuexp", frozen)]
pub(super) struct OomPy(pub(super) report::OomDiagnosis);

#[pymethods]
impl OomPy {
    #[getter]
    fn requested(&self) -> Option<u64> {
        self.0.requested
    }
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

/// The state of the host and the visible GPUs at one moment.
#[pyclass(name = "Snapshot", module = "gpuexp", frozen)]
pub(super) struct SnapshotPy {
    pub(super) snapshot: Snapshot,
    pub(super) title: String,
}

#[pymethods]
impl SnapshotPy {
    #[getter]
    fn notes(&self) -> Vec<String> {
        self.snapshot.notes.clone()
    }
    #[getter]
    fn gpus<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let gpus = serde_json::to_string(&self.snapshot.gpus).expect("readings serialise");
        json_to_python(py, &gpus)?.cast_into::<PyList>().map_err(Into::into)
    }
    #[getter]
    fn host<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        json_to_python(py, &serde_json::to_string(&self.snapshot.host).expect("readings serialise"))
    }
}

shown_as_table!(SnapshotPy, |this| &this.snapshot, report::snapshot_grid(&this.snapshot, &this.title));
