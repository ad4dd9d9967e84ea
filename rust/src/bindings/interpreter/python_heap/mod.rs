//! The Python objects a leak hunt walks, as the core's [`Heap`]: what each object is and what it
//! refers to. Types are classified once per hunt. Objects are read through the interpreter's
//! own slots (dict and list storage, frames' locals, closures, `gc.get_referents`) and never
//! through a user's `__repr__`; modules are never touched, so a lazy module is not imported.
//! References the collector does not report are read where they live: an `lru_cache`'s
//! entries, an autograd graph's saved tensors.

use std::collections::HashMap;
use std::rc::Rc;

use pyo3::exceptions::{PyAttributeError, PyKeyError, PyReferenceError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple, PyType, PyWeakrefMethods, PyWeakrefProxy};

use crate::holders_walk::{Edge, Heap, Kind, Memory, Name, Refs, Unreadable};

mod buffers;
mod elements;
mod lru_cache;

pub(in crate::bindings) use buffers::tensor_piece;
use buffers::{array_piece, shape_text};
use elements::Table;

pub(in crate::bindings) enum Collected {
    Tensor,
    Suspended,
    Other,
}

#[derive(Clone)]
enum Class {
    /// Refers to nothing worth following: numbers, strings, code, descriptors, weak references.
    Atomic,
    /// A `weakref.proxy`: it holds nothing either, but a dead one raises on any use, so it is
    /// looked at, to be counted among the objects that could not be inspected.
    Proxy,
    Dict,
    List,
    Tuple,
    /// Sets and deques: followed by iteration.
    Iterable,
    /// A module (its globals are roots of their own) or a builtin type.
    Leaf,
    Tensor,
    Array,
    Traceback,
    Frame,
    Function,
    Method,
    Cell,
    /// A generator, coroutine or async generator: its frame and what it awaits.
    Suspendable {
        frame: &'static str,
        awaits: &'static str,
    },
    LruCache,
    /// An autograd function: the attributes that hold what it saved.
    GradFn(Rc<Vec<Py<PyString>>>),
    /// What an autograd function saved, as autograd keeps it.
    SavedTensor,
    /// A class: its own attributes, if it was defined in Python.
    Type,
    /// An instance of a class defined in Python: its `__dict__` and slots, and a pandas
    /// table's elements first.
    Instance {
        slots: Rc<Vec<Py<PyString>>>,
        owner: bool,
        table: Option<Table>,
    },
    /// A type written in C: whatever `gc.get_referents` reports.
    Other(Rc<str>),
}

/// The types the walk tells apart, looked up once per hunt; torch, numpy and pandas only if imported.
struct Known<'py> {
    atomic: Vec<Bound<'py, PyAny>>,
    proxies: Vec<Bound<'py, PyAny>>,
    dict: Bound<'py, PyAny>,
    list: Bound<'py, PyAny>,
    tuple: Bound<'py, PyAny>,
    iterable: Vec<Bound<'py, PyAny>>,
    module: Bound<'py, PyAny>,
    type_: Bound<'py, PyAny>,
    exact: Vec<(Bound<'py, PyAny>, Class)>,
    lru_cache: Option<Bound<'py, PyAny>>,
    tensor: Option<Bound<'py, PyAny>>,
    ndarray: Option<Bound<'py, PyAny>>,
    series: Option<Bound<'py, PyAny>>,
    dataframe: Option<Bound<'py, PyAny>>,
    grad_fn: Option<Bound<'py, PyAny>>,
    saved_tensor: Option<Bound<'py, PyAny>>,
    owners: Vec<Bound<'py, PyAny>>,
    /// `gpuexp.heap_types.slot_names`: a class's slots, across its bases.
    slot_names: Bound<'py, PyAny>,
    /// `gpuexp.heap_types.saved_names`: where an autograd function keeps what it saved.
    saved_names: Bound<'py, PyAny>,
}

