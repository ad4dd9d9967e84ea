//! Across ranks, through torch.distributed's Python API: the only code that calls it. Torch is
//! looked up in `sys.modules`, never imported; its stores are reached only through calls that
//! return at once (`check`, `get` of a present key, `multi_set`, `compare_set`). Which store a
//! rank uses, when it is opened and what a failure costs are the core's (`ranks::publishing`).

use std::sync::Arc;

use crate::fork::PerProcess;
use std::time::Duration;

use pyo3::exceptions::{PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::bindings::report::{json_to_python, ReportPy};
use crate::finder::Search;
use crate::ranks::{
    self, Distributed, GatherError, Gathered, Pending, ProcessStores, RankIdentity, RankStore, RankStores,
    StoreAddress, STORE_TIMEOUT, VALIDATE_TIMEOUT,
};
use crate::report::Report;
use crate::scope::ScopeId;
use crate::snapshot::nvml;

/// torch.distributed where torch is imported and built with it.
fn distributed(py: Python) -> Option<Bound<PyAny>> {
    let modules = py.import("sys").ok()?.getattr("modules").ok()?;
    let dist = modules.get_item("torch.distributed").ok()?;
    dist.call_method0("is_available").ok()?.extract::<bool>().ok()?.then_some(dist)
}

/// The initialised default process group: torch.distributed, rank and world size.
pub(in crate::bindings) fn process_group(py: Python) -> Option<(Bound<PyAny>, u32, u32)> {
    let dist = distributed(py)?;
    if !dist.call_method0("is_initialized").ok()?.extract::<bool>().ok()? {
        return None;
    }
    let rank = dist.call_method0("get_rank").ok()?.extract().ok()?;
    let world_size = dist.call_method0("get_world_size").ok()?.extract().ok()?;
    Some((dist, rank, world_size))
}

/// The default process group's store, which every rank of the group reaches.
fn group_store<'py>(dist: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    dist.getattr("distributed_c10d")?.call_method0("_get_default_store")
}

fn timedelta(py: Python, duration: Duration) -> PyResult<Bound<PyAny>> {
    let kwargs = PyDict::new(py);
    kwargs.set_item("seconds", duration.as_secs_f64())?;
    py.import("datetime")?.getattr("timedelta")?.call((), Some(&kwargs))
}

/// A torch.distributed store as [`RankStore`]; a clone reaches the same store.
struct PyStore(Py<PyAny>);

impl Clone for PyStore {
    fn clone(&self) -> Self {
        Python::attach(|py| PyStore(self.0.clone_ref(py)))
    }
}

impl RankStore for PyStore {
    type Error = PyErr;

    fn set_many(&mut self, entries: &[(String, String)]) -> PyResult<()> {
        let (keys, values): (Vec<&str>, Vec<&str>) = entries.iter().map(|(k, v)| (k.as_str(), v.as_str())).unzip();
        Python::attach(|py| self.0.bind(py).call_method1("multi_set", (keys, values)).map(drop))
    }
    fn present(&mut self, key: &str) -> PyResult<bool> {
        Python::attach(|py| self.0.bind(py).call_method1("check", (vec![key],))?.extract())
    }
    fn present_all(&mut self, keys: &[String]) -> PyResult<bool> {
        Python::attach(|py| self.0.bind(py).call_method1("check", (keys.to_vec(),))?.extract())
    }
    fn get(&mut self, key: &str) -> PyResult<String> {
        let raw: Vec<u8> = Python::attach(|py| self.0.bind(py).call_method1("get", (key,))?.extract())?;
        Ok(String::from_utf8_lossy(&raw).into_owned())
    }
    fn get_many(&mut self, keys: &[String]) -> PyResult<Vec<String>> {
        let raw: Vec<Vec<u8>> =
            Python::attach(|py| self.0.bind(py).call_method1("multi_get", (keys.to_vec(),))?.extract())?;
        Ok(raw.into_iter().map(|v| String::from_utf8_lossy(&v).into_owned()).collect())
    }
    fn claim(&mut self, key: &str, value: &str) -> PyResult<String> {
        let raw: Vec<u8> =
            Python::attach(|py| self.0.bind(py).call_method1("compare_set", (key, "", value))?.extract())?;
        Ok(String::from_utf8_lossy(&raw).into_owned())
    }
    fn names(&mut self) -> Vec<String> {
        let listed = Python::attach(|py| self.0.bind(py).call_method0("list_keys")?.extract::<Vec<String>>());
        listed
            .unwrap_or_default()
            .into_iter()
            .filter_map(|k| k.strip_prefix(ranks::keys::NAMES).map(String::from))
            .collect()
    }
    fn pause(&mut self, wait: Duration) -> PyResult<()> {
        Python::attach(|py| {
            py.detach(|| std::thread::sleep(wait));
            // Ctrl-C ends a long wait.
            py.check_signals()
        })
    }
}

