//! Where in the code, from Python: a traced experiment's findings (`report.trace`), diffs of two
//! of them, the timeline, and torch snapshot files written and read (`save_snapshot`,
//! `gpuexp.load_snapshot`). The engine is `crate::trace`; only torch's snapshot and IPython's
//! names for cells are reached through Python here.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use pyo3::exceptions::{PyException, PyOSError, PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::bindings::interrupts::Interruptible;
use crate::bindings::report::{json_to_python, ReportPy};
use crate::bindings::trace_recording::{self, TraceWindow};
use crate::kept_snapshots;
use crate::report::{Params, Report};
use crate::trace::{
    self, AllocationHistory, Attribution, CellPeakSite, DeviceTrace, HolderStorages, SiteNamer, SiteRule,
};

/// A line's label (None: not a notebook cell) and its source text.
type Named = (Option<String>, Option<String>);

/// Names sites as a person reads them: a notebook cell's line as `In [12], line 4` (through
/// `gpuexp.ipython.source_line`), a file's as `path:line` relative to the working directory.
pub(in crate::bindings) struct PyNamer<'py> {
    source_line: Option<Bound<'py, PyAny>>,
    cwd: Option<PathBuf>,
    seen: RefCell<HashMap<(String, u32), Named>>,
    /// A KeyboardInterrupt (or any exception that is not an `Exception`) raised while a line
    /// was named: kept for the caller to raise once the work ends, never dropped.
    interrupted: RefCell<Option<PyErr>>,
}

impl<'py> PyNamer<'py> {
    pub(in crate::bindings) fn new(py: Python<'py>) -> PyNamer<'py> {
        let source_line = py.import("gpuexp.ipython").and_then(|m| m.getattr("source_line")).ok();
        PyNamer {
            source_line,
            cwd: std::env::current_dir().ok(),
            seen: RefCell::default(),
            interrupted: RefCell::default(),
        }
    }

    /// The interrupt that came while naming, to raise now.
    pub(in crate::bindings) fn interrupted(&self) -> Option<PyErr> {
        self.interrupted.borrow_mut().take()
    }

    fn lookup(&self, filename: &str, line: u32) -> Named {
        let key = (filename.to_string(), line);
        if let Some(found) = self.seen.borrow().get(&key) {
            return found.clone();
        }
        let source_line = self.source_line.as_ref().filter(|_| self.interrupted.borrow().is_none());
        let called = source_line.and_then(|f| match f.call1((filename, line)) {
            Ok(found) => found.extract::<(Option<String>, String)>().ok(),
            Err(error) => {
                // An ordinary error leaves the line unnamed; an interrupt is the user's, kept.
                if !error.is_instance_of::<PyException>(f.py()) {
                    *self.interrupted.borrow_mut() = Some(error);
                }
                None
            }
        });
        let found = called.map(|(label, text)| (label, (!text.is_empty()).then_some(text))).unwrap_or_default();
        self.seen.borrow_mut().insert(key, found.clone());
        found
    }
}

impl SiteNamer for PyNamer<'_> {
    fn label(&self, filename: &str, line: u32) -> String {
        self.lookup(filename, line).0.unwrap_or_else(|| {
            let path = std::path::Path::new(filename);
            let shown = self.cwd.as_ref().and_then(|cwd| path.strip_prefix(cwd).ok()).unwrap_or(path);
            format!("{}:{line}", shown.display())
        })
    }

    fn source(&self, filename: &str, line: u32) -> Option<String> {
        self.lookup(filename, line).1
    }
}

/// Reads a snapshot pickle (with the GIL released) and hands it to `find` with an attribution
/// that names sites as the user reads them.
fn attributed<T>(py: Python, pickle: &[u8], find: impl FnOnce(&AllocationHistory, &Attribution) -> T) -> PyResult<T> {
    let snapshot = py.detach(|| AllocationHistory::from_pickle(pickle))?;
    attributed_snapshot(py, &snapshot, &mut || Ok(()), |snapshot, attribution, _| find(snapshot, attribution))
}

