//! Across ranks, through torch.distributed's Python API: the only code that calls it. Torch is
//! looked up in `sys.modules`, never imported; its stores are reached only through calls that
//! return at once (`check`, `get` of a present key, `multi_set`, `compare_set`).

use std::time::{Duration, Instant};

use std::sync::{Arc, Mutex};

use pyo3::exceptions::{PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::report::{json_to_python, ReportPy};
use crate::finder::Search;
use crate::fork::PerProcess;
use crate::locks::lock;
use crate::ranks::{self, GatherError, Gathered, RankIdentity, RankStore, StoreAddress, STORE_ENV};
use crate::report::Report;
use crate::scope::ScopeId;
use crate::snapshot::nvml;

/// How long a store operation may wait for the store's lock or connection.
const STORE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a rank tries to reach a TCPStore's port: one that is gone (a kernel restarted)
/// refuses at once, and is not tried again in that process.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a TCPStore has to answer gpuexp's ping: a loaded server answers in milliseconds;
/// a listener that is no TCPStore never does.
const PING_TIMEOUT: Duration = Duration::from_secs(5);
/// How long torch's client then has to connect and be validated: 64 ranks opening at once on
/// a loaded 2-core box took more than 3 s.
const VALIDATE_TIMEOUT: Duration = Duration::from_secs(60);

/// torch.distributed where torch is imported and built with it.
fn distributed(py: Python) -> Option<Bound<PyAny>> {
    let modules = py.import("sys").ok()?.getattr("modules").ok()?;
    let dist = modules.get_item("torch.distributed").ok()?;
    dist.call_method0("is_available").ok()?.extract::<bool>().ok()?.then_some(dist)
}

/// The initialised default process group: torch.distributed, rank and world size.
pub(super) fn process_group(py: Python) -> Option<(Bound<PyAny>, u32, u32)> {
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

/// A torch.distributed store as [`RankStore`].
struct PyStore<'py>(Bound<'py, PyAny>);

impl RankStore for PyStore<'_> {
    type Error = PyErr;

    fn set_many(&mut self, entries: &[(String, String)]) -> PyResult<()> {
        let (keys, values): (Vec<&str>, Vec<&str>) = entries.iter().map(|(k, v)| (k.as_str(), v.as_str())).unzip();
        self.0.call_method1("multi_set", (keys, values)).map(drop)
    }
    fn present(&mut self, key: &str) -> PyResult<bool> {
        self.0.call_method1("check", (vec![key],))?.extract()
    }
    fn present_all(&mut self, keys: &[String]) -> PyResult<bool> {
        self.0.call_method1("check", (keys.to_vec(),))?.extract()
    }
    fn get(&mut self, key: &str) -> PyResult<String> {
        let raw: Vec<u8> = self.0.call_method1("get", (key,))?.extract()?;
        Ok(String::from_utf8_lossy(&raw).into_owned())
    }
    fn get_many(&mut self, keys: &[String]) -> PyResult<Vec<String>> {
        let raw: Vec<Vec<u8>> = self.0.call_method1("multi_get", (keys.to_vec(),))?.extract()?;
        Ok(raw.into_iter().map(|v| String::from_utf8_lossy(&v).into_owned()).collect())
    }
    fn claim(&mut self, key: &str, value: &str) -> PyResult<String> {
        let raw: Vec<u8> = self.0.call_method1("compare_set", (key, "", value))?.extract()?;
        Ok(String::from_utf8_lossy(&raw).into_owned())
    }
    fn names(&mut self) -> Vec<String> {
        let listed = self.0.call_method0("list_keys").and_then(|k| k.extract::<Vec<String>>());
        listed
            .unwrap_or_default()
            .into_iter()
            .filter_map(|k| k.strip_prefix(ranks::keys::NAMES).map(String::from))
            .collect()
    }
    fn pause(&mut self, wait: Duration) -> PyResult<()> {
        let py = self.0.py();
        py.detach(|| std::thread::sleep(wait));
        // Ctrl-C ends a long wait.
        py.check_signals()
    }
}

// ---- stores this process opened ----------------------------------------------------------

/// A store this process opened or hosts, by the address it was opened for. A forked child
/// inherits the handle but not the connection or the server thread: it forgets it.
struct Opened {
    address: String,
    store: Py<PyAny>,
}

