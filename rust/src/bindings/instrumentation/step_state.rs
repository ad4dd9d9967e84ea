//! The step's Python objects for the core's state saving ([`crate::step_state`]): what each
//! object is to the walk, how a container, a place or an RNG is copied and put back, which
//! containers of a module or optimizer the fakes go into, and the GradScaler's inf check skipped.
//! The order, the walk and the notes are the core's.

use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyBytes, PyDict, PyFloat, PyFrozenSet, PyInt, PyList, PyModule, PySet, PyString, PyTuple, PyType,
};

use std::collections::{HashMap, HashSet};

use crate::bindings::python_heap::is_heap_type;
use crate::bindings::rngs::{put_back_rng, read_rng};
use crate::holders_walk::{Buffer, Edge, Heap, Kind, Name, Piece, Refs, Unreadable};
use crate::step_state::{self, Rng, Saving, StepObjects, FAKE, MOST_ITEMS_WALKED, TAKES_GRAD, VALUE};

/// Objects a walk starts from, each with the name a person knows it by.
pub(in crate::bindings) type Roots<'py> = Vec<(String, Bound<'py, PyAny>)>;

/// A global name a step assigns to, and the namespace it is in.
pub(in crate::bindings) type AssignedGlobal<'py> = (Bound<'py, PyDict>, String);

/// A container as it was before the step, by the identity of what it held; owned, so that a
/// by-value save (`SavedStep`) keeps it across Python calls.
pub(in crate::bindings) enum Saved {
    /// An exact dict, or an object's `__dict__`: copied and put back through the C API.
    Dict(Py<PyDict>, Py<PyDict>),
    /// A dict subclass (an `OrderedDict`, a module's hook dicts, a `defaultdict`, a `ModelOutput`):
    /// its items as (key, value) pairs, put back through its own methods, since the C API would
    /// bypass what it keeps beside the dict (an `OrderedDict`'s links).
    Mapping(Py<PyDict>, Py<PyList>),
    List(Py<PyList>, Py<PyList>),
    /// A set (refilled with `update`) or a deque (with `extend`): neither is assigned in place.
    Refilled {
        container: Py<PyAny>,
        items: Py<PyList>,
        refill: &'static str,
    },
    /// A global name the step loads or assigns to, and its value before (None: it did not exist).
    Global {
        globals: Py<PyDict>,
        name: String,
        before: Option<Py<PyAny>>,
    },
    /// A closure cell of the step, and what it held (None: it was empty).
    Cell(Py<PyAny>, Option<Py<PyAny>>),
    /// A random number generator's state.
    Rng(Rng, Py<PyAny>),
    /// A real tensor's value or gradient, copied by `gpuexp.tensor_values` (its `restore()` puts
    /// it back into the same object, its `host` is the copy).
    Value(Py<PyAny>),
}

/// The types the walk treats specially, looked up once.
struct StepKinds<'py> {
    torch: Bound<'py, PyAny>,
    module: Bound<'py, PyType>,
    optimizer: Bound<'py, PyType>,
    tensor: Bound<'py, PyType>,
    fake: Bound<'py, PyType>,
    function: Bound<'py, PyType>,
    method: Bound<'py, PyType>,
    deque: Bound<'py, PyType>,
    scaler: Option<Bound<'py, PyType>>,
    /// `gpuexp.heap_types.slot_names`, and each class as once read.
    slot_names: Bound<'py, PyAny>,
    classes: HashMap<usize, ClassSeen<'py>>,
}

/// What the walk reads of an instance's class, once per class.
struct ClassSeen<'py> {
    slots: Vec<Bound<'py, PyString>>,
    /// A class of gpuexp's own (`fit`'s probe records while the estimate runs): no state of the
    /// user's, so neither walked nor put back.
    gpuexp_own: bool,
}

/// The step's objects, the globals it assigns to, and the places its roots are held in.
pub(in crate::bindings) struct PythonStep<'py> {
    kinds: StepKinds<'py>,
    assigned: Vec<AssignedGlobal<'py>>,
    places: Vec<Place<'py>>,
    /// In a by-value walk (verify's), every tensor reached, by its `id()`: each is a `VALUE`
    /// piece whose value is copied. None in the estimate's walk.
    pub(in crate::bindings) values: Option<HashMap<usize, Bound<'py, PyAny>>>,
}