/// `find` over a snapshot read already, with a `keep_going` that asks the caller's and stops
/// once a site's naming was interrupted; an interrupt that came while a site was named is
/// raised once it is done.
fn attributed_snapshot<T>(
    py: Python,
    snapshot: &AllocationHistory,
    keep_going: &mut dyn FnMut() -> crate::error::Result<()>,
    find: impl FnOnce(&AllocationHistory, &Attribution, &mut dyn FnMut() -> crate::error::Result<()>) -> T,
) -> PyResult<T> {
    let namer = PyNamer::new(py);
    let rule = SiteRule::default();
    let mut named_or_asked = || {
        if namer.interrupted.borrow().is_some() {
            return Err(crate::error::Error::Interrupted);
        }
        keep_going()
    };
    let found = find(snapshot, &Attribution::new(&snapshot.stacks, &rule, &namer), &mut named_or_asked);
    match namer.interrupted() {
        Some(interrupt) => Err(interrupt),
        None => Ok(found),
    }
}

/// The core's findings for `devices` from a snapshot, from `since_us` on (None: from
/// the opening of the experiment the file was saved for, where gpuexp saved it, else all of it).
/// `keep_going` is asked every so many events and blocks; its error stops the analysis.
fn analyse(
    py: Python,
    snapshot: &AllocationHistory,
    devices: Option<&[u32]>,
    max_entries: Option<u64>,
    since_us: Option<i64>,
    keep_going: &mut dyn FnMut() -> crate::error::Result<()>,
) -> PyResult<crate::error::Result<Vec<DeviceTrace>>> {
    attributed_snapshot(py, snapshot, keep_going, |snapshot, attribution, keep_going| {
        trace::snapshot_traces(snapshot, devices, max_entries, since_us, attribution, keep_going)
    })
}

/// The top site of each GPU in `moved` (torch index, how far its torch peak rose) of a cell
/// that began at `since_us`, from torch's history now.
pub(in crate::bindings) fn cell_peak_sites(
    py: Python,
    moved: &[(u32, u64)],
    max_entries: Option<u64>,
    since_us: i64,
) -> Result<Vec<CellPeakSite>, String> {
    let pickle = trace_recording::snapshot_pickle(py, None)?;
    let max_entries = max_entries.and_then(|m| usize::try_from(m).ok());
    attributed(py, &pickle, |snapshot, attribution| {
        trace::cell_peak_sites(snapshot, moved, max_entries, since_us, attribution)
    })
    .map_err(|e| e.to_string())
}

/// The out-of-memory error just raised on `torch_index`, in torch's allocation history where
/// one is being recorded (the flight recorder's, a traced experiment's, the cell log's or the
/// user's own): what grew since `step`, and the failed line and the sites live then where the
/// record has stacks, else the live blocks by size. The latest OOM recorded is taken only when
/// it matches what torch's message says was asked (`requested`): an older one (this one not
/// recorded) would name the wrong line.
pub(in crate::bindings) fn last_oom(
    py: Python,
    torch_index: u32,
    requested: Option<u64>,
    step: Option<crate::recorder::StepEnd>,
) -> Option<crate::recorder::OomRecord> {
    if !trace_recording::history_enabled(&crate::bindings::torch::PyTorch::find(py)) {
        return None;
    }
    let pickle = trace_recording::snapshot_pickle(py, None).ok()?;
    attributed(py, &pickle, |snapshot, attribution| {
        let replayed = trace::replay(snapshot, torch_index as usize, None);
        crate::recorder::read_oom(snapshot, &replayed, requested, step, attribution)
    })
    .ok()
    .flatten()
}

/// The blocks torch's allocator holds on `torch_index` now, from a snapshot of its state (the
/// recorder's view once it has given the history back).
pub(in crate::bindings) fn live_in_state(py: Python, torch_index: u32) -> Option<crate::recorder::LiveBlocks> {
    let pickle = trace_recording::snapshot_pickle(py, None).ok()?;
    let snapshot = py.detach(|| AllocationHistory::from_pickle(&pickle)).ok()?;
    Some(crate::recorder::live_in_state(&snapshot, torch_index as usize))
}

