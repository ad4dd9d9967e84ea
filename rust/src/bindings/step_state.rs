//! What a step reaches besides the model's tensors and the optimizers' state: a GradScaler, an
//! LR scheduler, an EMA copy, a metric accumulator, any attribute or container it assigns to.
//! Run under fake tensors, the step would leave fakes there (and a scheduler advanced), and the
//! next real step would fail on them. So every container reachable from the step is copied,
//! shallowly, before the estimate, and put back after it where it changed; then the same walk
//! looks for fakes still reachable, and names them.

use std::collections::HashSet;

use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyBytes, PyDict, PyFloat, PyFrozenSet, PyInt, PyList, PyModule, PySet, PyString, PyTuple, PyType,
};

/// Objects a walk starts from, each with the name a person knows it by.
pub(super) type Roots<'py> = Vec<(String, Bound<'py, PyAny>)>;

/// A global name a step assigns to, and the namespace it is in.
pub(super) type AssignedGlobal<'py> = (Bound<'py, PyDict>, String);

/// Enough for a large model's modules and the step's own objects; a walk that stops says so.
const MOST_OBJECTS: usize = 200_000;
/// Longer containers are saved and put back whole, but their items are not walked.
const MOST_ITEMS_WALKED: usize = 10_000;
const MOST_NAMED: usize = 5;

/// A container as it was before the step, by the identity of what it held.
enum Saved<'py> {
    /// A dict, or an object's `__dict__`.
    Dict(Bound<'py, PyDict>, Bound<'py, PyDict>),
    List(Bound<'py, PyList>, Bound<'py, PyList>),
    /// A set (refilled with `update`) or a deque (with `extend`): neither is assigned in place.
    Refilled {
        container: Bound<'py, PyAny>,
        items: Bound<'py, PyList>,
        refill: &'static str,
    },
    /// A global name the step assigns to, and its value before (None: it did not exist).
    Global {
        globals: Bound<'py, PyDict>,
        name: String,
        before: Option<Bound<'py, PyAny>>,
    },
}

/// One object the walk reached, and how: the path to it is rendered only when it is named.
struct Node<'py> {
    object: Bound<'py, PyAny>,
    parent: Option<usize>,
    edge: Edge<'py>,
}

/// How an object was reached from its parent. Rendered only for a path that is named: a key
/// may be a tensor (an optimizer's state is keyed by parameters), whose repr reads the device.
enum Edge<'py> {
    Root(String),
    Attribute(Bound<'py, PyAny>),
    Key(Bound<'py, PyAny>),
    Index(usize),
    Closure(Bound<'py, PyAny>),
    MethodSelf,
}

impl Edge<'_> {
    fn render(&self) -> String {
        let plain = |key: &Bound<PyAny>| key.is_instance_of::<PyString>() || key.is_instance_of::<PyInt>();
        match self {
            Edge::Root(name) => name.clone(),
            Edge::Attribute(name) => format!(".{name}"),
            Edge::Key(key) if plain(key) => format!("[{}]", key.repr().map(|r| r.to_string()).unwrap_or_default()),
            Edge::Key(key) => format!("[<{}>]", key.get_type().name().map(|n| n.to_string()).unwrap_or_default()),
            Edge::Index(index) => format!("[{index}]"),
            Edge::Closure(name) => format!(" (closure {name})"),
            Edge::MethodSelf => ".__self__".into(),
        }
    }
}

/// The types the walk treats specially, looked up once.
struct Kinds<'py> {
    tensor: Bound<'py, PyType>,
    fake: Bound<'py, PyType>,
    function: Bound<'py, PyType>,
    method: Bound<'py, PyType>,
    deque: Bound<'py, PyType>,
    scaler: Option<Bound<'py, PyType>>,
}

impl<'py> Kinds<'py> {
    fn find(py: Python<'py>) -> PyResult<Kinds<'py>> {
        let torch = py.import("sys")?.getattr("modules")?.get_item("torch")?;
        let types = py.import("types")?;
        let scaler = py.import("torch.amp.grad_scaler").and_then(|m| m.getattr("GradScaler")).ok();
        Ok(Kinds {
            tensor: torch.getattr("Tensor")?.cast_into()?,
            fake: py.import("torch._subclasses.fake_tensor")?.getattr("FakeTensor")?.cast_into()?,
            function: types.getattr("FunctionType")?.cast_into()?,
            method: types.getattr("MethodType")?.cast_into()?,
            deque: py.import("collections")?.getattr("deque")?.cast_into()?,
            scaler: scaler.and_then(|s| s.cast_into().ok()),
        })
    }
}

/// The walk from the step's roots, breadth-first, each object once.
struct Walk<'py> {
    nodes: Vec<Node<'py>>,
    partial: bool,
}

