//! Where a leak hunt starts: every place a user's objects live, each labelled as a person
//! would say it. The core decides the order ([`RootKind`]) and which kind each is
//! ([`InstalledCode`]); this file only labels them: `gpuexp.hunt_roots` finds them, reading the
//! interpreter's threads, modules, tasks and hooks.

use std::collections::HashSet;

use pyo3::prelude::*;

use crate::bindings::namespace::{hidden_refs, user_names};
use crate::bindings::python_heap::frame_here;
use crate::holders_walk::{thread_order, InstalledCode, Root, RootKind};
use crate::teardown::is_system_name;

pub(in crate::bindings) type PyRoot<'py> = Root<Bound<'py, PyAny>>;

fn root(kind: RootKind, label: String, object: Bound<'_, PyAny>) -> PyRoot<'_> {
    Root { kind, label, object }
}

/// The notebook's names, then IPython's hidden references (`Out`, the last traceback).
pub(in crate::bindings) fn namespace_roots<'py>(adapter: &Bound<'py, PyAny>) -> PyResult<Vec<PyRoot<'py>>> {
    let mut names = user_names(adapter)?;
    names.sort_by(|a, b| a.0.cmp(&b.0));
    let names = names.into_iter().map(|(label, object)| root(RootKind::Name, label, object));
    let hidden = hidden_refs(adapter)?.into_iter().map(|(label, object)| root(RootKind::Hidden, label, object));
    Ok(names.chain(hidden).collect())
}

/// Everything outside the notebook's namespace: threads, modules, suspended frames, hooks.
/// `suspended` are the generators and coroutines the collector knows, paused at a `yield`.
pub(in crate::bindings) fn world_roots<'py>(
    py: Python<'py>,
    suspended: Vec<Bound<'py, PyAny>>,
) -> PyResult<Vec<PyRoot<'py>>> {
    let finder = py.import("gpuexp.hunt_roots")?;
    let library = InstalledCode { prefixes: finder.call_method0("install_prefixes")?.extract()? };
    let (current, threads) = finder.call_method0("thread_frames")?.extract()?;
    let modules = finder.call_method0("module_globals")?.extract()?;
    let suspended = finder.call_method1("suspended_frames", (suspended,))?.extract()?;
    let hooks: Vec<(String, Bound<PyAny>)> = finder.call_method0("hooks")?.extract()?;
    let mut roots = thread_roots(&library, current, threads)?;
    roots.extend(module_roots(&library, modules));
    roots.extend(suspended_roots(&library, suspended)?);
    roots.extend(hooks.into_iter().map(|(label, hook)| root(RootKind::Hook, label, hook)));
    Ok(roots)
}

/// Each thread's ident, name and frames (innermost first, each with its file), as
/// `gpuexp.hunt_roots.thread_frames` reads them.
type ThreadFrames<'py> = Vec<(u64, String, Vec<(Option<String>, Bound<'py, PyAny>)>)>;

/// Every frame of every thread: user code first; library frames of other threads later; the
/// hunter's own library frames (IPython running this cell) are left out.
fn thread_roots<'py>(
    library: &InstalledCode,
    current: u64,
    mut threads: ThreadFrames<'py>,
) -> PyResult<Vec<PyRoot<'py>>> {
    threads.sort_by_key(|(ident, _, _)| thread_order(*ident, current));
    let mut roots = Vec::new();
    for (ident, thread, frames) in threads {
        for (file, frame) in frames {
            if let Some(kind) = library.thread_frame(file.as_deref(), ident == current) {
                roots.push(root(kind, format!("thread \"{thread}\": {}", frame_here(&frame)?), frame));
            }
        }
    }
    Ok(roots)
}

/// One module's globals as `gpuexp.hunt_roots.module_globals` reads them: its name, its file,
/// whether it is the main module, its string-keyed entries.
type ModuleGlobals<'py> = (String, Option<String>, bool, Vec<(String, Bound<'py, PyAny>)>);

/// Every module's globals, as `module.name`: the user's own modules, then libraries. The main
/// module comes once, as `__main__` (a script's globals, when `holders()` is called from one of
/// its functions); where they are the namespace's own names they were walked first, as names.
fn module_roots<'py>(library: &InstalledCode, modules: Vec<ModuleGlobals<'py>>) -> Vec<PyRoot<'py>> {
    let no_hidden = HashSet::new();
    let mut roots = Vec::new();
    for (name, file, is_main, globals) in modules {
        let kind = library.module(file.as_deref());
        for (key, value) in globals {
            // IPython's own names in a notebook's main module (`Out`, `_3`, `_i3`) are its
            // hidden references, already walked under their own labels.
            let ipythons = is_main && is_system_name(&key, &no_hidden);
            if !key.starts_with("__") && !ipythons {
                roots.push(root(kind, format!("{name}.{key}"), value));
            }
        }
    }
    roots
}

/// A paused generator's or coroutine's frame: its file, its asyncio task's name, what it is.
type SuspendedFrame<'py> = (Option<String>, Option<String>, String, Bound<'py, PyAny>);

/// The frames of pending asyncio tasks (by task name), then of other suspended generators and
/// coroutines: user code's among the suspended roots, library code's after the libraries'
/// globals.
fn suspended_roots<'py>(library: &InstalledCode, suspended: Vec<SuspendedFrame<'py>>) -> PyResult<Vec<PyRoot<'py>>> {
    let mut roots = Vec::new();
    for (file, task, what, frame) in suspended {
        let label = match &task {
            Some(task) => format!("task \"{task}\": {}", frame_here(&frame)?),
            None => format!("suspended {what} {}", frame_here(&frame)?),
        };
        roots.push((task.is_none(), root(library.suspended(file.as_deref()), label, frame)));
    }
    roots.sort_by_key(|(untasked, _)| *untasked);
    Ok(roots.into_iter().map(|(_, root)| root).collect())
}