/// Reads the trace of a finishing scope into its report, each block still held matched to the
/// leak hunter's holder of it (`storages`); the recording then ends where this was its last
/// traced scope.
pub(in crate::bindings) fn complete_report(
    py: Python,
    window: TraceWindow,
    report: &mut Report,
    storages: &[HolderStorages],
) {
    if let Some(why) = &window.unavailable {
        report.notes.push(why.clone());
        return;
    }
    let devices = report.traced_devices();
    let key = report.trace_window(window.opened_us, window.max_entries, &devices);
    let read =
        trace_recording::snapshot_pickle(py, Some(&key)).map_err(PyErr::new::<PyValueError, _>).and_then(|pickle| {
            let snapshot = py.detach(|| AllocationHistory::from_pickle(&pickle))?;
            let traces =
                analyse(py, &snapshot, Some(&devices), window.max_entries, Some(window.opened_us), &mut || Ok(()))??;
            Ok((pickle, traces))
        });
    match read {
        Ok((pickle, mut traces)) => {
            trace::name_holders(&mut traces, storages);
            report.trace = traces;
            kept_snapshots::keep(report, pickle);
        }
        Err(e) => report.notes.push(format!("trace: reading torch's allocation history failed: {e}")),
    }
    crate::bindings::trace_sampling::end(py);
    if let Some(note) = trace_recording::close(py) {
        report.notes.push(note);
    }
}

/// Where in the code one traced experiment (``report.trace``) or a snapshot file
/// (``gpuexp.load_snapshot``) peaked: each GPU's live memory at its peak, grouped by the line of
/// code that allocated it. ``str()`` is the text tables, ``_repr_html_`` the HTML ones.
#[pyclass(name = "Trace", module = "gpuexp", frozen)]
pub(in crate::bindings) struct TracePy {
    name: String,
    params: Params,
    devices: Vec<DeviceTrace>,
    pickle: Option<Arc<Vec<u8>>>,
}

impl TracePy {
    pub(in crate::bindings) fn of_report(report: &Report) -> Option<TracePy> {
        (!report.trace.is_empty()).then(|| TracePy {
            name: report.name.clone(),
            params: report.params.clone(),
            devices: report.trace.clone(),
            pickle: kept_snapshots::kept(report),
        })
    }
}

#[pymethods]
impl TracePy {
    fn __str__(&self) -> String {
        if self.devices.is_empty() {
            return format!("{}: {}", self.name, trace::file::NO_HISTORY);
        }
        self.devices.iter().map(|d| d.peak.to_text()).collect::<Vec<_>>().join("\n\n")
    }

    fn __repr__(&self) -> String {
        self.__str__()
    }

    /// The tables as HTML, which Jupyter shows.
    fn _repr_html_(&self) -> String {
        if self.devices.is_empty() {
            return format!("<p>{}</p>", crate::grid::escape(&self.__str__()));
        }
        self.devices.iter().map(|d| d.peak.to_html()).collect()
    }

    /// One entry per GPU as JSON text: its peak by site (each with its stack), its timeline, the
    /// blocks still held at the end and the out-of-memory errors (the first 100; ``ooms_not_analysed``
    /// counts the others). A file with no GPU gives an object that says so: ``{"devices": [], "note": ...}``.
    fn to_json(&self) -> String {
        if self.devices.is_empty() {
            let empty = serde_json::json!({"devices": [], "note": trace::file::NO_HISTORY});
            return serde_json::to_string_pretty(&empty).expect("plain data serialises");
        }
        serde_json::to_string_pretty(&self.devices).expect("plain data serialises")
    }