impl<'py> Known<'py> {
    /// As `gpuexp.heap_types` finds them.
    fn new(py: Python<'py>) -> PyResult<Known<'py>> {
        let module = py.import("gpuexp.heap_types")?;
        let types = module.call_method0("heap_types")?.cast_into::<PyDict>()?;
        let get = |name: &str| -> PyResult<Bound<'py, PyAny>> {
            types.get_item(name)?.ok_or_else(|| PyKeyError::new_err(name.to_string()))
        };
        let maybe =
            |name: &str| -> PyResult<Option<Bound<'py, PyAny>>> { Ok(Some(get(name)?).filter(|t| !t.is_none())) };
        let suspendable = |frame, awaits| Class::Suspendable { frame, awaits };
        let mut exact = Vec::new();
        for (class, what) in get("exact")?.extract::<Vec<(Bound<PyAny>, String)>>()? {
            exact.push((
                class,
                match what.as_str() {
                    "traceback" => Class::Traceback,
                    "frame" => Class::Frame,
                    "function" => Class::Function,
                    "method" => Class::Method,
                    "cell" => Class::Cell,
                    "generator" => suspendable("gi_frame", "gi_yieldfrom"),
                    "coroutine" => suspendable("cr_frame", "cr_await"),
                    _ => suspendable("ag_frame", "ag_await"),
                },
            ));
        }
        Ok(Known {
            atomic: get("atomic")?.extract()?,
            proxies: get("proxies")?.extract()?,
            dict: get("dict")?,
            list: get("list")?,
            tuple: get("tuple")?,
            iterable: get("iterable")?.extract()?,
            module: get("module")?,
            type_: get("type")?,
            exact,
            lru_cache: maybe("lru_cache")?,
            tensor: maybe("tensor")?,
            ndarray: maybe("ndarray")?,
            series: maybe("series")?,
            dataframe: maybe("dataframe")?,
            grad_fn: maybe("grad_fn")?,
            saved_tensor: maybe("saved_tensor")?,
            owners: get("owners")?.extract()?,
            slot_names: module.getattr("slot_names")?,
            saved_names: module.getattr("saved_names")?,
        })
    }
}

/// The walk's view of the Python heap during one hunt.
pub(in crate::bindings) struct PythonHeap<'py> {
    py: Python<'py>,
    known: Known<'py>,
    memory: Memory,
    classes: HashMap<usize, Class>,
    get_referents: Bound<'py, PyAny>,
    object_type: Bound<'py, PyAny>,
    /// How many elements the object being looked at holds, where it gave only some (see `elements`).
    unread: Option<u64>,
}

impl<'py> PythonHeap<'py> {
    pub(in crate::bindings) fn new(py: Python<'py>, memory: Memory) -> PyResult<PythonHeap<'py>> {
        Ok(PythonHeap {
            py,
            known: Known::new(py)?,
            memory,
            classes: HashMap::new(),
            get_referents: py.import("gc")?.getattr("get_referents")?,
            object_type: py.import("builtins")?.getattr("object")?,
            unread: None,
        })
    }

    /// Whether the collector's `object` is a tensor, or a generator or coroutine paused at a
    /// `yield` or an `await` (not running, not finished). By its type: never its `__class__`.
    pub(in crate::bindings) fn collected(&mut self, object: &Bound<'py, PyAny>) -> Collected {
        match self.class(object) {
            Class::Tensor => Collected::Tensor,
            Class::Suspendable { frame, .. } if object.getattr(frame).is_ok_and(|f| !f.is_none()) => {
                Collected::Suspended
            }
            _ => Collected::Other,
        }
    }

    fn class(&mut self, object: &Bound<'py, PyAny>) -> Class {
        let class = object.get_type();
        let address = class.as_ptr() as usize;
        if let Some(known) = self.classes.get(&address) {
            return known.clone();
        }
        let found = self.classify(&class).unwrap_or_else(|_| Class::Other("object".into()));
        self.classes.insert(address, found.clone());
        found
    }

    fn classify(&self, class: &Bound<'py, PyType>) -> PyResult<Class> {
        let k = &self.known;
        let is = |base: &Option<Bound<'py, PyAny>>| {
            base.as_ref().is_some_and(|b| b.cast::<PyType>().is_ok_and(|b| class.is_subclass(b).unwrap_or(false)))
        };
        let sub = |base: &Bound<'py, PyAny>| is(&Some(base.clone()));
        if k.atomic.iter().any(|a| class.is(a)) || k.atomic.iter().any(sub) {
            return Ok(Class::Atomic);
        }
        if k.proxies.iter().any(|p| class.is(p)) {
            return Ok(Class::Proxy);
        }
        if let Some((_, found)) = k.exact.iter().find(|(t, _)| class.is(t)) {
            return Ok(found.clone());
        }
        Ok(if is(&k.tensor) {
            Class::Tensor
        } else if is(&k.ndarray) {
            Class::Array
        } else if sub(&k.module) {
            Class::Leaf
        } else if sub(&k.dict) {
            Class::Dict
        } else if sub(&k.list) {
            Class::List
        } else if sub(&k.tuple) {
            Class::Tuple
        } else if k.iterable.iter().any(sub) {
            Class::Iterable
        } else if sub(&k.type_) {
            Class::Type
        } else if k.lru_cache.as_ref().is_some_and(|t| class.is(t)) {
            Class::LruCache
        } else if is(&k.grad_fn) {
            Class::GradFn(Rc::new(k.saved_names.call1((class,))?.extract()?))
        } else if k.saved_tensor.as_ref().is_some_and(|t| class.is(t)) {
            Class::SavedTensor
        } else if is_heap_type(class) {
            let table = if is(&k.dataframe) { Some(Table::DataFrame) } else { is(&k.series).then_some(Table::Series) };
            Class::Instance {
                slots: Rc::new(k.slot_names.call1((class,))?.extract()?),
                owner: k.owners.iter().any(sub),
                table,
            }
        } else {
            Class::Other(class.name()?.to_string().into())
        })
    }