/// This process's torch.distributed as the core's [`Distributed`].
struct PyDistributed<'py>(Python<'py>);

impl Distributed for PyDistributed<'_> {
    type Store = PyStore;
    type Error = PyErr;

    fn group(&self) -> Option<(u32, u32)> {
        process_group(self.0).map(|(_, rank, world_size)| (rank, world_size))
    }
    fn group_store(&mut self) -> PyResult<PyStore> {
        let (dist, _, _) = process_group(self.0).ok_or_else(|| PyRuntimeError::new_err("the process group is gone"))?;
        Ok(PyStore(group_store(&dist)?.unbind()))
    }
    fn available(&self) -> bool {
        distributed(self.0).is_some()
    }
    fn open(&mut self, address: &StoreAddress) -> PyResult<PyStore> {
        let dist = distributed(self.0).ok_or_else(|| PyRuntimeError::new_err("torch.distributed is not imported"))?;
        Ok(PyStore(open_named(&dist, address)?.unbind()))
    }
    fn host(&mut self, listener: std::net::TcpListener, connect: &str, port: u16) -> PyResult<PyStore> {
        let py = self.0;
        let dist = distributed(py).ok_or_else(|| PyRuntimeError::new_err("torch.distributed is not imported"))?;
        let kwargs = PyDict::new(py);
        kwargs.set_item("wait_for_workers", false)?;
        kwargs.set_item("timeout", timedelta(py, STORE_TIMEOUT)?)?;
        // torch's server would listen on every interface; given a socket, it listens where that one does.
        kwargs.set_item("master_listen_fd", std::os::fd::IntoRawFd::into_raw_fd(listener))?;
        let store = dist.getattr("TCPStore")?.call((connect, port, py.None(), true), Some(&kwargs))?;
        Ok(PyStore(store.unbind()))
    }
    fn same_store(&self, a: &PyStore, b: &PyStore) -> bool {
        a.0.is(&b.0)
    }
    /// Ctrl-C (or another exception that is no `Exception`): never swallowed with a store's errors.
    fn is_interrupt(&self, error: &PyErr) -> bool {
        !error.is_instance_of::<pyo3::exceptions::PyException>(self.0)
    }
    /// A store's error as a note quotes it: its message, after its class where that says more
    /// than RuntimeError (which our own errors about the store are too, so a note would read
    /// "RuntimeError: RuntimeError: ...").
    fn said(&self, error: &PyErr) -> String {
        let py = self.0;
        let message = error.value(py).str().map(|m| m.to_string()).unwrap_or_default();
        if error.get_type(py).is(py.get_type::<PyRuntimeError>()) {
            return message;
        }
        let kind = error.get_type(py).name().map(|n| n.to_string()).unwrap_or_default();
        format!("{kind}: {message}")
    }
    fn failure(&self, message: String) -> PyErr {
        PyRuntimeError::new_err(message)
    }
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
}

/// The stores this process opened or hosts, its run token and its searches agreed.
static STORES: PerProcess<ProcessStores<PyStore>> = PerProcess::new(ProcessStores::new);

fn rank_stores(py: Python<'_>) -> RankStores<'static, PyDistributed<'_>> {
    RankStores { world: PyDistributed(py), stores: &STORES }
}

