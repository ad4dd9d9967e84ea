//! What holds memory (`gpuexp.holders()`, and the names a finished experiment's report gives for
//! memory that did not come back). The walk: breadth-first from roots a person recognises (notebook names,
//! `Out`, the stored traceback, module globals) through the objects that hold tensors in
//! practice, to every live tensor and numpy array, keeping the path to each. It keeps no
//! reference once it returns: the result is paths and sizes.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Instant;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyFrozenSet, PyList, PyModule, PySet, PyString, PyTuple, PyType};

use super::namespace::{hidden_refs, user_names};
use super::report::HoldersPy;
use super::snapshot::take_snapshot;
use super::torch::PyTorch;
use crate::explain::{Role, TensorRoles};
use crate::report::{self, render_path, Holder, Holders, PathEdge, Report};
use crate::snapshot::GpuSelection;
use crate::uninspectable::Uninspectable;

/// Enough for a kernel with a few million objects; a walk that hits it says so.
const VISIT_LIMIT: usize = 5_000_000;

/// Which memory to hunt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Memory {
    /// A CUDA device, by torch index.
    Cuda(u32),
    /// Host memory: CPU tensors and numpy arrays.
    Host,
    /// Every buffer, whatever its device (an experiment's inventory at its start).
    Any,
}

impl Memory {
    pub fn label(&self) -> String {
        match self {
            Memory::Cuda(index) => format!("cuda:{index}"),
            Memory::Host => "host".into(),
            Memory::Any => "any device".into(),
        }
    }
}

/// Identifies a buffer, so that views and aliases count once: a tensor's storage, an array's base.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Buffer {
    Storage(usize),
    Array(usize),
}

struct Found {
    node: usize,
    bytes: u64,
    kind: &'static str,
    shape: String,
    device: String,
}

struct Node<'py> {
    object: Bound<'py, PyAny>,
    parent: Option<usize>,
    edge: PathEdge,
    /// The dict key this node was reached by, rendered when the path is: by then the walk
    /// may have reached the key itself (an optimizer's state is keyed by parameters).
    key: Option<Bound<'py, PyAny>>,
}

/// Types the walk recognises, looked up once per hunt. torch and numpy only if already imported.
struct Types<'py> {
    tensor: Option<Bound<'py, PyType>>,
    ndarray: Option<Bound<'py, PyType>>,
    module: Option<Bound<'py, PyType>>,
    optimizer: Option<Bound<'py, PyType>>,
    traceback: Bound<'py, PyType>,
    frame: Bound<'py, PyType>,
    function: Bound<'py, PyType>,
    method: Bound<'py, PyType>,
    cell: Bound<'py, PyType>,
}

impl<'py> Types<'py> {
    fn new(py: Python<'py>) -> PyResult<Types<'py>> {
        let modules = py.import("sys")?.getattr("modules")?;
        let find = |module: &str, name: &str| -> Option<Bound<'py, PyType>> {
            modules.get_item(module).ok()?.getattr(name).ok()?.cast_into::<PyType>().ok()
        };
        let types = py.import("types")?;
        let get = |name: &str| -> PyResult<Bound<'py, PyType>> { Ok(types.getattr(name)?.cast_into::<PyType>()?) };
        Ok(Types {
            tensor: find("torch", "Tensor"),
            ndarray: find("numpy", "ndarray"),
            module: find("torch.nn", "Module"),
            optimizer: find("torch.optim", "Optimizer"),
            traceback: get("TracebackType")?,
            frame: get("FrameType")?,
            function: get("FunctionType")?,
            method: get("MethodType")?,
            cell: get("CellType")?,
        })
    }
}

/// A walk in progress.
struct Walk<'py> {
    types: Types<'py>,
    memory: Memory,
    nodes: Vec<Node<'py>>,
    /// Object address → its node: each object is reached once, by its shortest path.
    visited: HashMap<usize, usize>,
    queue: VecDeque<usize>,
    found: HashMap<Buffer, Found>,
    /// The modules and optimizers passed on the way: what tells parameters, gradients and
    /// optimizer state from other tensors.
    owners: Vec<Bound<'py, PyAny>>,
    /// Objects whose inspection raised: skipped, and said in one note.
    skipped: Uninspectable,
}