impl<'py> PythonStep<'py> {
    pub(in crate::bindings) fn find(
        py: Python<'py>,
        assigned: &[AssignedGlobal<'py>],
        places: &[Place<'py>],
    ) -> PyResult<PythonStep<'py>> {
        let torch = py.import("sys")?.getattr("modules")?.get_item("torch")?;
        let types = py.import("types")?;
        let scaler = py.import("torch.amp.grad_scaler").and_then(|m| m.getattr("GradScaler")).ok();
        let kinds = StepKinds {
            module: torch.getattr("nn")?.getattr("Module")?.cast_into()?,
            optimizer: torch.getattr("optim")?.getattr("Optimizer")?.cast_into()?,
            tensor: torch.getattr("Tensor")?.cast_into()?,
            fake: py.import("torch._subclasses.fake_tensor")?.getattr("FakeTensor")?.cast_into()?,
            function: types.getattr("FunctionType")?.cast_into()?,
            method: types.getattr("MethodType")?.cast_into()?,
            deque: py.import("collections")?.getattr("deque")?.cast_into()?,
            scaler: scaler.and_then(|s| s.cast_into().ok()),
            slot_names: py.import("gpuexp.heap_types")?.getattr("slot_names")?,
            classes: HashMap::new(),
            torch,
        };
        Ok(PythonStep { kinds, assigned: assigned.to_vec(), places: places.to_vec(), values: None })
    }

    fn is(&self, object: &Bound<'py, PyAny>, kind: &Bound<'py, PyType>) -> bool {
        object.is_instance(kind).unwrap_or(false)
    }

    fn attributes(object: &Bound<'py, PyAny>) -> Option<Bound<'py, PyDict>> {
        object.getattr("__dict__").ok()?.cast_into::<PyDict>().ok()
    }

    /// What `object`'s slots hold (its class read once): walked, so that what a slot holds is
    /// reached, though the slots themselves are not put back (docs/estimate-safety.md). False
    /// for an object of gpuexp's own, which is not walked.
    fn slot_values(&mut self, object: &Bound<'py, PyAny>, refs: &mut Refs<Bound<'py, PyAny>>) -> bool {
        let class = object.get_type();
        let slot_names = &self.kinds.slot_names;
        let seen = self.kinds.classes.entry(class.as_ptr() as usize).or_insert_with(|| {
            let module = class.getattr("__module__").map(|m| m.to_string()).unwrap_or_default();
            ClassSeen {
                slots: slot_names.call1((&class,)).and_then(|names| names.extract()).unwrap_or_default(),
                gpuexp_own: module == "gpuexp" || module.starts_with("gpuexp."),
            }
        });
        if seen.gpuexp_own {
            return false;
        }
        for name in seen.slots.iter() {
            if let Ok(value) = object.getattr(name) {
                refs.push((Edge::Attr(Name::Of(name.clone().into_any())), value));
            }
        }
        true
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

fn items<'py>(iterable: &Bound<'py, PyAny>, refs: &mut Refs<Bound<'py, PyAny>>, most: usize) {
    if iterable.len().unwrap_or(usize::MAX) > most {
        return;
    }
    if let Ok(iterator) = iterable.try_iter() {
        refs.extend(iterator.flatten().enumerate().map(|(i, item)| (Edge::Index(i), item)));
    }
}

/// The (name, value) pairs of `pairs` (a class namespace's `items()`) as attributes.
fn items_named<'py>(pairs: &Bound<'py, PyAny>, refs: &mut Refs<Bound<'py, PyAny>>, most: usize) {
    if pairs.len().unwrap_or(usize::MAX) > most {
        return;
    }
    let Ok(pairs) = pairs.try_iter() else { return };
    for pair in pairs.flatten() {
        if let Ok((name, value)) = pair.extract::<(Bound<PyAny>, Bound<PyAny>)>() {
            refs.push((Edge::Attr(Name::Of(name)), value));
        }
    }
}

fn entries<'py>(
    dict: &Bound<'py, PyDict>,
    refs: &mut Refs<Bound<'py, PyAny>>,
    edge: fn(Bound<'py, PyAny>) -> Edge<Bound<'py, PyAny>>,
    most: usize,
) {
    if dict.len() <= most {
        refs.extend(dict.iter().map(|(key, value)| (edge(key), value)));
    }
}

impl<'py> Heap for PythonStep<'py> {
    type Object = Bound<'py, PyAny>;

    fn address(&self, object: &Self::Object) -> usize {
        object.as_ptr() as usize
    }

    /// What an object holds that the step may have changed: a container's items, an object's
    /// attributes, a function's closure, a bound method's object. Tensors, modules, classes and
    /// plain values are leaves; the globals a function reads are roots already. The containers
    /// are `Owner`s (saved), the fakes `Buffer`s (named if left after).
    fn look(&mut self, object: &Self::Object, refs: &mut Refs<Self::Object>) -> Result<Kind, Unreadable> {
        if let Ok(class) = object.cast::<PyType>() {
            // A class of the user's may hold a model in a class attribute: what it holds is
            // walked, though a class's namespace is no dict to copy and put back.
            if is_heap_type(class) {
                if let Ok(attributes) = object.getattr("__dict__").and_then(|d| d.call_method0("items")) {
                    items_named(&attributes, refs, MOST_ITEMS_WALKED);
                }
                return Ok(Kind::Plain);
            }
            return Ok(Kind::Leaf);
        }
        if is_atom(object) {
            return Ok(Kind::Leaf);
        }
        // A by-value walk goes through long containers too: a tensor in one must get its value back.
        let most = if self.values.is_some() { usize::MAX } else { MOST_ITEMS_WALKED };
        if object.is_instance(&self.kinds.tensor).unwrap_or(true) {
            // A tensor by its object (`id()`): a refusal at an operator knows it so.
            let buffer = Buffer::Storage(object.as_ptr() as usize);
            let kind = if let Some(values) = &mut self.values {
                values.insert(object.as_ptr() as usize, object.clone());
                VALUE
            } else if self.is(object, &self.kinds.fake) {
                FAKE
            } else if object.getattr("requires_grad").and_then(|r| r.is_truthy()).unwrap_or(false) {
                TAKES_GRAD
            } else {
                return Ok(Kind::Leaf);
            };
            let (shape, device) = (String::new(), String::new());
            return Ok(Kind::Buffer(Piece { buffer, bytes: 0, kind, shape, device }));
        }
        if let Ok(dict) = object.cast::<PyDict>() {
            entries(dict, refs, Edge::Key, most);
            return Ok(Kind::Owner);
        }
        if object.is_instance_of::<PyList>() || object.is_instance_of::<PySet>() || self.is(object, &self.kinds.deque) {
            items(object, refs, most);
            return Ok(Kind::Owner);
        }
        if object.is_instance_of::<PyTuple>() || object.is_instance_of::<PyFrozenSet>() {
            items(object, refs, most);
        } else if self.is(object, &self.kinds.function) {
            let names = object.getattr("__code__").and_then(|c| c.getattr("co_freevars"));
            if let (Ok(cells), Ok(names)) = (object.getattr("__closure__"), names) {
                if let (Ok(cells), Ok(names)) = (cells.try_iter(), names.try_iter()) {
                    for (cell, name) in cells.flatten().zip(names.flatten()) {
                        if let Ok(contents) = cell.getattr("cell_contents") {
                            refs.push((Edge::Closure(Name::Of(name)), contents));
                        }
                    }
                }
            }
        } else if self.is(object, &self.kinds.method) {
            if let Ok(owner) = object.getattr("__self__") {
                refs.push((Edge::Attr(Name::Fixed("__self__")), owner));
            }
        } else {
            if !self.slot_values(object, refs) {
                return Ok(Kind::Leaf);
            }
            if let Some(attributes) = PythonStep::attributes(object) {
                entries(&attributes, refs, |name| Edge::Attr(Name::Of(name)), most);
                return Ok(Kind::Owner);
            }
        }
        Ok(Kind::Plain)
    }

    fn text(&self, name: &Self::Object) -> String {
        name.str().map(|s| s.to_string()).unwrap_or_default()
    }

    fn is_plain(&self, key: &Self::Object) -> bool {
        key.is_instance_of::<PyString>() || key.is_instance_of::<PyInt>()
    }

    /// A key by its repr where it is text; by its type otherwise: a tensor's repr reads the device.
    fn describe(&self, key: &Self::Object) -> String {
        if self.is_plain(key) {
            return key.repr().map(|r| r.to_string()).unwrap_or_default();
        }
        format!("<{}>", key.get_type().name().map(|n| n.to_string()).unwrap_or_default())
    }

    fn call(&self, key: &Self::Object) -> String {
        self.describe(key)
    }
}

impl<'py> StepObjects for PythonStep<'py> {
    type Saved = Saved;
    type Error = PyErr;

    fn save_rng(&mut self, rng: Rng) -> PyResult<Option<Saved>> {
        Ok(read_rng(&self.kinds.torch, rng)?.map(|state| Saved::Rng(rng, state.unbind())))
    }

    fn save_places(&mut self) -> PyResult<Vec<Saved>> {
        let mut saved = Vec::new();
        let mut seen = HashSet::new();
        let globals = self.assigned.iter().map(|(namespace, name)| (namespace.as_any(), Some(name)));
        let loaded = self.places.iter().map(|(holder, name)| (holder, name.as_ref()));
        for (holder, name) in globals.chain(loaded) {
            if !seen.insert((holder.as_ptr() as usize, name.cloned())) {
                continue;
            }
            match name {
                Some(name) => {
                    let namespace = holder.cast::<PyDict>()?;
                    let before = namespace.get_item(name)?.map(Bound::unbind);
                    saved.push(Saved::Global { globals: namespace.clone().unbind(), name: name.clone(), before });
                }
                None => saved.push(Saved::Cell(
                    holder.clone().unbind(),
                    holder.getattr("cell_contents").ok().map(Bound::unbind),
                )),
            }
        }
        Ok(saved)
    }

    fn swaps_tensors_of(&self, object: &Self::Object) -> bool {
        self.is(object, &self.kinds.module) || self.is(object, &self.kinds.optimizer)
    }

    /// A module's and its submodules' `_parameters` and `_buffers`; an optimizer (its attributes:
    /// its `state` is replaced) and its param groups.
    fn swapped_containers(&mut self, owner: &Self::Object) -> Vec<Self::Object> {
        let mut containers = Vec::new();
        if self.is(owner, &self.kinds.module) {
            let Ok(modules) = owner.call_method0("modules").and_then(|m| m.try_iter()) else { return containers };
            for module in modules.flatten() {
                for attribute in ["_parameters", "_buffers"] {
                    containers.extend(module.getattr(attribute).ok().filter(|held| held.is_instance_of::<PyDict>()));
                }
            }
        } else if let Ok(groups) = owner.getattr("param_groups").and_then(|g| g.try_iter()) {
            containers.push(owner.clone());
            containers.extend(groups.flatten().filter(|group| group.is_instance_of::<PyDict>()));
        }
        containers
    }

    fn save(&mut self, object: &Self::Object) -> Option<Saved> {
        if let Ok(dict) = object.cast_exact::<PyDict>() {
            return dict.copy().ok().map(|copy| Saved::Dict(dict.clone().unbind(), copy.unbind()));
        }
        if let Ok(dict) = object.cast::<PyDict>() {
            let items = PyList::new(object.py(), dict.iter()).ok()?;
            return Some(Saved::Mapping(dict.clone().unbind(), items.unbind()));
        }
        if let Ok(list) = object.cast::<PyList>() {
            let items = PyList::new(object.py(), list.iter()).ok()?;
            return Some(Saved::List(list.clone().unbind(), items.unbind()));
        }
        let refill = if object.is_instance_of::<PySet>() {
            "update"
        } else if self.is(object, &self.kinds.deque) {
            "extend"
        } else {
            let attributes = PythonStep::attributes(object)?;
            return attributes.copy().ok().map(|copy| Saved::Dict(attributes.unbind(), copy.unbind()));
        };
        let items = PyList::new(object.py(), object.try_iter().ok()?.flatten()).ok()?;
        Some(Saved::Refilled { container: object.clone().unbind(), items: items.unbind(), refill })
    }

    fn save_value(&mut self, buffer: Buffer, path: &str) -> PyResult<Vec<(String, Saved)>> {
        let Buffer::Storage(id) = buffer else { return Ok(Vec::new()) };
        let Some(tensor) = self.values.as_ref().and_then(|values| values.get(&id)) else { return Ok(Vec::new()) };
        let copied = tensor.py().import("gpuexp.tensor_values")?.call_method1("saved", (tensor,))?;
        let (value, grad): (Option<Py<PyAny>>, Option<Py<PyAny>>) = copied.extract()?;
        let named = [(path.to_string(), value), (format!("{path}.grad"), grad)];
        Ok(named.into_iter().filter_map(|(name, saved)| Some((name, Saved::Value(saved?)))).collect())
    }

    fn restore(&mut self, saved: &Saved) -> PyResult<Option<String>> {
        let py = self.kinds.torch.py();
        match saved {
            Saved::Mapping(dict, before) => return Ok(put_back_mapping(dict.bind(py), before.bind(py))),
            Saved::Dict(dict, before) => {
                let (dict, before) = (dict.bind(py), before.bind(py));
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
                let (list, before) = (list.bind(py), before.bind(py));
                if !same_items(list.iter(), before, list.len()) {
                    list.call_method0("clear")?;
                    list.call_method1("extend", (before,))?;
                }
            }
            Saved::Global { globals, name, before } => {
                let globals = globals.bind(py);
                match (before, globals.get_item(name)?) {
                    (Some(before), Some(now)) if before.is(&now) => {}
                    (Some(before), _) => globals.set_item(name, before)?,
                    (None, Some(_)) => globals.del_item(name)?,
                    (None, None) => {}
                }
            }
            Saved::Refilled { container, items, refill } => {
                let (container, items) = (container.bind(py), items.bind(py));
                let now: Vec<_> = container.try_iter()?.flatten().collect();
                if !same_items(now.iter().cloned(), items, now.len()) {
                    container.call_method0("clear")?;
                    container.call_method1(*refill, (items,))?;
                }
            }
            Saved::Cell(cell, before) => {
                let cell = cell.bind(py);
                let now = cell.getattr("cell_contents").ok();
                match (before, now) {
                    (Some(before), Some(now)) if before.is(&now) => {}
                    (Some(before), _) => cell.setattr("cell_contents", before)?,
                    (None, Some(_)) => cell.delattr("cell_contents")?,
                    (None, None) => {}
                }
            }
            Saved::Rng(rng, state) => put_back_rng(&self.kinds.torch, *rng, state.bind(py))?,
            Saved::Value(value) => drop(value.bind(py).call_method0("restore")?),
        }
        Ok(None)
    }

    fn assigned_now(&mut self) -> PyResult<Roots<'py>> {
        let mut bound = Vec::new();
        for (globals, name) in &self.assigned {
            if let Some(value) = globals.get_item(name)? {
                bound.push((name.clone(), value));
            }
        }
        Ok(bound)
    }

    fn is_scaler(&self, object: &Self::Object) -> bool {
        self.kinds.scaler.as_ref().is_some_and(|scaler| self.is(object, scaler))
    }

    fn assume_finite_gradients(&mut self, scaler: &Self::Object) -> PyResult<()> {
        let fake_step = scaler.py().import("gpuexp.fake_step")?;
        fake_step.call_method1("assume_finite_gradients", (scaler,)).map(drop)
    }
}

/// Whether `dict` holds the very objects of `before`'s pairs, read through the C API (reading
/// bypasses nothing).
fn same_mapping<'py>(dict: &Bound<'py, PyDict>, before: &Bound<'py, PyList>) -> bool {
    dict.len() == before.len()
        && before.iter().all(|pair| {
            let Ok((key, value)) = pair.extract::<(Bound<PyAny>, Bound<PyAny>)>() else { return false };
            dict.get_item(&key).ok().flatten().is_some_and(|now| now.is(&value))
        })
}

