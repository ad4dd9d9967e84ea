//! Where a leak hunt starts: every place a user's objects live, each labelled as a person
//! would say it. The core decides the order ([`RootKind`]) and which kind each is
//! ([`InstalledCode`]); this file only finds them.

use std::collections::{HashMap, HashSet};

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyModule, PyString};

use super::namespace::{hidden_refs, user_names};
use super::python_heap::frame_label;
use crate::holders_walk::{thread_order, InstalledCode, Root, RootKind};
use crate::teardown::is_system_name;

pub(super) type PyRoot<'py> = Root<Bound<'py, PyAny>>;

fn root(kind: RootKind, label: String, object: Bound<'_, PyAny>) -> PyRoot<'_> {
    Root { kind, label, object }
}

/// The notebook's names, then IPython's hidden references (`Out`, the last traceback).
pub(super) fn namespace_roots<'py>(adapter: &Bound<'py, PyAny>) -> PyResult<Vec<PyRoot<'py>>> {
    let mut names = user_names(adapter)?;
    names.sort_by(|a, b| a.0.cmp(&b.0));
    let names = names.into_iter().map(|(label, object)| root(RootKind::Name, label, object));
    let hidden = hidden_refs(adapter)?.into_iter().map(|(label, object)| root(RootKind::Hidden, label, object));
    Ok(names.chain(hidden).collect())
}

/// Everything outside the notebook's namespace: threads, modules, suspended frames, hooks.
/// `suspended` are the generators and coroutines the collector knows, paused at a `yield`.
pub(super) fn world_roots<'py>(py: Python<'py>, suspended: Vec<Bound<'py, PyAny>>) -> PyResult<Vec<PyRoot<'py>>> {
    let library = installed(py)?;
    let mut roots = thread_roots(py, &library)?;
    roots.extend(module_roots(py, &library)?);
    roots.extend(suspended_roots(py, suspended, &library)?);
    roots.extend(hook_roots(py));
    Ok(roots)
}

/// The interpreter's install prefixes, for the core to tell installed code from the user's.
fn installed(py: Python) -> PyResult<InstalledCode> {
    let sys = py.import("sys")?;
    let prefixes = ["prefix", "base_prefix", "exec_prefix"]
        .iter()
        .filter_map(|name| sys.getattr(*name).ok()?.extract().ok())
        .collect();
    Ok(InstalledCode { prefixes })
}

/// Every frame of every thread: user code first; library frames of other threads later; the
/// hunter's own library frames (IPython running this cell) are left out.
fn thread_roots<'py>(py: Python<'py>, library: &InstalledCode) -> PyResult<Vec<PyRoot<'py>>> {
    let sys = py.import("sys")?;
    let threading = py.import("threading")?;
    let current: u64 = threading.call_method0("get_ident")?.extract()?;
    let mut names: HashMap<u64, String> = HashMap::new();
    for thread in threading.call_method0("enumerate")?.try_iter()? {
        let thread = thread?;
        if let Ok(ident) = thread.getattr("ident")?.extract::<u64>() {
            names.insert(ident, thread.getattr("name")?.extract()?);
        }
    }
    let mut frames: Vec<(u64, Bound<PyAny>)> = sys
        .call_method0("_current_frames")?
        .cast_into::<PyDict>()?
        .iter()
        .map(|(k, v)| Ok((k.extract()?, v)))
        .collect::<PyResult<_>>()?;
    frames.sort_by_key(|(ident, _)| thread_order(*ident, current));
    let mut roots = Vec::new();
    for (ident, top) in frames {
        let thread = names.get(&ident).cloned().unwrap_or_else(|| format!("{ident}"));
        let mut frame = Some(top);
        while let Some(current_frame) = frame.filter(|f| !f.is_none()) {
            let file: Option<String> = current_frame.getattr("f_code")?.getattr("co_filename")?.extract().ok();
            let line = current_frame.getattr("f_lineno")?.extract::<u32>().unwrap_or(0);
            let label = format!("thread \"{thread}\": {}", frame_label(&current_frame, line));
            let next = current_frame.getattr("f_back").ok();
            if let Some(kind) = library.thread_frame(file.as_deref(), ident == current) {
                roots.push(root(kind, label, current_frame));
            }
            frame = next;
        }
    }
    Ok(roots)
}