impl<'py> Walk<'py> {
    fn new(py: Python<'py>, memory: Memory) -> PyResult<Walk<'py>> {
        Ok(Walk {
            types: Types::new(py)?,
            memory,
            nodes: Vec::new(),
            visited: HashMap::new(),
            queue: VecDeque::new(),
            found: HashMap::new(),
            owners: Vec::new(),
            skipped: Uninspectable::default(),
        })
    }

    fn push(&mut self, object: Bound<'py, PyAny>, parent: Option<usize>, edge: PathEdge) {
        let address = object.as_ptr() as usize;
        if is_atomic(&object) || self.visited.contains_key(&address) {
            return;
        }
        self.visited.insert(address, self.nodes.len());
        self.nodes.push(Node { object, parent, edge, key: None });
        self.queue.push_back(self.nodes.len() - 1);
    }

    fn push_keyed(&mut self, value: Bound<'py, PyAny>, parent: usize, key: Bound<'py, PyAny>) {
        let before = self.nodes.len();
        self.push(value, Some(parent), PathEdge::Key(String::new()));
        if self.nodes.len() > before {
            self.nodes[before].key = Some(key);
        }
    }

    fn is_a(&self, object: &Bound<'py, PyAny>, class: &Option<Bound<'py, PyType>>) -> bool {
        class.as_ref().is_some_and(|c| type_is(object, c))
    }

    fn path(&self, mut node: usize) -> String {
        let mut edges = Vec::new();
        loop {
            edges.push(match &self.nodes[node].key {
                Some(key) => PathEdge::Key(self.render_key(key)),
                None => self.nodes[node].edge.clone(),
            });
            match self.nodes[node].parent {
                Some(parent) => node = parent,
                None => break,
            }
        }
        edges.reverse();
        render_path(&edges)
    }

    /// Walks until `done` says every wanted buffer is found, or everything reachable is seen.
    fn run(&mut self, done: impl Fn(&HashMap<Buffer, Found>) -> bool) -> PyResult<()> {
        while let Some(index) = self.queue.pop_front() {
            if done(&self.found) || self.nodes.len() > VISIT_LIMIT {
                break;
            }
            let object = self.nodes[index].object.clone();
            // A user object that raises when inspected is skipped and counted, never re-raised;
            // an interrupt (not an Exception) still ends the walk.
            if let Err(error) = self.expand(index, &object) {
                if !error.is_instance_of::<pyo3::exceptions::PyException>(object.py()) {
                    return Err(error);
                }
                self.skipped.skip(|| described(object.py(), &error));
            }
        }
        Ok(())
    }

    fn expand(&mut self, index: usize, object: &Bound<'py, PyAny>) -> PyResult<()> {
        let parent = Some(index);
        if self.is_a(object, &self.types.tensor) {
            self.record_tensor(index, object);
            if let Ok(grad) = object.getattr("grad") {
                self.push(grad, parent, PathEdge::Attr("grad".into()));
            }
            return Ok(());
        }
        if self.is_a(object, &self.types.ndarray) {
            match object.getattr("base") {
                Ok(base) if !base.is_none() => self.push(base, parent, PathEdge::Attr("base".into())),
                _ => self.record_array(index, object),
            }
            return Ok(());
        }
        if self.is_a(object, &self.types.module) || self.is_a(object, &self.types.optimizer) {
            self.owners.push(object.clone());
        }
        if let Ok(dict) = object.cast::<PyDict>() {
            for (key, value) in dict.iter() {
                self.push_keyed(value, index, key);
            }
        } else if let Ok(list) = object.cast::<PyList>() {
            for (i, item) in list.iter().enumerate() {
                self.push(item, parent, PathEdge::Index(i));
            }
        } else if let Ok(tuple) = object.cast::<PyTuple>() {
            for (i, item) in tuple.iter().enumerate() {
                self.push(item, parent, PathEdge::Index(i));
            }
        } else if object.is_instance_of::<PySet>() || object.is_instance_of::<PyFrozenSet>() {
            for (i, item) in object.try_iter()?.enumerate() {
                self.push(item?, parent, PathEdge::Index(i));
            }
        } else if object.is_instance_of::<PyModule>() {
            // Reached as a value: its globals are roots of their own, walked later.
        } else if type_is(object, &self.types.traceback) {
            let mut tb = Some(object.clone());
            while let Some(current) = tb.filter(|t| !t.is_none()) {
                let frame = current.getattr("tb_frame")?;
                let label = frame_label(&frame, current.getattr("tb_lineno")?.extract::<u32>().unwrap_or(0));
                self.push(frame, parent, PathEdge::Frame(label));
                tb = current.getattr("tb_next").ok();
            }
        } else if type_is(object, &self.types.frame) {
            if let Ok(locals) = object.getattr("f_locals").and_then(|l| Ok(l.cast_into::<PyDict>()?)) {
                for (name, value) in locals.iter() {
                    self.push(value, parent, PathEdge::Local(name.to_string()));
                }
            }
        } else if type_is(object, &self.types.function) {
            let closure = object.getattr("__closure__")?;
            if !closure.is_none() {
                let names: Vec<String> = object.getattr("__code__")?.getattr("co_freevars")?.extract()?;
                for (name, cell) in names.into_iter().zip(closure.try_iter()?) {
                    if let Ok(contents) = cell?.getattr("cell_contents") {
                        self.push(contents, parent, PathEdge::Closure(name));
                    }
                }
            }
        } else if type_is(object, &self.types.method) {
            self.push(object.getattr("__self__")?, parent, PathEdge::Attr("__self__".into()));
        } else if type_is(object, &self.types.cell) {
            if let Ok(contents) = object.getattr("cell_contents") {
                self.push(contents, parent, PathEdge::Attr("cell_contents".into()));
            }
        } else if object.is_instance_of::<PyType>() {
            // Classes defined in the notebook can keep caches as class attributes; library classes are skipped.
            let defined_here = object.getattr("__module__").ok().is_some_and(|m| m.to_string() == "__main__");
            if defined_here {
                self.push_attributes(index, &object.getattr("__dict__")?)?;
            }
        } else {
            match object.getattr("__dict__") {
                Ok(attributes) => self.push_attributes(index, &attributes)?,
                // Most objects have no `__dict__`; one that raises anything else (a dead
                // `weakref.proxy`, a property) could not be inspected.
                Err(e) if e.is_instance_of::<pyo3::exceptions::PyAttributeError>(object.py()) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn push_attributes(&mut self, index: usize, attributes: &Bound<'py, PyAny>) -> PyResult<()> {
        for item in attributes.call_method0("items")?.try_iter()? {
            let (name, value): (Bound<PyAny>, Bound<PyAny>) = item?.extract()?;
            self.push(value, Some(index), PathEdge::Attr(name.to_string()));
        }
        Ok(())
    }

    /// A dict key as a person reads it; a tensor key (an optimizer's state) by the path it
    /// was reached by when the walk has been there, else by its shape.
    fn render_key(&self, key: &Bound<'py, PyAny>) -> String {
        if key.is_instance_of::<PyString>() {
            return key.repr().map(|r| r.to_string()).unwrap_or_default();
        }
        if let Some(&known) = self.visited.get(&(key.as_ptr() as usize)) {
            if self.nodes[known].key.as_ref().is_none_or(|k| !k.is(key)) {
                return self.path(known);
            }
        }
        if self.is_a(key, &self.types.tensor) {
            return format!("<tensor {}>", key.getattr("shape").map(|s| shape_text(&s)).unwrap_or_default());
        }
        match key.repr().map(|r| r.to_string()) {
            Ok(text) if text.len() <= 40 => text,
            _ => format!("<{}>", key.get_type().name().map(|n| n.to_string()).unwrap_or_default()),
        }
    }

    fn record_tensor(&mut self, node: usize, tensor: &Bound<'py, PyAny>) {
        let Ok(Some((buffer, bytes, device))) = tensor_buffer(tensor, &self.memory) else { return };
        let shape = tensor.getattr("shape").map(|s| shape_text(&s)).unwrap_or_default();
        self.found.entry(buffer).or_insert(Found { node, bytes, kind: "tensor", shape, device });
    }

    fn record_array(&mut self, node: usize, array: &Bound<'py, PyAny>) {
        if matches!(self.memory, Memory::Cuda(_)) {
            return;
        }
        let bytes = array.getattr("nbytes").and_then(|b| b.extract::<u64>()).unwrap_or(0);
        let shape = array.getattr("shape").map(|s| shape_text(&s)).unwrap_or_default();
        let buffer = Buffer::Array(array.as_ptr() as usize);
        self.found.entry(buffer).or_insert(Found { node, bytes, kind: "ndarray", shape, device: "cpu".into() });
    }
}

/// A tensor's storage if it lives in `memory`: (buffer, bytes, device label).
pub(super) fn tensor_buffer(tensor: &Bound<PyAny>, memory: &Memory) -> PyResult<Option<(Buffer, u64, String)>> {
    let device = tensor.getattr("device")?;
    let kind: String = device.getattr("type")?.extract()?;
    let index: Option<u32> = device.getattr("index")?.extract()?;
    let wanted = match memory {
        Memory::Cuda(want) => kind == "cuda" && index.unwrap_or(0) == *want,
        Memory::Host => kind == "cpu",
        Memory::Any => true,
    };
    if !wanted {
        return Ok(None);
    }
    let storage = tensor.call_method0("untyped_storage")?;
    let pointer: usize = storage.call_method0("data_ptr")?.extract()?;
    let bytes: u64 = storage.call_method0("nbytes")?.extract()?;
    if pointer == 0 || bytes == 0 {
        return Ok(None);
    }
    let label = match index {
        Some(i) => format!("{kind}:{i}"),
        None => kind,
    };
    Ok(Some((Buffer::Storage(pointer), bytes, label)))
}

fn shape_text(shape: &Bound<PyAny>) -> String {
    let dims: Vec<i64> = shape.extract().unwrap_or_default();
    format!("[{}]", dims.iter().map(i64::to_string).collect::<Vec<_>>().join(", "))
}

fn frame_label(frame: &Bound<PyAny>, line: u32) -> String {
    let name = frame.getattr("f_code").and_then(|c| c.getattr("co_name")).map(|n| n.to_string()).unwrap_or_default();
    format!("{name}(), line {line}")
}

/// Whether `object`'s own type is `class` or derives from it. Read from the type, never from the
/// object: `isinstance` asks the object for `__class__`, which a property may raise, a dead
/// `weakref.proxy` does raise, and a lazy module answers by importing itself.
fn type_is(object: &Bound<PyAny>, class: &Bound<PyType>) -> bool {
    // SAFETY: both pointers are live objects for the borrow's length; PyType_IsSubtype only
    // reads the types' MROs and runs no Python code.
    unsafe { pyo3::ffi::PyType_IsSubtype(pyo3::ffi::Py_TYPE(object.as_ptr()), class.as_type_ptr()) != 0 }
}

/// A user object's error as "Type: message", for the note on what a walk skipped.
fn described(py: Python, error: &PyErr) -> String {
    let kind = error.get_type(py).name().map(|n| n.to_string()).unwrap_or_else(|_| "error".into());
    let message = error.value(py).str().map(|m| m.to_string()).unwrap_or_default();
    let first_line: String = message.lines().next().unwrap_or("").chars().take(120).collect();
    if first_line.is_empty() {
        kind
    } else {
        format!("{kind}: {first_line}")
    }
}

/// Objects that refer to nothing worth following.
fn is_atomic(object: &Bound<PyAny>) -> bool {
    object.is_none()
        || object.is_instance_of::<PyString>()
        || object.is_instance_of::<pyo3::types::PyBytes>()
        || object.is_instance_of::<pyo3::types::PyInt>()
        || object.is_instance_of::<pyo3::types::PyFloat>()
        || object.is_instance_of::<pyo3::types::PyBool>()
}

/// Every tensor storage in `memory` that Python can see, from the collector's list of
/// objects: the buffers a walk should find. Arrays are not tracked by the collector.
fn live_tensor_buffers(py: Python, memory: &Memory) -> PyResult<HashMap<Buffer, u64>> {
    let mut buffers = HashMap::new();
    let Some(tensor_type) = Types::new(py)?.tensor else { return Ok(buffers) };
    let objects = py.import("gc")?.call_method0("get_objects")?.cast_into::<PyList>()?;
    for object in objects.iter() {
        if type_is(&object, &tensor_type) {
            if let Ok(Some((buffer, bytes, _))) = tensor_buffer(&object, memory) {
                buffers.insert(buffer, bytes);
            }
        }
    }
    Ok(buffers)
}

/// The roots, most recognisable first: the caller's (notebook names, Out, the traceback), then
/// every module's globals, the user's own modules before libraries.
fn module_roots<'py>(py: Python<'py>) -> PyResult<Vec<(String, Bound<'py, PyAny>)>> {
    let sys = py.import("sys")?;
    let prefixes: Vec<String> = ["prefix", "base_prefix", "exec_prefix"]
        .iter()
        .filter_map(|name| sys.getattr(*name).ok()?.extract().ok())
        .collect();
    let mut user = Vec::new();
    let mut library = Vec::new();
    let modules = sys.getattr("modules")?.call_method0("copy")?.cast_into::<PyDict>()?;
    for (name, module) in modules.iter() {
        let name = name.to_string();
        let Ok(module) = module.cast::<PyModule>() else { continue };
        if name == "__main__" {
            continue;
        }
        // The module's own dict, read without attribute access: a lazy module's
        // `__getattribute__` would import it.
        let globals = module.dict();
        let file: Option<String> = globals.get_item("__file__").ok().flatten().and_then(|f| f.extract().ok());
        let is_library = match &file {
            Some(file) => prefixes.iter().any(|p| file.starts_with(p.as_str())) || file.contains("-packages"),
            None => true,
        };
        let target = if is_library { &mut library } else { &mut user };
        for (key, value) in globals.iter() {
            let key = key.to_string();
            if !key.starts_with("__") {
                target.push((format!("{name}.{key}"), value));
            }
        }
    }
    user.extend(library);
    Ok(user)
}

/// What a walk from roots a person recognises reached in `memory`.
pub struct Survey<'py> {
    /// Every buffer found outside `exclude`, with what holds it, largest first.
    pub held: Vec<(Buffer, Holder)>,
    /// Every live tensor storage in `memory` that Python can see, reachable or not.
    pub live: HashMap<Buffer, u64>,
    /// Modules and optimizers reached on the way.
    pub owners: Vec<Bound<'py, PyAny>>,
    pub objects_visited: u64,
    /// Objects the walk could not inspect.
    pub skipped: Uninspectable,
}

impl Survey<'_> {
    /// Bytes of live tensors outside `exclude` that no root reaches.
    pub fn unreachable(&self, exclude: &HashSet<Buffer>) -> u64 {
        let reached: HashSet<&Buffer> = self.held.iter().map(|(buffer, _)| buffer).collect();
        self.live.iter().filter(|(b, _)| !exclude.contains(b) && !reached.contains(b)).map(|(_, bytes)| bytes).sum()
    }
}

/// Walks from `roots`, then every module's globals, to every tensor (and, on the host, every
/// array) in `memory`; `exclude` are buffers that existed before (an experiment's start).
pub fn survey<'py>(
    py: Python<'py>,
    memory: &Memory,
    roots: Vec<(String, Bound<'py, PyAny>)>,
    exclude: &HashSet<Buffer>,
) -> PyResult<Survey<'py>> {
    // Some library globals warn on any attribute access (deprecated aliases); a hunt is not the user's code.
    let warnings = py.import("warnings")?;
    let quiet = warnings.call_method0("catch_warnings")?;
    quiet.call_method0("__enter__")?;
    warnings.call_method1("simplefilter", ("ignore",))?;
    let result = survey_quietly(py, memory, roots, exclude);
    quiet.call_method1("__exit__", (py.None(), py.None(), py.None()))?;
    result
}