fn open_named<'py>(dist: &Bound<'py, PyAny>, address: &StoreAddress) -> PyResult<Bound<'py, PyAny>> {
    let py = dist.py();
    // torch's FileStore retries opening a file in a missing directory for 300 s; its TCPStore
    // client retries a refused connection, and waits on one that never answers, until its
    // timeout: the core's check tells a store that is gone, or none at all, from a busy one.
    interruptible(py, ranks::check_before_opening(address))?.map_err(PyRuntimeError::new_err)?;
    let store = match address {
        StoreAddress::Directory(_) => {
            let file = address.file().expect("a directory has a file");
            dist.getattr("FileStore")?.call1((file.to_string_lossy().as_ref(), -1))?
        }
        StoreAddress::Tcp { host, port } => {
            let kwargs = PyDict::new(py);
            kwargs.set_item("wait_for_workers", false)?;
            kwargs.set_item("timeout", timedelta(py, VALIDATE_TIMEOUT)?)?;
            dist.getattr("TCPStore")?.call((host.as_str(), *port, py.None(), false), Some(&kwargs))?
        }
    };
    store.call_method1("set_timeout", (timedelta(py, STORE_TIMEOUT)?,))?;
    Ok(store)
}

/// Runs `check` on a thread of its own ([`Pending`]) with the GIL released, and raises Ctrl-C as
/// soon as it comes.
fn interruptible<T: Send + 'static>(py: Python, check: impl FnOnce() -> T + Send + 'static) -> PyResult<T> {
    let pending = Pending::start(check).map_err(PyRuntimeError::new_err)?;
    loop {
        match py.detach(|| pending.wait(Duration::from_millis(50))).map_err(PyRuntimeError::new_err)? {
            Some(value) => return Ok(value),
            None => py.check_signals()?,
        }
    }
}

pub(in crate::bindings) fn identity(group: Option<&(Bound<PyAny>, u32, u32)>) -> RankIdentity {
    RankIdentity::detect(group.map(|(_, r, w)| (*r, *w)), |name| std::env::var(name).ok())
}

/// When a rank opens a scope: the run token is claimed and the store opened now, while every
/// rank is up. Called before the opening holds interrupts: a store may wait, and Ctrl-C must
/// reach it. Only Ctrl-C is raised.
pub(in crate::bindings) fn prepare_publishing(py: Python) -> PyResult<()> {
    rank_stores(py).prepare()
}

/// At finish, inside the teardown: names the descendants still holding GPU memory and, in a
/// rank, stamps the report with the rank's identity. No store is reached here.
pub(in crate::bindings) fn complete_report(py: Python, report: &mut Report) {
    report.child_processes = nvml::still_holding(report.gpus.iter().map(|g| (g.torch_index, g.uuid.as_str())));
    report.rank = identity(process_group(py).as_ref());
}

/// Once the teardown is done and the held interrupt given back: publishes a rank's finished
/// report; the notes of what failed are returned for the report.
pub(in crate::bindings) fn publish_report(py: Python, scope: ScopeId, report: &Report) -> Vec<String> {
    let error = ranks::take_error(scope);
    rank_stores(py).publish(report, error)
}

/// The exception that ended an experiment's `with` block: it goes into the published record.
#[pyfunction]
pub(in crate::bindings) fn note_scope_error(id: ScopeId, error: &Bound<PyAny>) -> PyResult<()> {
    ranks::note_error(id, &error.get_type().name()?.to_string(), &error.str()?.to_string());
    Ok(())
}

/// What the last publish took (identity, run token, both stores), for the bench: wall and
/// CPU seconds.
#[pyfunction]
pub(in crate::bindings) fn last_publish_s(py: Python) -> Option<(f64, f64)> {
    rank_stores(py).last_publish()
}

/// `gpuexp.ranks()`: every rank's latest report of an experiment, from the store
/// `GPUEXP_RANKS_STORE` names (the kernel's own), or in a rank without one, its group's.
#[pyfunction]
#[pyo3(name = "ranks", signature = (name=None, timeout=10.0))]
pub(in crate::bindings) fn gather_ranks(py: Python, name: Option<String>, timeout: f64) -> PyResult<RanksPy> {
    let timeout = Duration::try_from_secs_f64(timeout).map_err(|_| {
        PyValueError::new_err(format!("timeout must be a number of seconds, e.g. timeout=10; got {timeout}"))
    })?;
    match rank_stores(py).gather(name.as_deref(), timeout) {
        Ok(gathered) => Ok(RanksPy(gathered)),
        Err(GatherError::Store(e)) => Err(e),
        Err(GatherError::NothingPublished(why)) => Err(PyTimeoutError::new_err(why)),
    }
}