    /// Appends `child` unless it refers to nothing.
    fn add(&mut self, refs: &mut Refs<Bound<'py, PyAny>>, edge: Edge<Bound<'py, PyAny>>, child: Bound<'py, PyAny>) {
        if !child.is_none() && !matches!(self.class(&child), Class::Atomic) {
            refs.push((edge, child));
        }
    }

    fn add_items(
        &mut self,
        refs: &mut Refs<Bound<'py, PyAny>>,
        mapping: &Bound<'py, PyAny>,
        local: bool,
    ) -> PyResult<()> {
        let edge =
            |name: Bound<'py, PyAny>| if local { Edge::Local(Name::Of(name)) } else { Edge::Attr(Name::Of(name)) };
        if let Ok(dict) = mapping.cast::<PyDict>() {
            for (name, value) in dict.iter() {
                self.add(refs, edge(name), value);
            }
            return Ok(());
        }
        for item in mapping.call_method0("items")?.try_iter()? {
            let (name, value): (Bound<PyAny>, Bound<PyAny>) = item?.extract()?;
            self.add(refs, edge(name), value);
        }
        Ok(())
    }

    fn look_object(&mut self, object: &Bound<'py, PyAny>, refs: &mut Refs<Bound<'py, PyAny>>) -> PyResult<Kind> {
        let attr = |name: &'static str| Edge::Attr(Name::Fixed(name));
        match self.class(object) {
            Class::Atomic | Class::Leaf => return Ok(Kind::Leaf),
            Class::Proxy => {
                return match object.cast::<PyWeakrefProxy>()?.upgrade() {
                    Some(_) => Ok(Kind::Leaf),
                    None => Err(PyReferenceError::new_err("weakly-referenced object no longer exists")),
                }
            }
            Class::Dict => {
                for (key, value) in object.cast::<PyDict>()?.iter() {
                    self.add(refs, Edge::Key(key), value);
                }
            }
            Class::List => {
                for (i, item) in object.cast::<PyList>()?.iter().enumerate() {
                    self.add(refs, Edge::Index(i), item);
                }
            }
            Class::Tuple => {
                for (i, item) in object.cast::<PyTuple>()?.iter().enumerate() {
                    self.add(refs, Edge::Index(i), item);
                }
            }
            Class::Iterable => {
                for (i, item) in object.try_iter()?.enumerate() {
                    self.add(refs, Edge::Index(i), item?);
                }
            }
            Class::Tensor => {
                self.add(refs, attr("grad"), object.getattr("grad")?);
                self.add(refs, Edge::Backward(Name::Fixed("grad_fn")), object.getattr("grad_fn")?);
                if let Ok(Some(piece)) = tensor_piece(object, &self.memory) {
                    return Ok(Kind::Buffer(piece));
                }
            }
            Class::Array => {
                self.object_array_elements(object, refs)?;
                let base = object.getattr("base")?;
                if matches!(self.class(&base), Class::Array) {
                    self.add(refs, attr("base"), base);
                } else if !matches!(self.memory, Memory::Cuda(_)) {
                    return Ok(Kind::Buffer(array_piece(object)));
                }
            }
            Class::Traceback => {
                let mut tb = Some(object.clone());
                while let Some(current) = tb.filter(|t| !t.is_none()) {
                    let frame = current.getattr("tb_frame")?;
                    let line = current.getattr("tb_lineno")?.extract::<u32>().unwrap_or(0);
                    refs.push((Edge::Frame(frame_label(&frame, line)), frame));
                    tb = current.getattr("tb_next").ok();
                }
            }
            Class::Frame => {
                let locals = object.getattr("f_locals")?;
                if locals.is(&object.getattr("f_globals")?) {
                    return Ok(Kind::Leaf); // a module's body: its globals are roots of their own
                }
                self.add_items(refs, &locals, true)?;
            }
            Class::Function => {
                let closure = object.getattr("__closure__")?;
                if !closure.is_none() {
                    let names = object.getattr("__code__")?.getattr("co_freevars")?;
                    for (name, cell) in names.try_iter()?.zip(closure.try_iter()?) {
                        if let Ok(contents) = cell?.getattr("cell_contents") {
                            self.add(refs, Edge::Closure(Name::Of(name?)), contents);
                        }
                    }
                }
                self.add(refs, attr("__defaults__"), object.getattr("__defaults__")?);
                self.add(refs, attr("__kwdefaults__"), object.getattr("__kwdefaults__")?);
                self.add_items(refs, &object.getattr("__dict__")?, false)?;
            }
            Class::Method => {
                self.add(refs, attr("__self__"), object.getattr("__self__")?);
                self.add(refs, attr("__func__"), object.getattr("__func__")?);
            }
            Class::Cell => {
                if let Ok(contents) = object.getattr("cell_contents") {
                    self.add(refs, attr("cell_contents"), contents);
                }
            }
            Class::Suspendable { frame, awaits } => {
                let frame = object.getattr(frame)?;
                if !frame.is_none() {
                    refs.push((Edge::Frame(frame_here(&frame)?), frame));
                }
                self.add(refs, attr(awaits), object.getattr(awaits)?);
            }
            Class::LruCache => self.look_lru_cache(object, refs)?,
            // Its `data` is what was saved, as packed: never unpacked, so no saved-tensor hook
            // runs (a checkpoint's would recompute the forward, an offload's copy back to the
            // GPU). None once the graph ran backward; absent in a torch too old to tell.
            Class::SavedTensor => {
                if let Ok(data) = object.getattr("data") {
                    self.add(refs, Edge::Backward(Name::Fixed("data")), data);
                }
            }
            Class::GradFn(names) => {
                for name in names.iter() {
                    if let Ok(saved) = object.getattr(name.bind(self.py)) {
                        self.add(refs, Edge::Backward(Name::Of(name.bind(self.py).clone().into_any())), saved);
                    }
                }
                if let Ok(next) = object.getattr("next_functions") {
                    for pair in next.try_iter()? {
                        self.add(refs, Edge::Backward(Name::Fixed("next_functions")), pair?.get_item(0)?);
                    }
                }
                if let Ok(context) = object.getattr("__dict__") {
                    self.add_items(refs, &context, false)?; // a custom Function's ctx attributes
                }
            }
            Class::Type => {
                if is_heap_type(object.cast::<PyType>()?) {
                    self.add_items(refs, &object.getattr("__dict__")?, false)?;
                }
            }
            Class::Instance { slots, owner, table } => {
                if let Some(table) = table {
                    self.table_elements(table, object, refs)?;
                }
                match object.getattr("__dict__") {
                    Ok(attributes) => self.add_items(refs, &attributes, false)?,
                    // Without a `__dict__` it has only slots; any other error is the object's own.
                    Err(error) if error.is_instance_of::<PyAttributeError>(self.py) => {}
                    Err(error) => return Err(error),
                }
                for slot in slots.iter() {
                    if let Ok(value) = object.getattr(slot.bind(self.py)) {
                        self.add(refs, Edge::Attr(Name::Of(slot.bind(self.py).clone().into_any())), value);
                    }
                }
                if owner {
                    return Ok(Kind::Owner);
                }
            }
            Class::Other(holder) => {
                for referent in self.get_referents.call1((object,))?.cast::<PyList>()?.iter() {
                    if !referent.is_instance_of::<PyType>() {
                        self.add(refs, Edge::Referent(holder.to_string()), referent);
                    }
                }
            }
        }
        Ok(Kind::Plain)
    }