fn survey_quietly<'py>(
    py: Python<'py>,
    memory: &Memory,
    roots: Vec<(String, Bound<'py, PyAny>)>,
    exclude: &HashSet<Buffer>,
) -> PyResult<Survey<'py>> {
    let live = live_tensor_buffers(py, memory)?;
    let wanted: HashSet<Buffer> = live.keys().copied().filter(|b| !exclude.contains(b)).collect();
    let mut walk = Walk::new(py, memory.clone())?;
    let roots = roots.into_iter().chain(module_roots(py)?);
    for (label, object) in roots {
        walk.push(object, None, PathEdge::Root(label));
    }
    // Arrays are not known in advance, so a host hunt walks everything it can reach.
    let host = *memory == Memory::Host;
    walk.run(|found| !host && wanted.iter().all(|b| found.contains_key(b)))?;
    let mut held: Vec<(Buffer, Holder)> = walk
        .found
        .iter()
        .filter(|(buffer, _)| !exclude.contains(buffer))
        .map(|(buffer, found)| {
            let holder = Holder {
                path: walk.path(found.node),
                bytes: found.bytes,
                device: found.device.clone(),
                kind: found.kind.into(),
                shape: found.shape.clone(),
            };
            (*buffer, holder)
        })
        .collect();
    held.sort_by(|(_, a), (_, b)| b.bytes.cmp(&a.bytes).then_with(|| a.path.cmp(&b.path)));
    Ok(Survey { held, live, owners: walk.owners, objects_visited: walk.nodes.len() as u64, skipped: walk.skipped })
}