/// Every module's globals, as `module.name`: the user's own modules, then libraries. Read
/// from the module's dict, never by attribute, so a lazy module is not imported. The main
/// module is walked once, as `__main__`, under whichever names `sys.modules` gives it (torch's
/// multiprocessing adds `__mp_main__`): a script's globals, when `holders()` is called from one
/// of its functions. Where they are the namespace's own names they were walked first, as names.
fn module_roots<'py>(py: Python<'py>, library: &InstalledCode) -> PyResult<Vec<PyRoot<'py>>> {
    let modules = py.import("sys")?.getattr("modules")?.call_method0("copy")?.cast_into::<PyDict>()?;
    let main = modules.get_item("__main__")?;
    let mut roots = Vec::new();
    for (name, module) in modules.iter() {
        let Ok(name) = name.extract::<String>() else { continue };
        let Ok(module) = module.cast_into::<PyModule>() else { continue };
        let is_main = main.as_ref().is_some_and(|main| module.is(main));
        let no_hidden = HashSet::new();
        if is_main && name != "__main__" {
            continue;
        }
        let globals = module.dict();
        let file: Option<String> = globals.get_item("__file__").ok().flatten().and_then(|f| f.extract().ok());
        let kind = library.module(file.as_deref());
        for (key, value) in globals.iter() {
            let Ok(key) = key.cast_into::<PyString>() else { continue };
            let key = key.to_string();
            // IPython's own names in a notebook's main module (`Out`, `_3`, `_i3`) are its
            // hidden references, already walked under their own labels.
            let ipythons = is_main && is_system_name(&key, &no_hidden);
            if !key.starts_with("__") && !ipythons {
                roots.push(root(kind, format!("{name}.{key}"), value));
            }
        }
    }
    Ok(roots)
}

/// The frames of pending asyncio tasks (by task name), then of other suspended generators and
/// coroutines: user code's among the suspended roots, library code's after the libraries'
/// globals. A running one is on the hunter's own call stack (IPython running this cell).
fn suspended_roots<'py>(
    py: Python<'py>,
    suspended: Vec<Bound<'py, PyAny>>,
    library: &InstalledCode,
) -> PyResult<Vec<PyRoot<'py>>> {
    let mut tasks: HashMap<usize, String> = HashMap::new();
    if let Ok(module) = py.import("sys")?.getattr("modules")?.get_item("asyncio.tasks") {
        // The registries of live tasks (a WeakSet each); their names differ across versions.
        for registry in ["_scheduled_tasks", "_all_tasks"] {
            let Ok(registry) = module.getattr(registry) else { continue };
            for task in registry.call_method0("copy")?.try_iter()? {
                let task = task?;
                if let (Ok(coro), Ok(name)) = (task.call_method0("get_coro"), task.call_method0("get_name")) {
                    tasks.insert(coro.as_ptr() as usize, name.to_string());
                }
            }
        }
    }
    let mut roots = Vec::new();
    for object in suspended {
        let (prefix, what) = match object.get_type().name()?.to_string().as_str() {
            "generator" => ("gi", "generator"),
            "coroutine" => ("cr", "coroutine"),
            _ => ("ag", "async generator"),
        };
        let Ok(frame) = object.getattr(format!("{prefix}_frame").as_str()) else { continue };
        let running = object.getattr(format!("{prefix}_running").as_str()).and_then(|r| r.is_truthy());
        if frame.is_none() || running.unwrap_or(true) {
            continue;
        }
        let file: Option<String> = frame.getattr("f_code")?.getattr("co_filename")?.extract().ok();
        let kind = library.suspended(file.as_deref());
        let line = frame.getattr("f_lineno")?.extract::<u32>().unwrap_or(0);
        let at = frame_label(&frame, line);
        let label = match tasks.get(&(object.as_ptr() as usize)) {
            Some(task) => format!("task \"{task}\": {at}"),
            None => format!("suspended {what} {at}"),
        };
        roots.push((!tasks.contains_key(&(object.as_ptr() as usize)), root(kind, label, frame)));
    }
    roots.sort_by_key(|(untasked, _)| *untasked);
    Ok(roots.into_iter().map(|(_, root)| root).collect())
}

/// The interpreter's hooks that hold user functions (and what their closures hold) where no
/// module global does: trace and profile functions, signal handlers. Others (`sys.excepthook`,
/// `sys.meta_path`, `gc.callbacks`, `weakref.finalize._registry`) are module globals or class
/// attributes, walked with their modules.
fn hook_roots(py: Python<'_>) -> Vec<PyRoot<'_>> {
    let mut roots = Vec::new();
    let Ok(sys) = py.import("sys") else { return roots };
    for hook in ["gettrace", "getprofile"] {
        if let Some(found) = sys.call_method0(hook).ok().filter(|f| !f.is_none()) {
            roots.push(root(RootKind::Hook, format!("sys.{hook}()"), found));
        }
    }
    if let Ok(signal) = py.import("signal") {
        let valid = signal.call_method0("valid_signals").and_then(|v| v.try_iter().map(|i| i.flatten().collect()));
        for number in valid.unwrap_or_else(|_| Vec::new()) {
            let Ok(handler) = signal.call_method1("getsignal", (&number,)) else { continue };
            let default = signal.getattr("default_int_handler").ok();
            if handler.is_callable() && !default.is_some_and(|d| handler.is(&d)) {
                let name = number.getattr("name").map(|n| n.to_string()).unwrap_or_else(|_| number.to_string());
                roots.push(root(RootKind::Hook, format!("signal handler {name}"), handler));
            }
        }
    }
    roots
}