/// This kernel's private store directory for the ranks it launches, as `file://…`.
#[pyfunction]
pub(in crate::bindings) fn kernel_ranks_store() -> PyResult<String> {
    let dir = ranks::kernel_store_dir()?;
    Ok(StoreAddress::Directory(dir).to_string())
}

#[pyfunction]
pub(in crate::bindings) fn remove_kernel_ranks_store() {
    ranks::remove_kernel_store_dir();
}

/// Hosts a TCPStore in this process, listening on `address` only (loopback by default);
/// returns its address as `tcp://host:port`.
#[pyfunction]
#[pyo3(signature = (address="127.0.0.1", port=0))]
pub(in crate::bindings) fn host_ranks_store(py: Python, address: &str, port: u16) -> PyResult<String> {
    rank_stores(py).host(address, port)
}

/// In a rank of an initialised process group: waits for every rank's answer and takes the
/// largest size that fits on every rank. Returns whether there was a group to agree with.
pub(in crate::bindings) fn agree_across_ranks(py: Python, search: &mut Search, timeout: f64) -> PyResult<bool> {
    let Some(agreement) = rank_stores(py).agree(search.batch_size, timeout)? else { return Ok(false) };
    search.take_agreement(agreement);
    Ok(true)
}

// ---- the gathered table ----------------------------------------------------------------------

/// Every rank's latest report of one experiment (``gpuexp.ranks()``): ``str()`` and
/// ``_repr_html_`` show the table, outliers flagged.
#[pyclass(name = "Ranks", module = "gpuexp", frozen)]
pub(in crate::bindings) struct RanksPy(Gathered);

#[pymethods]
impl RanksPy {
    /// The experiment's name.
    #[getter]
    fn name(&self) -> &str {
        &self.0.name
    }
    /// How many ranks the run has.
    #[getter]
    fn world_size(&self) -> u32 {
        self.0.world_size
    }
    /// One report per rank, in rank order; None for a rank that never reported.
    #[getter]
    fn reports(&self) -> Vec<Option<ReportPy>> {
        self.0.reports.iter().map(|r| r.as_ref().map(|r| ReportPy(Arc::new(r.clone())))).collect()
    }
    /// The ranks that never reported.
    #[getter]
    fn missing(&self) -> Vec<u32> {
        self.0.missing()
    }
    /// The outliers in words: ranks missing, a rank that ran out of memory or raised, one that
    /// peaked more than 10% over the median.
    #[getter]
    fn flags(&self) -> Vec<String> {
        self.0.flags().to_vec()
    }
    /// The exception that ended each rank's experiment (None where none did), in rank order.
    #[getter]
    fn errors(&self) -> Vec<Option<String>> {
        self.0.errors.clone()
    }
    /// One row per rank, indexed by rank, sizes in bytes: a pandas DataFrame.
    fn to_pandas<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let pandas = crate::bindings::error::optional(py, "pandas", "to_pandas()")?;
        let rows = json_to_python(py, &serde_json::to_string(&self.0.rows).expect("rows serialise"))?;
        pandas.call_method1("DataFrame", (rows,))?.call_method1("set_index", ("rank",))
    }
}

shown_as_table!(RanksPy, |this| &this.0, this.0.grid());

/// What a report says about its rank and its children.
#[pymethods]
impl ReportPy {
    /// In a rank of a distributed run, its rank; None outside one (so for the three below).
    #[getter]
    fn rank(&self) -> Option<u32> {
        self.0.rank.rank
    }
    /// The rank's index on its host (``LOCAL_RANK``).
    #[getter]
    fn local_rank(&self) -> Option<u32> {
        self.0.rank.local_rank
    }
    /// How many ranks the run has.
    #[getter]
    fn world_size(&self) -> Option<u32> {
        self.0.rank.world_size
    }
    /// The host the rank ran on.
    #[getter]
    fn hostname(&self) -> Option<&str> {
        self.0.rank.hostname.as_deref()
    }
    /// Descendants still holding GPU memory at finish, as dicts: pid, command, torch_index, used.
    #[getter]
    fn child_processes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        json_to_python(py, &serde_json::to_string(&self.0.child_processes).expect("processes serialise"))
    }
}