/// Finds what holds the memory of `memory`, largest first; `exclude` are buffers that existed
/// before (an experiment's start), `min_bytes` the smallest worth naming. Also returns the
/// bytes of every live Python tensor there, for what no Python tensor accounts for.
pub fn hunt<'py>(
    py: Python<'py>,
    memory: Memory,
    roots: Vec<(String, Bound<'py, PyAny>)>,
    min_bytes: u64,
    exclude: &HashSet<Buffer>,
) -> PyResult<(Holders, u64)> {
    let started = Instant::now();
    let survey = survey(py, &memory, roots, exclude)?;
    let roles = tensor_roles(&survey, &memory, exclude)?;
    let unreachable = survey.unreachable(exclude);
    let python_bytes = survey.live.values().sum();
    let holders = Holders {
        device: memory.label(),
        holders: survey.held.into_iter().map(|(_, holder)| holder).filter(|h| h.bytes >= min_bytes).collect(),
        unreachable,
        no_python_tensor: None,
        cached: None,
        roles: (roles.total() > 0).then_some(roles),
        objects_visited: survey.objects_visited,
        seconds: started.elapsed().as_secs_f64(),
        notes: survey.skipped.note().into_iter().collect(),
    };
    Ok((holders, python_bytes))
}

/// The buffers reachable from `roots` now (an experiment's start), so that a later hunt names
/// only what came after, and what the walk could not inspect. Module globals are left out:
/// they are walked at the hunt.
pub fn inventory<'py>(
    py: Python<'py>,
    roots: Vec<(String, Bound<'py, PyAny>)>,
) -> PyResult<(HashSet<Buffer>, Uninspectable)> {
    let walk = walk_everything(py, roots)?;
    Ok((walk.found.keys().copied().collect(), walk.skipped))
}