/// Puts a dict subclass back by its own `clear` and `update`; where those refuse (a
/// `ModelOutput`'s `update` raises), by its base's (`OrderedDict`'s, keeping its links, or
/// `dict`'s). A note where neither put it back: never left half-restored unsaid.
fn put_back_mapping<'py>(dict: &Bound<'py, PyDict>, before: &Bound<'py, PyList>) -> Option<String> {
    if same_mapping(dict, before) {
        return None;
    }
    let refill = |owner: &Bound<'py, PyAny>| -> PyResult<()> {
        owner.call_method1("clear", (dict,))?;
        for pair in before.iter() {
            let (key, value): (Bound<PyAny>, Bound<PyAny>) = pair.extract()?;
            owner.call_method1("__setitem__", (dict, key, value))?;
        }
        Ok(())
    };
    let own = dict.get_type().into_any();
    let py = dict.py();
    let base = py
        .import("collections")
        .and_then(|c| c.getattr("OrderedDict"))
        .ok()
        .filter(|ordered| dict.is_instance(ordered).unwrap_or(false))
        .unwrap_or_else(|| py.get_type::<PyDict>().into_any());
    let mut error = None;
    for owner in [own, base] {
        match refill(&owner) {
            Ok(()) if same_mapping(dict, before) => return None,
            Ok(()) => {}
            Err(failed) => error = Some(failed.value(py).to_string()),
        }
    }
    let kind = dict.get_type().name().map(|n| n.to_string()).unwrap_or_default();
    let why = error.map(|e| format!(" ({e})")).unwrap_or_default();
    Some(format!(
        "a {kind} the step changed could not be put back as it was{why}: rebuild it before the next real step"
    ))
}