    /// A value as a person reads it, never by running its own `__repr__`.
    fn short(&self, value: &Bound<'py, PyAny>) -> String {
        let type_name = || format!("<{}>", value.get_type().name().map(|n| n.to_string()).unwrap_or_default());
        let tensor = self.known.tensor.as_ref().and_then(|t| t.cast::<PyType>().ok());
        if tensor.is_some_and(|t| value.get_type().is_subclass(t).unwrap_or(false)) {
            return format!("<tensor {}>", value.getattr("shape").map(|s| shape_text(&s)).unwrap_or_default());
        }
        let plain = value.is_none() || self.known.atomic.iter().any(|t| value.get_type().is(t));
        if !plain {
            return type_name();
        }
        match value.repr().map(|text| text.to_string()) {
            Ok(text) if text.len() <= 40 => text,
            _ => type_name(),
        }
    }
}

impl<'py> Heap for PythonHeap<'py> {
    type Object = Bound<'py, PyAny>;

    fn address(&self, object: &Bound<'py, PyAny>) -> usize {
        object.as_ptr() as usize
    }

    fn look(&mut self, object: &Bound<'py, PyAny>, refs: &mut Refs<Bound<'py, PyAny>>) -> Result<Kind, Unreadable> {
        self.unread = None;
        self.look_object(object, refs).map_err(|_| Unreadable)
    }