/// The modules and optimizers reachable from `roots` (a step and what it refers to); module
/// globals are left out.
pub fn reachable_owners<'py>(
    py: Python<'py>,
    roots: Vec<(String, Bound<'py, PyAny>)>,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    Ok(walk_everything(py, roots)?.owners)
}

fn walk_everything<'py>(py: Python<'py>, roots: Vec<(String, Bound<'py, PyAny>)>) -> PyResult<Walk<'py>> {
    let mut walk = Walk::new(py, Memory::Any)?;
    for (label, object) in roots {
        walk.push(object, None, PathEdge::Root(label));
    }
    walk.run(|_| false)?;
    Ok(walk)
}
/// Where a leak hunt starts: the notebook's names, then IPython's hidden references.
pub(super) fn hunt_roots<'py>(adapter: &Bound<'py, PyAny>) -> PyResult<Vec<(String, Bound<'py, PyAny>)>> {
    let mut roots = user_names(adapter)?;
    roots.sort_by(|a, b| a.0.cmp(&b.0));
    roots.extend(hidden_refs(adapter)?);
    Ok(roots)
}

pub(super) fn tensors_or_arrays_imported(py: Python) -> bool {
    let Ok(modules) = py.import("sys").and_then(|sys| sys.getattr("modules")) else { return false };
    ["torch", "numpy"].iter().any(|name| modules.contains(*name).unwrap_or(false))
}