/// The store `GPUEXP_RANKS_STORE` names, once opened.
static NAMED: PerProcess<Option<Opened>> = PerProcess::new(|| None);
/// The store that could not be opened, by address, and why.
static UNREACHABLE: PerProcess<Option<(String, String)>> = PerProcess::new(|| None);
/// The TCPStore this kernel hosts (`gpuexp.host_ranks_store()`).
static HOSTED: PerProcess<Option<Opened>> = PerProcess::new(|| None);
/// The run token of the process group, with the group's store it was claimed in.
static RUN: PerProcess<Option<(Py<PyAny>, String)>> = PerProcess::new(|| None);
/// The searches of `find_batch_size` agreed so far in this run (each call has its keys).
static AGREEMENTS: PerProcess<u64> = PerProcess::new(|| 0);
/// What the last publish cost, for the bench: wall seconds and this thread's CPU seconds.
static LAST_PUBLISH: Mutex<Option<(f64, f64)>> = Mutex::new(None);

/// This thread's CPU time: with many ranks on few cores, wall time is mostly waiting for a core.
fn thread_cpu_s() -> f64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid clock id and a valid pointer to a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
    now.tv_sec as f64 + now.tv_nsec as f64 * 1e-9
}

fn current<'py>(
    py: Python<'py>,
    opened: &'static PerProcess<Option<Opened>>,
    address: &str,
) -> Option<Bound<'py, PyAny>> {
    let opened = opened.lock();
    opened.as_ref().filter(|o| o.address == address).map(|o| o.store.bind(py).clone())
}

/// The store `GPUEXP_RANKS_STORE` names, opened once per process; None where it is not set.
fn named_store(py: Python) -> PyResult<Option<(Bound<PyAny>, String)>> {
    let Ok(value) = std::env::var(STORE_ENV) else { return Ok(None) };
    let address = StoreAddress::parse(&value)?;
    let label = address.to_string();
    if let Some(store) = current(py, &HOSTED, &label).or_else(|| current(py, &NAMED, &label)) {
        return Ok(Some((store, label)));
    }
    let Some(dist) = distributed(py) else {
        return Err(PyRuntimeError::new_err(format!(
            "{STORE_ENV} names {label}: gathering across ranks needs torch.distributed (import torch first)"
        )));
    };
    if let Some((_, why)) = UNREACHABLE.lock().as_ref().filter(|(a, _)| *a == label) {
        return Err(PyRuntimeError::new_err(format!("{why} (not tried again in this process)")));
    }
    let opened = open_named(&dist, &address);
    match &opened {
        // Ctrl-C during the checks says nothing about the store: it is tried again next time.
        Err(e) if is_interrupt(py, e) => {}
        Err(e) => *UNREACHABLE.lock() = Some((label.clone(), said(py, e))),
        Ok(_) => {}
    }
    let store = opened?;
    // Not locked while opening: torch may release the GIL to connect, and another thread could
    // then wait for the lock with the GIL held. Two threads opening at once keep the first.
    let mut named = NAMED.lock();
    match named.as_ref().filter(|o| o.address == label) {
        Some(first) => Ok(Some((first.store.bind(py).clone(), label))),
        None => {
            *named = Some(Opened { address: label.clone(), store: store.clone().unbind() });
            Ok(Some((store, label)))
        }
    }
}

fn open_named<'py>(dist: &Bound<'py, PyAny>, address: &StoreAddress) -> PyResult<Bound<'py, PyAny>> {
    let py = dist.py();
    let store = match address {
        StoreAddress::Directory(dir) => {
            // torch's FileStore retries opening a file in a missing directory for 300 s.
            let dir = dir.clone();
            interruptible(py, move || ranks::check_store_directory(&dir))?.map_err(PyRuntimeError::new_err)?;
            let file = address.file().expect("a directory has a file");
            dist.getattr("FileStore")?.call1((file.to_string_lossy().as_ref(), -1))?
        }
        StoreAddress::Tcp { host, port } => {
            // torch's client retries a refused connection, and waits on one that never answers,
            // until its timeout: a connection and a ping of gpuexp's own tell a store that is
            // gone, or no store at all, from one that is busy.
            let (checked_host, checked_port) = (host.clone(), *port);
            interruptible(py, move || {
                ranks::check_tcp_store(&checked_host, checked_port, CONNECT_TIMEOUT, PING_TIMEOUT)
            })?
            .map_err(PyRuntimeError::new_err)?;
            let kwargs = PyDict::new(py);
            kwargs.set_item("wait_for_workers", false)?;
            kwargs.set_item("timeout", timedelta(py, VALIDATE_TIMEOUT)?)?;
            dist.getattr("TCPStore")?.call((host.as_str(), *port, py.None(), false), Some(&kwargs))?
        }
    };
    store.call_method1("set_timeout", (timedelta(py, STORE_TIMEOUT)?,))?;
    Ok(store)
}