    /// The same data as lists, dicts, numbers and strings: ``json.loads(self.to_json())``.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        json_to_python(py, &self.to_json())
    }

    /// Why this trace peaks higher (or lower) than ``other``'s (a traced Report or a Trace), by
    /// site, sorted by growth.
    fn diff(&self, other: &Bound<PyAny>) -> PyResult<SiteDiffPy> {
        self.diff_from(&trace_of(other)?)
    }

    /// Torch allocated over time stacked by the top sites, the peak marked: inline SVG in
    /// Jupyter; ``.figure()`` draws it with matplotlib.
    fn plot_timeline(&self) -> TimelinePy {
        TimelinePy { name: self.name.clone(), devices: self.devices.clone() }
    }

    /// Writes torch's snapshot in its own pickle format, which memory_viz and Mosaic open; the
    /// file is replaced atomically.
    fn save_snapshot(&self, py: Python, #[pyo3(from_py_with = snapshot_path)] path: PathBuf) -> PyResult<()> {
        let pickle = self.pickle.clone().ok_or_else(|| {
            PyValueError::new_err("this trace keeps no snapshot (only the latest traced reports keep theirs)")
        })?;
        py.detach(|| crate::files::write_atomically(&path, &pickle))
            .map_err(|e| PyOSError::new_err(format!("save_snapshot({}): {e}", path.display())))
    }
}

/// `save_snapshot`'s path, as `save_history` takes one: a str or an os.PathLike.
fn snapshot_path(path: &Bound<PyAny>) -> PyResult<PathBuf> {
    path.extract().map_err(|_| {
        let given = path.repr().map(|r| r.to_string()).unwrap_or_else(|_| "?".into());
        PyTypeError::new_err(format!(
            "save_snapshot() takes a file path (a str or os.PathLike), e.g. save_snapshot('peak.pickle'); got {given}"
        ))
    })
}

impl TracePy {
    fn diff_from(&self, other: &TracePy) -> PyResult<SiteDiffPy> {
        let (Some(mine), Some(theirs)) = (self.devices.first(), other.devices.first()) else {
            return Err(PyValueError::new_err("a trace with no GPU can't be compared"));
        };
        let theirs = other.devices.iter().find(|d| d.torch_index == mine.torch_index).unwrap_or(theirs);
        Ok(SiteDiffPy(trace::diff(&theirs.peak, &mine.peak, &other.params, &self.params)))
    }
}

/// `b.diff(a)` of two traced reports.
pub(in crate::bindings) fn diff_reports(b: &Report, a: &Report) -> PyResult<SiteDiffPy> {
    let traced = |report: &Report| TracePy::of_report(report).ok_or_else(|| PyValueError::new_err("not traced"));
    traced(b)?.diff_from(&traced(a)?)
}

fn trace_of(value: &Bound<PyAny>) -> PyResult<TracePy> {
    if let Ok(trace) = value.cast::<TracePy>() {
        let t = trace.get();
        return Ok(TracePy {
            name: t.name.clone(),
            params: t.params.clone(),
            devices: t.devices.clone(),
            pickle: t.pickle.clone(),
        });
    }
    if let Ok(report) = value.cast::<ReportPy>() {
        let report = report.get();
        return TracePy::of_report(&report.0).ok_or_else(|| {
            PyValueError::new_err(format!(
                "experiment {:?} was not traced: open it with GPUExperiment(..., trace=True)",
                report.0.name
            ))
        });
    }
    Err(PyValueError::new_err(format!(
        "diff() takes a traced Report or a Trace (gpuexp.load_snapshot(path)); got {}",
        value.get_type().name()?
    )))
}

/// ``b.diff(a)``: the difference in peak between two traces, attributed to sites, sorted by
/// growth. ``str()`` is the table.
#[pyclass(name = "SiteDiff", module = "gpuexp", frozen)]
pub(in crate::bindings) struct SiteDiffPy(trace::SiteDiff);

#[pymethods]
impl SiteDiffPy {
    fn __str__(&self) -> String {
        self.0.to_text()
    }
    fn __repr__(&self) -> String {
        self.0.to_text()
    }
    /// The table as HTML, which Jupyter shows.
    fn _repr_html_(&self) -> String {
        self.0.to_html()
    }
    /// The two peaks, the param that changed, and each site's bytes in both with its growth, as
    /// dicts, lists, numbers and strings.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        json_to_python(py, &self.0.to_json().to_string())
    }
}

/// Torch allocated over a traced experiment, stacked by its top sites: inline SVG in Jupyter (no
/// script, nothing fetched); ``.figure()`` is a matplotlib Figure of the same data.
#[pyclass(name = "Timeline", module = "gpuexp", frozen)]
pub(in crate::bindings) struct TimelinePy {
    name: String,
    devices: Vec<DeviceTrace>,
}