/// Names what still holds memory the scope created, where its end shows memory not back.
pub(super) fn hunt_leaks(
    py: Python,
    report: &Report,
    adapter: Option<&Bound<PyAny>>,
    before: &HashSet<Buffer>,
) -> PyResult<Vec<Holders>> {
    const GPU_SLACK: i64 = 1 << 20;
    const HOST_SLACK: i64 = 64 << 20;
    let Some(adapter) = adapter else { return Ok(Vec::new()) };
    if !tensors_or_arrays_imported(py) {
        return Ok(Vec::new());
    }
    let kept_above_start =
        |m: &report::Metric, slack: i64| m.end.is_some_and(|end| end as i64 - m.start as i64 >= slack);
    let mut memories: Vec<Memory> = report
        .gpus
        .iter()
        .filter(|gpu| gpu.torch_allocated.as_ref().is_some_and(|m| kept_above_start(m, GPU_SLACK)))
        .map(|gpu| Memory::Cuda(gpu.torch_index))
        .collect();
    if kept_above_start(&report.host.rss, HOST_SLACK) {
        memories.push(Memory::Host);
    }
    let mut found = Vec::new();
    for memory in memories {
        let (holders, _) = hunt(py, memory, hunt_roots(adapter)?, 1 << 20, before)?;
        if !holders.holders.is_empty() || holders.unreachable > 0 {
            found.push(holders);
        }
    }
    Ok(found)
}