fn same_items<'py>(now: impl Iterator<Item = Bound<'py, PyAny>>, before: &Bound<'py, PyList>, len: usize) -> bool {
    len == before.len() && now.zip(before.iter()).all(|(a, b)| a.is(&b))
}

/// Where a root the step loads is held: a global's namespace and name, or a closure cell and None.
pub(in crate::bindings) type Place<'py> = (Bound<'py, PyAny>, Option<String>);

/// What the step reaches, as it was, until [`StepState::restore`]: the RNGs, the places and the
/// containers, into which the fakes that stand in for real tensors while it runs are swapped.
pub(in crate::bindings) struct StepState<'py> {
    step: PythonStep<'py>,
    saving: Saving<Saved, Bound<'py, PyAny>>,
    /// GradScalers reached: told, for the estimate, that the gradients are finite.
    pub(in crate::bindings) scalers: usize,
}

impl<'py> StepState<'py> {
    /// Saves what the step reaches ([`step_state::save`]): the four RNGs, the places its roots
    /// are held in and the globals it assigns, and from one walk of what `roots` reach, the
    /// containers of its modules and optimizers that their fakes go into and every other container.
    pub(in crate::bindings) fn save(
        py: Python<'py>,
        roots: &Roots<'py>,
        assigned: &[AssignedGlobal<'py>],
        places: &[Place<'py>],
    ) -> PyResult<StepState<'py>> {
        let mut step = PythonStep::find(py, assigned, places)?;
        let saving = step_state::save(&mut step, roots.clone())?;
        Ok(StepState { scalers: saving.scalers, step, saving })
    }

    /// The modules and optimizers the walk reached, whose tensors the fakes stand in for.
    pub(in crate::bindings) fn owners(&self) -> &[Bound<'py, PyAny>] {
        &self.saving.owners
    }

    /// The path to each real tensor that requires grad that the step reaches, by its `id()`.
    pub(in crate::bindings) fn takes_grad_paths(&self) -> HashMap<usize, String> {
        let paths = self.saving.takes_grad.iter();
        paths
            .filter_map(
                |(buffer, path)| if let Buffer::Storage(id) = buffer { Some((*id, path.clone())) } else { None },
            )
            .collect()
    }

    /// Swaps every real tensor the step reaches (in the saved containers, the globals it loads,
    /// its closure cells) for fakes of `mode`; `restore` puts the real ones back with the
    /// containers and places they are in.
    pub(in crate::bindings) fn fake_reached_tensors(&mut self, mode: &Bound<'py, PyAny>) -> PyResult<()> {
        let py = mode.py();
        let (dicts, lists, places) = (PyList::empty(py), PyList::empty(py), PyList::empty(py));
        for saved in &self.saving.saved {
            match saved {
                Saved::Dict(dict, _) | Saved::Mapping(dict, _) => dicts.append(dict.bind(py))?,
                Saved::List(list, _) => lists.append(list.bind(py))?,
                Saved::Global { globals: namespace, name, before: Some(_) } => {
                    places.append((namespace.bind(py), name))?
                }
                Saved::Cell(cell, Some(_)) => places.append((cell.bind(py), py.None()))?,
                _ => {}
            }
        }
        let reached = py.import("gpuexp.reached_tensors")?;
        reached.call_method1("fake_reached_tensors", (mode, dicts, lists, places)).map(drop)
    }

    /// Puts back everything saved where the step changed it ([`step_state::restore`]), the real
    /// tensors with it; the notes. Each is tried before the first error met is raised.
    pub(in crate::bindings) fn restore(mut self) -> PyResult<Vec<String>> {
        step_state::restore(&mut self.step, self.saving)
    }
}