#[pymethods]
impl TimelinePy {
    /// The timeline as inline SVG, which Jupyter shows.
    fn _repr_html_(&self) -> String {
        self.devices.iter().map(|d| d.timeline.to_svg()).collect()
    }
    fn __repr__(&self) -> String {
        let peaks: Vec<String> = self
            .devices
            .iter()
            .map(|d| format!("cuda:{} peak {}", d.torch_index, crate::units::bytes(d.peak.peak.bytes)))
            .collect();
        format!("<Timeline of {:?}: {}>", self.name, peaks.join(", "))
    }
    /// One entry per GPU as dicts, lists and numbers: the points' times, the total and each top
    /// site's series, stacked bottom to top, and the peak.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let data: Vec<serde_json::Value> = self.devices.iter().map(|d| d.timeline.to_json()).collect();
        json_to_python(py, &serde_json::Value::Array(data).to_string())
    }
    /// The timeline as a matplotlib Figure, saved to ``path`` when given.
    #[pyo3(signature = (path=None))]
    fn figure<'py>(&self, py: Python<'py>, path: Option<Bound<'py, PyAny>>) -> PyResult<Bound<'py, PyAny>> {
        let data = self.to_dict(py)?;
        py.import("gpuexp.timeline")?.call_method1("figure", (data, format!("gpuexp · {}", self.name), path))
    }
}

/// Any torch memory snapshot (a cluster job's OOM dump, memory_viz's file), read and replayed:
/// the same peak tables, diff and timeline as a traced experiment. ``gpuexp.load_snapshot``
/// checks the path first. Only a regular file is read, without waiting on it (a FIFO or a device
/// is refused); Ctrl-C stops the read and the parse, which run with the GIL released, and the
/// analysis, which holds it.
#[pyfunction]
pub(in crate::bindings) fn load_snapshot(py: Python, path: PathBuf) -> PyResult<TracePy> {
    let mut interrupts = Interruptible::new();
    let read = py.detach(|| trace::file::read(&path, &mut || interrupts.check()));
    let (pickle, snapshot) = read.map_err(|e| interrupts.error(e))?;
    let devices = analyse(py, &snapshot, None, None, None, &mut || interrupts.check())?;
    let devices = devices.map_err(|e| interrupts.error(e))?;
    trace::file::refuse_impossible_peaks(&devices)?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    Ok(TracePy { name, params: Params::default(), devices, pickle: Some(Arc::new(pickle)) })
}

#[pymethods]
impl ReportPy {
    /// With ``trace=True``: where in the code each GPU peaked; None otherwise.
    #[getter]
    fn trace(&self) -> Option<TracePy> {
        TracePy::of_report(&self.0)
    }

    /// Why this experiment peaks higher (or lower) than ``other`` (a traced Report or a Trace),
    /// by site, sorted by growth, each site's growth related to the params that changed.
    fn diff(&self, other: &Bound<PyAny>) -> PyResult<SiteDiffPy> {
        self.traced()?.diff(other)
    }

    /// Torch allocated over the experiment, stacked by its top sites (``trace=True``).
    fn plot_timeline(&self) -> PyResult<TimelinePy> {
        Ok(self.traced()?.plot_timeline())
    }

    /// Writes the experiment's torch snapshot (``trace=True``) for memory_viz and Mosaic; the file
    /// is replaced atomically.
    fn save_snapshot(&self, py: Python, #[pyo3(from_py_with = snapshot_path)] path: PathBuf) -> PyResult<()> {
        self.traced()?.save_snapshot(py, path)
    }
}

impl ReportPy {
    fn traced(&self) -> PyResult<TracePy> {
        TracePy::of_report(&self.0).ok_or_else(|| {
            PyValueError::new_err(format!(
                "experiment {:?} was not traced: open it with GPUExperiment(..., trace=True), or turn the trace on \
                 for every experiment with gpuexp.config(trace=True)",
                self.0.name
            ))
        })
    }
}