/// What holds memory on a GPU (by torch index) or the host, largest first.
#[pyfunction]
#[pyo3(signature = (memory, min_bytes, adapter=None))]
pub(super) fn holders(
    py: Python,
    memory: Option<u32>,
    min_bytes: u64,
    adapter: Option<Bound<PyAny>>,
) -> PyResult<HoldersPy> {
    let memory = match memory {
        Some(index) => Memory::Cuda(index),
        None => Memory::Host,
    };
    if let Memory::Cuda(index) = memory {
        // An empty table for a GPU that isn't there would read as "nothing holds memory".
        let visible: Vec<u32> =
            take_snapshot(py, &GpuSelection::AllVisible).0.gpus.iter().map(|g| g.torch_index).collect();
        if !visible.contains(&index) {
            let fix = if visible.is_empty() {
                "This machine has no GPU that NVML can see: use device='cpu' for host memory.".to_string()
            } else {
                format!("Visible GPUs (torch indices): {visible:?}; name one of them, or device='cpu'.")
            };
            return Err(PyValueError::new_err(format!("holders(device='cuda:{index}'): no such GPU. {fix}")));
        }
    }
    let roots = match &adapter {
        Some(a) => hunt_roots(a)?,
        None => Vec::new(),
    };
    let (mut found, python_bytes) = hunt(py, memory.clone(), roots, min_bytes, &HashSet::new())?;
    if let Memory::Cuda(index) = memory {
        let torch = PyTorch::find(py);
        if torch.cuda().is_some() {
            if let Ok(stats) = torch.read_stats(index) {
                found.no_python_tensor = Some(stats.allocated.saturating_sub(python_bytes));
                found.cached = Some(stats.reserved.saturating_sub(stats.allocated));
            }
        }
    }
    Ok(HoldersPy(found))
}