    fn elements_left_unread(&mut self) -> Option<u64> {
        self.unread.take()
    }

    fn text(&self, name: &Bound<'py, PyAny>) -> String {
        match name.cast::<PyString>() {
            Ok(text) => text.to_string(),
            Err(_) => self.short(name),
        }
    }

    fn is_plain(&self, key: &Bound<'py, PyAny>) -> bool {
        key.is_instance_of::<PyString>() || self.known.atomic.iter().any(|t| key.get_type().is(t))
    }

    fn describe(&self, key: &Bound<'py, PyAny>) -> String {
        self.short(key)
    }

    fn call(&self, key: &Bound<'py, PyAny>) -> String {
        self.cache_call(key)
    }

    fn type_name(&self, container: &Bound<'py, PyAny>) -> String {
        container.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "container".into())
    }
}

/// "worker(), line 4".
fn frame_label(frame: &Bound<PyAny>, line: u32) -> String {
    let name = frame.getattr("f_code").and_then(|c| c.getattr("co_name")).map(|n| n.to_string()).unwrap_or_default();
    format!("{name}(), line {line}")
}

/// "worker(), line 4", at the line `frame` is on now.
pub(in crate::bindings) fn frame_here(frame: &Bound<PyAny>) -> PyResult<String> {
    Ok(frame_label(frame, frame.getattr("f_lineno")?.extract::<u32>().unwrap_or(0)))
}

/// Whether Python defined `class` (its instances have a `__dict__` or slots to read).
pub(in crate::bindings) fn is_heap_type(class: &Bound<PyType>) -> bool {
    const HEAP_TYPE: u64 = 1 << 9;
    class.getattr("__flags__").and_then(|f| f.extract::<u64>()).is_ok_and(|flags| flags & HEAP_TYPE != 0)
}