/// Runs a check that may wait (a disk, the network) on a thread of its own, with the GIL released,
/// and raises Ctrl-C as soon as it comes: the caller does not wait for the check's own timeout.
/// An abandoned check ends by itself at that timeout.
fn interruptible<T: Send + 'static>(py: Python, check: impl FnOnce() -> T + Send + 'static) -> PyResult<T> {
    let (answer, answered) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("gpuexp-store-check".into())
        .spawn(move || {
            let _ = answer.send(check());
        })
        .map_err(|e| PyRuntimeError::new_err(format!("could not start a thread to check the store: {e}")))?;
    // In a mutex only so that the detached closure may borrow it: one thread ever receives.
    let answered = Mutex::new(answered);
    loop {
        match py.detach(|| lock(&answered).recv_timeout(Duration::from_millis(50))) {
            Ok(value) => return Ok(value),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => py.check_signals()?,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(PyRuntimeError::new_err("the store check ended without an answer"))
            }
        }
    }
}

/// Ctrl-C (or another exception that is no `Exception`): never swallowed with a store's errors.
fn is_interrupt(py: Python, error: &PyErr) -> bool {
    !error.is_instance_of::<pyo3::exceptions::PyException>(py)
}

/// Tells the runs of a process group apart: one token per group, claimed in its store by
/// whichever rank comes first. Without a group, torchrun's run id where it names one.
fn run_token(py: Python, group: Option<&(Bound<PyAny>, u32, u32)>) -> PyResult<Option<String>> {
    let Some((dist, _, _)) = group else {
        let run = std::env::var("TORCHELASTIC_RUN_ID").ok().filter(|r| !r.is_empty() && r != "none");
        let restart = std::env::var("TORCHELASTIC_RESTART_COUNT").unwrap_or_default();
        return Ok(run.map(|r| format!("{r}.{restart}")));
    };
    let store = group_store(dist)?;
    let mut cached = RUN.lock();
    if let Some((claimed_in, token)) = cached.as_ref() {
        if claimed_in.bind(py).is(&store) {
            return Ok(Some(token.clone()));
        }
    }
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let mine = format!("{nanos:x}-{:x}-{}", crate::fork::pid(), ranks::hostname());
    let token = PyStore(store.clone()).claim(ranks::keys::RUN, &mine)?;
    *cached = Some((store.unbind(), token.clone()));
    Ok(Some(token))
}

/// Where this process publishes and gathers: the store `GPUEXP_RANKS_STORE` names (the
/// kernel's, which every rank it launched reaches), or else the process group's. One store,
/// not both: a group's store lives in rank 0, which may have exited by the time a slower rank
/// finishes, and torch prints a stack trace for every call that then fails.
fn rank_store<'py>(
    py: Python<'py>,
    group: Option<&(Bound<'py, PyAny>, u32, u32)>,
) -> PyResult<Option<(Bound<'py, PyAny>, String)>> {
    match named_store(py)? {
        Some(named) => Ok(Some(named)),
        None => group_target(group),
    }
}

fn group_target<'py>(group: Option<&(Bound<'py, PyAny>, u32, u32)>) -> PyResult<Option<(Bound<'py, PyAny>, String)>> {
    group.map(|(dist, _, _)| Ok((group_store(dist)?, "the process group's store".to_string()))).transpose()
}

pub(super) fn identity(group: Option<&(Bound<PyAny>, u32, u32)>) -> RankIdentity {
    RankIdentity::detect(group.map(|(_, r, w)| (*r, *w)), |name| std::env::var(name).ok())
}

/// When a rank opens a scope: the run token is claimed and the store opened now, while every
/// rank is up, so that finishing costs one write. Called before the opening holds interrupts:
/// a store may wait, and Ctrl-C must reach it. A store's failure waits for the finish to say
/// it in a note; only Ctrl-C is raised.
pub(super) fn prepare_publishing(py: Python) -> PyResult<()> {
    let group = process_group(py);
    if identity(group.as_ref()).position().is_some() {
        let interrupt_only = |prepared: PyResult<()>| match prepared {
            Err(e) if is_interrupt(py, &e) => Err(e),
            _ => Ok(()),
        };
        interrupt_only(run_token(py, group.as_ref()).map(drop))?;
        interrupt_only(named_store(py).map(drop))?;
    }
    Ok(())
}