/// Each storage in `memory` that a module or optimizer of `owners` holds, with its role and bytes.
pub(super) fn roles_of(py: Python, owners: &[Bound<PyAny>], memory: &Memory) -> PyResult<HashMap<Buffer, (Role, u64)>> {
    let mut roles = HashMap::new();
    let Some(torch) = PyTorch::find(py).torch else { return Ok(roles) };
    let tensor = torch.getattr("Tensor")?;
    let mut note = |value: &Bound<PyAny>, role: Role| -> PyResult<()> {
        if !value.is_instance(&tensor)? {
            return Ok(());
        }
        if let Some((buffer, bytes, _)) = tensor_buffer(value, memory)? {
            let (known, _) = roles.entry(buffer).or_insert((role, bytes));
            *known = role.min(*known);
        }
        Ok(())
    };
    let parameter = |value: &Bound<PyAny>, note: &mut dyn FnMut(&Bound<PyAny>, Role) -> PyResult<()>| {
        note(value, Role::Parameter)?;
        if let Ok(grad) = value.getattr("grad") {
            note(&grad, Role::Gradient)?;
        }
        Ok::<(), PyErr>(())
    };
    for owner in owners {
        if let (Ok(parameters), Ok(buffers)) = (owner.getattr("_parameters"), owner.getattr("_buffers")) {
            for value in parameters.cast::<PyDict>()?.values() {
                parameter(&value, &mut note)?;
            }
            for value in buffers.cast::<PyDict>()?.values() {
                note(&value, Role::Buffer)?;
            }
            continue;
        }
        for group in owner.getattr("param_groups")?.try_iter()? {
            if let Some(params) = group?.cast::<PyDict>()?.get_item("params")? {
                for value in params.try_iter()? {
                    parameter(&value?, &mut note)?;
                }
            }
        }
        for values in owner.getattr("state")?.cast::<PyDict>()?.values() {
            if let Ok(values) = values.cast::<PyDict>() {
                for value in values.values() {
                    note(&value, Role::OptimizerState)?;
                }
            }
        }
    }
    Ok(roles)
}

/// Bytes by role of every tensor (and array) the survey saw outside `exclude`: each storage once.
pub(super) fn sum_roles(
    survey: &Survey,
    roles: &HashMap<Buffer, (Role, u64)>,
    exclude: &HashSet<Buffer>,
) -> TensorRoles {
    let mut sums = TensorRoles::default();
    let mut counted = HashSet::new();
    for (buffer, (role, bytes)) in roles {
        if !exclude.contains(buffer) && counted.insert(*buffer) {
            sums.add(Some(*role), *bytes);
        }
    }
    for (buffer, holder) in &survey.held {
        if counted.insert(*buffer) {
            sums.add(None, holder.bytes);
        }
    }
    for (buffer, bytes) in &survey.live {
        if !exclude.contains(buffer) && counted.insert(*buffer) {
            sums.add(None, *bytes);
        }
    }
    sums
}

/// What the tensors a survey found are to training: the breakdown a leak report shows.
pub(super) fn tensor_roles(survey: &Survey, memory: &Memory, exclude: &HashSet<Buffer>) -> PyResult<TensorRoles> {
    let py = match survey.owners.first() {
        Some(owner) => owner.py(),
        None => return Ok(sum_roles(survey, &HashMap::new(), exclude)),
    };
    Ok(sum_roles(survey, &roles_of(py, &survey.owners, memory)?, exclude))
}