impl<'py> Walk<'py> {
    fn new(roots: &[(String, Bound<'py, PyAny>)], kinds: &Kinds<'py>, mut visit: impl FnMut(&Node<'py>)) -> Walk<'py> {
        let mut walk = Walk { nodes: Vec::new(), partial: false };
        let mut seen = HashSet::new();
        for (name, object) in roots {
            if seen.insert(object.as_ptr() as usize) {
                walk.nodes.push(Node { object: object.clone(), parent: None, edge: Edge::Root(name.clone()) });
            }
        }
        let mut next = 0;
        while next < walk.nodes.len() {
            visit(&walk.nodes[next]);
            for (edge, child) in children(&walk.nodes[next].object, kinds) {
                if walk.nodes.len() >= MOST_OBJECTS {
                    walk.partial = true;
                    break;
                }
                if seen.insert(child.as_ptr() as usize) {
                    walk.nodes.push(Node { object: child, parent: Some(next), edge });
                }
            }
            next += 1;
        }
        walk
    }

    fn path(&self, mut index: usize) -> String {
        let mut edges = Vec::new();
        loop {
            let node = &self.nodes[index];
            edges.push(node.edge.render());
            match node.parent {
                Some(parent) => index = parent,
                None => break,
            }
        }
        edges.reverse();
        edges.concat()
    }
}

fn is_atom(object: &Bound<PyAny>) -> bool {
    object.is_none()
        || object.is_instance_of::<PyBool>()
        || object.is_instance_of::<PyInt>()
        || object.is_instance_of::<PyFloat>()
        || object.is_instance_of::<PyString>()
        || object.is_instance_of::<PyBytes>()
        || object.is_instance_of::<PyModule>()
        || object.is_instance_of::<PyType>()
}

/// What an object holds that the step may have changed: a container's items, an object's
/// attributes, a function's closure, a bound method's object. Tensors, modules, classes and
/// plain values are leaves; the globals a function reads are roots already.
fn children<'py>(object: &Bound<'py, PyAny>, kinds: &Kinds<'py>) -> Vec<(Edge<'py>, Bound<'py, PyAny>)> {
    let mut found = Vec::new();
    if is_atom(object) || object.is_instance(&kinds.tensor).unwrap_or(true) {
        return found;
    }
    let items = |iterable: &Bound<'py, PyAny>, found: &mut Vec<(Edge<'py>, Bound<'py, PyAny>)>| {
        if iterable.len().unwrap_or(usize::MAX) > MOST_ITEMS_WALKED {
            return;
        }
        if let Ok(iterator) = iterable.try_iter() {
            found.extend(iterator.flatten().enumerate().map(|(i, item)| (Edge::Index(i), item)));
        }
    };
    if let Ok(dict) = object.cast::<PyDict>() {
        if dict.len() <= MOST_ITEMS_WALKED {
            found.extend(dict.iter().map(|(key, value)| (Edge::Key(key), value)));
        }
    } else if object.is_instance_of::<PyList>()
        || object.is_instance_of::<PyTuple>()
        || object.is_instance_of::<PySet>()
        || object.is_instance_of::<PyFrozenSet>()
        || object.is_instance(&kinds.deque).unwrap_or(false)
    {
        items(object, &mut found);
    } else if object.is_instance(&kinds.function).unwrap_or(false) {
        let names = object.getattr("__code__").and_then(|c| c.getattr("co_freevars"));
        if let (Ok(cells), Ok(names)) = (object.getattr("__closure__"), names) {
            if let (Ok(cells), Ok(names)) = (cells.try_iter(), names.try_iter()) {
                for (cell, name) in cells.flatten().zip(names.flatten()) {
                    if let Ok(contents) = cell.getattr("cell_contents") {
                        found.push((Edge::Closure(name), contents));
                    }
                }
            }
        }
    } else if object.is_instance(&kinds.method).unwrap_or(false) {
        if let Ok(owner) = object.getattr("__self__") {
            found.push((Edge::MethodSelf, owner));
        }
    } else if let Ok(attributes) = object.getattr("__dict__").and_then(|d| Ok(d.cast_into::<PyDict>()?)) {
        if attributes.len() <= MOST_ITEMS_WALKED {
            found.extend(attributes.iter().map(|(name, value)| (Edge::Attribute(name), value)));
        }
    }
    found
}

/// The containers reachable from a step, as they were, until [`StepState::restore`].
pub(super) struct StepState<'py> {
    roots: Vec<(String, Bound<'py, PyAny>)>,
    kinds: Kinds<'py>,
    saved: Vec<Saved<'py>>,
    partial: bool,
    /// GradScalers reached: told, for the estimate, that the gradients are finite.
    pub(super) scalers: usize,
}

impl<'py> StepState<'py> {
    /// Copies every container reachable from `roots`; then makes each GradScaler reached step
    /// its optimizer without reading its inf check (`.item()` has no value under fake tensors):
    /// the step whose gradients are finite, the one that needs the memory.
    pub(super) fn save(
        py: Python<'py>,
        roots: &Roots<'py>,
        assigned: &[AssignedGlobal<'py>],
    ) -> PyResult<StepState<'py>> {
        let kinds = Kinds::find(py)?;
        let mut saved = Vec::new();
        let mut roots = roots.clone();
        for (globals, name) in assigned {
            let before = globals.get_item(name)?;
            if let Some(value) = &before {
                roots.push((name.clone(), value.clone()));
            }
            saved.push(Saved::Global { globals: globals.clone(), name: name.clone(), before });
        }
        let mut scalers = Vec::new();
        let walk = Walk::new(&roots, &kinds, |node| {
            if let Some(copy) = save(&node.object, &kinds) {
                saved.push(copy);
            }
            if kinds.scaler.as_ref().is_some_and(|s| node.object.is_instance(s).unwrap_or(false)) {
                scalers.push(node.object.clone());
            }
        });
        let state = StepState { roots, saved, partial: walk.partial, scalers: scalers.len(), kinds };
        for scaler in scalers {
            assume_finite_gradients(py, &scaler)?;
        }
        Ok(state)
    }

    /// Swaps the real GPU tensors held in the saved containers (a GradScaler's scale, an EMA
    /// copy, a metric on the GPU) for fakes of `mode`. Given to the fake mode as they are, small
    /// ones would become constants that it computes with for real, on the device; `restore`
    /// puts the real ones back with the containers.
    pub(super) fn fake_device_tensors(&self, mode: &Bound<'py, PyAny>) -> PyResult<()> {
        let mut fakes = std::collections::HashMap::new();
        let mut fake_of = |value: &Bound<'py, PyAny>| -> PyResult<Option<Bound<'py, PyAny>>> {
            let real = value.is_instance(&self.kinds.tensor)? && !value.is_instance(&self.kinds.fake)?;
            if !real || value.getattr("device")?.getattr("type")?.extract::<String>()? != "cuda" {
                return Ok(None);
            }
            let key = value.as_ptr() as usize;
            if let Some(fake) = fakes.get(&key) {
                return Ok(Some(Bound::clone(fake)));
            }
            let fake = mode.call_method1("from_tensor", (value,))?;
            fakes.insert(key, fake.clone());
            Ok(Some(fake))
        };
        for saved in &self.saved {
            match saved {
                Saved::Dict(dict, _) => {
                    for (key, value) in dict.copy()?.iter() {
                        if let Some(fake) = fake_of(&value)? {
                            dict.set_item(key, fake)?;
                        }
                    }
                }
                Saved::List(list, _) => {
                    for (index, value) in list.iter().enumerate() {
                        if let Some(fake) = fake_of(&value)? {
                            list.set_item(index, fake)?;
                        }
                    }
                }
                Saved::Global { globals, name, before: Some(value) } => {
                    if let Some(fake) = fake_of(value)? {
                        globals.set_item(name, fake)?;
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Puts back every container the step changed; returns notes naming the fakes still
    /// reachable (in what no copy could put back), and the walk's limit if it was reached.
    pub(super) fn restore(mut self) -> PyResult<Vec<String>> {
        for saved in &self.saved {
            restore(saved)?;
        }
        // A global the step assigned is checked where it is now.
        for saved in &self.saved {
            if let Saved::Global { globals, name, .. } = saved {
                if let Some(value) = globals.get_item(name)? {
                    self.roots.push((name.clone(), value));
                }
            }
        }
        let mut left = Vec::new();
        let mut count = 0;
        let walk = Walk::new(&self.roots, &self.kinds, |node| {
            if node.object.is_instance(&self.kinds.fake).unwrap_or(false) {
                count += 1;
            }
        });
        for (index, node) in walk.nodes.iter().enumerate() {
            if left.len() < MOST_NAMED && node.object.is_instance(&self.kinds.fake).unwrap_or(false) {
                left.push(walk.path(index));
            }
        }
        let mut notes = Vec::new();
        if count > 0 {
            let more = if count > left.len() { format!(" and {} more", count - left.len()) } else { String::new() };
            notes.push(format!(
                "the step left fake tensors where the estimate could not put the old values back: {}{more}; \
                 reassign them before the next real step",
                left.join(", ")
            ));
        }
        if self.partial || walk.partial {
            notes.push(format!(
                "the step reaches more than {MOST_OBJECTS} objects: what it changed beyond them was not put back"
            ));
        }
        Ok(notes)
    }
}

fn save<'py>(object: &Bound<'py, PyAny>, kinds: &Kinds<'py>) -> Option<Saved<'py>> {
    if is_atom(object) || object.is_instance(&kinds.tensor).unwrap_or(true) {
        return None;
    }
    if let Ok(dict) = object.cast::<PyDict>() {
        return dict.copy().ok().map(|copy| Saved::Dict(dict.clone(), copy));
    }
    if let Ok(list) = object.cast::<PyList>() {
        return Some(Saved::List(list.clone(), PyList::new(object.py(), list.iter()).ok()?));
    }
    let refill = if object.is_instance_of::<PySet>() {
        "update"
    } else if object.is_instance(&kinds.deque).unwrap_or(false) {
        "extend"
    } else {
        // An object's attributes: its `__dict__`, saved as a dict; modules and functions keep theirs.
        if object.is_instance(&kinds.function).unwrap_or(false) || object.is_instance(&kinds.method).unwrap_or(false) {
            return None;
        }
        let attributes = object.getattr("__dict__").ok()?.cast_into::<PyDict>().ok()?;
        return attributes.copy().ok().map(|copy| Saved::Dict(attributes, copy));
    };
    let items = PyList::new(object.py(), object.try_iter().ok()?.flatten()).ok()?;
    Some(Saved::Refilled { container: object.clone(), items, refill })
}

fn same_items<'py>(now: impl Iterator<Item = Bound<'py, PyAny>>, before: &Bound<'py, PyList>, len: usize) -> bool {
    len == before.len() && now.zip(before.iter()).all(|(a, b)| a.is(&b))
}

fn restore(saved: &Saved) -> PyResult<()> {
    match saved {
        Saved::Dict(dict, before) => {
            let same = dict.len() == before.len()
                && before
                    .iter()
                    .all(|(key, value)| dict.get_item(&key).ok().flatten().is_some_and(|now| now.is(&value)));
            if !same {
                dict.clear();
                dict.update(before.as_mapping())?;
            }
        }
        Saved::List(list, before) => {
            if !same_items(list.iter(), before, list.len()) {
                list.call_method0("clear")?;
                list.call_method1("extend", (before,))?;
            }
        }
        Saved::Global { globals, name, before } => match (before, globals.get_item(name)?) {
            (Some(before), Some(now)) if before.is(&now) => {}
            (Some(before), _) => globals.set_item(name, before)?,
            (None, Some(_)) => globals.del_item(name)?,
            (None, None) => {}
        },
        Saved::Refilled { container, items, refill } => {
            let now: Vec<_> = container.try_iter()?.flatten().collect();
            if !same_items(now.iter().cloned(), items, now.len()) {
                container.call_method0("clear")?;
                container.call_method1(*refill, (items,))?;
            }
        }
    }
    Ok(())
}

/// `GradScaler._maybe_opt_step` reads the inf check with `.item()`; for the estimate, the
/// scaler steps its optimizer as it does when the gradients are finite. Set on the instance,
/// whose `__dict__` was saved before, so putting it back removes this.
fn assume_finite_gradients(py: Python, scaler: &Bound<PyAny>) -> PyResult<()> {
    let step = pyo3::types::PyCFunction::new_closure(py, None, None, |args, kwargs| -> PyResult<Py<PyAny>> {
        let optimizer = args.get_item(0)?;
        let rest = args.get_slice(2, args.len());
        Ok(optimizer.getattr("step")?.call(rest, kwargs)?.unbind())
    })?;
    scaler.getattr("__dict__")?.set_item("_maybe_opt_step", step)
}