/// At finish, inside the teardown: names the descendants still holding GPU memory and, in a
/// rank, stamps the report with the rank's identity. No store is reached here.
pub(super) fn complete_report(py: Python, report: &mut Report) {
    report.child_processes = nvml::still_holding(report.gpus.iter().map(|g| (g.torch_index, g.uuid.as_str())));
    report.rank = identity(process_group(py).as_ref());
}

/// A store's error as a note quotes it: its message, after its class where that says more than
/// RuntimeError (which our own errors about the store are too, so a note would read
/// "RuntimeError: RuntimeError: ...").
fn said(py: Python, error: &PyErr) -> String {
    let message = error.value(py).str().map(|m| m.to_string()).unwrap_or_default();
    if error.get_type(py).is(py.get_type::<PyRuntimeError>()) {
        return message;
    }
    let kind = error.get_type(py).name().map(|n| n.to_string()).unwrap_or_default();
    format!("{kind}: {message}")
}

/// Once the teardown is done and the held interrupt given back: publishes a rank's finished
/// report. A store that fails costs a note, returned for the report, never the report; where
/// the named store can't be reached, the group's takes the report.
pub(super) fn publish_report(py: Python, scope: ScopeId, report: &Report) -> Vec<String> {
    let error = ranks::take_error(scope);
    let mut notes = Vec::new();
    if report.rank.position().is_none() {
        return notes;
    }
    let (started, cpu_started) = (Instant::now(), thread_cpu_s());
    let group = process_group(py);
    let run = match run_token(py, group.as_ref()) {
        Ok(run) => run,
        Err(e) => {
            notes.push(format!("the process group's store did not answer ({}): runs are not told apart", said(py, &e)));
            None
        }
    };
    let store = rank_store(py, group.as_ref()).or_else(|unreachable| {
        notes.push(format!("publishing for gpuexp.ranks() failed: {}", said(py, &unreachable)));
        group_target(group.as_ref())
    });
    let published = match store {
        Ok(Some((store, label))) => {
            ranks::publish(&mut PyStore(store), report, run, error).map_err(|e| format!("{label}: {}", said(py, &e)))
        }
        Ok(None) => Ok(()),
        Err(e) => Err(said(py, &e)),
    };
    if let Err(failure) = published {
        notes.push(format!("publishing for gpuexp.ranks() failed: {failure}"));
    }
    *lock(&LAST_PUBLISH) = Some((started.elapsed().as_secs_f64(), thread_cpu_s() - cpu_started));
    notes
}

/// The exception that ended an experiment's `with` block: it goes into the published record.
#[pyfunction]
pub(super) fn note_scope_error(id: ScopeId, error: &Bound<PyAny>) -> PyResult<()> {
    let kind = error.get_type().name()?.to_string();
    let message = error.str()?.to_string();
    let first_line = message.lines().next().unwrap_or("").chars().take(500).collect::<String>();
    ranks::note_error(id, format!("{kind}: {first_line}"));
    Ok(())
}

/// What the last publish took (identity, run token, both stores), for the bench: wall and
/// CPU seconds.
#[pyfunction]
pub(super) fn last_publish_s() -> Option<(f64, f64)> {
    *lock(&LAST_PUBLISH)
}

/// `gpuexp.ranks()`: every rank's latest report of an experiment, from the store
/// `GPUEXP_RANKS_STORE` names (the kernel's own), or in a rank without one, its group's.
#[pyfunction]
#[pyo3(name = "ranks", signature = (name=None, timeout=10.0))]
pub(super) fn gather_ranks(py: Python, name: Option<String>, timeout: f64) -> PyResult<RanksPy> {
    let timeout = Duration::try_from_secs_f64(timeout).map_err(|_| {
        PyValueError::new_err(format!("timeout must be a number of seconds, e.g. timeout=10; got {timeout}"))
    })?;
    let (store, label) = rank_store(py, process_group(py).as_ref())?.ok_or_else(|| {
        PyRuntimeError::new_err(format!(
            "no store to gather from: call gpuexp.ranks() in a rank of an initialised process group, or in the \
             notebook that launched the ranks, or set {STORE_ENV} to the store the ranks publish to"
        ))
    })?;
    match ranks::gather(&mut PyStore(store), name.as_deref(), timeout, &label) {
        Ok(gathered) => Ok(RanksPy(gathered)),
        Err(GatherError::Store(e)) => Err(e),
        Err(GatherError::NothingPublished(why)) => Err(PyTimeoutError::new_err(why)),
    }
}

/// This kernel's private store directory for the ranks it launches, as `file://…`.
#[pyfunction]
pub(super) fn kernel_ranks_store() -> PyResult<String> {
    let dir = ranks::kernel_store_dir()?;
    Ok(StoreAddress::Directory(dir).to_string())
}

#[pyfunction]
pub(super) fn remove_kernel_ranks_store() {
    ranks::remove_kernel_store_dir();
}

/// Hosts a TCPStore in this process, listening on `address` only (loopback by default);
/// returns its address as `tcp://host:port`.
#[pyfunction]
#[pyo3(signature = (address="127.0.0.1", port=0))]
pub(super) fn host_ranks_store(py: Python, address: &str, port: u16) -> PyResult<String> {
    let mut hosted = HOSTED.lock();
    if let Some(opened) = hosted.as_ref() {
        return Ok(opened.address.clone());
    }
    let dist = distributed(py).ok_or_else(|| {
        PyRuntimeError::new_err("hosting a store for ranks needs torch.distributed: import torch first")
    })?;
    let listener = std::net::TcpListener::bind((address, port))
        .map_err(|e| PyValueError::new_err(format!("could not listen on {address}:{port}: {e}")))?;
    let local = listener.local_addr().map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
    // Ranks on this host reach an unspecified address through loopback; others by this host's name.
    let (connect, advertised) = if local.ip().is_unspecified() {
        ("127.0.0.1".to_string(), ranks::hostname())
    } else {
        (local.ip().to_string(), local.ip().to_string())
    };
    let kwargs = PyDict::new(py);
    kwargs.set_item("wait_for_workers", false)?;
    kwargs.set_item("timeout", timedelta(py, STORE_TIMEOUT)?)?;
    // torch's server would listen on every interface; given a socket, it listens where that one does.
    kwargs.set_item("master_listen_fd", std::os::fd::IntoRawFd::into_raw_fd(listener))?;
    let store = dist.getattr("TCPStore")?.call((connect.as_str(), local.port(), py.None(), true), Some(&kwargs))?;
    let url = StoreAddress::Tcp { host: advertised, port: local.port() }.to_string();
    *hosted = Some(Opened { address: url.clone(), store: store.unbind() });
    Ok(url)
}

// ---- the finder across ranks -----------------------------------------------------------------

/// In a rank of an initialised process group: waits for every rank's answer and takes the
/// largest size that fits on every rank. Returns whether there was a group to agree with.
pub(super) fn agree_across_ranks(py: Python, search: &mut Search, timeout: f64) -> PyResult<bool> {
    let Some(group) = process_group(py) else { return Ok(false) };
    let timeout = Duration::try_from_secs_f64(timeout)
        .map_err(|_| PyValueError::new_err(format!("ranks_timeout must be a number of seconds; got {timeout}")))?;
    let run = run_token(py, Some(&group))?.expect("a group has a run");
    let call = {
        let mut calls = AGREEMENTS.lock();
        *calls += 1;
        *calls
    };
    let (dist, rank, world_size) = group;
    let answer = search.batch_size;
    let agreed = ranks::agree(&mut PyStore(group_store(&dist)?), &run, call, (rank, world_size), answer, timeout)?;
    let agreement = agreed.map_err(PyRuntimeError::new_err)?;
    if agreement.agreed != answer {
        search.verdict.push_str(&format!(
            "; this rank alone would run {}, but every rank must run one size",
            answer.map(|a| a.to_string()).unwrap_or_else(|| "none".into())
        ));
    }
    search.batch_size = agreement.agreed;
    search.ranks = Some(agreement);
    Ok(true)
}

// ---- the gathered table ----------------------------------------------------------------------

/// Every rank's latest report of one experiment (``gpuexp.ranks()``): ``str()`` and
/// ``_repr_html_`` show the table, outliers flagged.
#[pyclass(name = "Ranks", module = "gpuexp", frozen)]
pub(super) struct RanksPy(Gathered);

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
        let pandas = super::error::optional(py, "pandas", "to_pandas()")?;
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
