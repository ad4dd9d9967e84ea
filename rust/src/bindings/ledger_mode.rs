//! The dispatch mode that keeps an estimate's books: every storage an operator makes on the
//! device is entered in the core's [`Ledger`], and a weak reference to it tells the ledger when
//! it is freed. Hooks mark gradients and optimizer state, and the optimizer's step as a phase.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::prelude::*;
use pyo3::types::{PyCFunction, PyDict, PyList, PyTuple, PyType};

use super::error::NoEstimate;
use super::fakes::Fakes;
use super::holders::Memory;
use crate::estimate::{Category, Entry, Ledger, Peak, Phase, Rounding};
use crate::locks::lock;

/// Runs `body` with the ledger's dispatch mode inside the fake mode of `fakes`; the peak it found.
pub(super) fn run<'py, T>(
    fakes: &Fakes<'py>,
    memory: &Memory,
    body: impl FnOnce(&Ledgered<'py>) -> PyResult<T>,
) -> PyResult<(Peak, T)> {
    let ledgered = Ledgered::open(fakes, memory)?;
    let outcome = within(&fakes.mode, || within(&ledgered.mode, || body(&ledgered)));
    let marked = ledgered.mark_gradients_and_state();
    let peak = books(&ledgered.shared).ledger.peak();
    // The hooks go whatever happened: the optimizer's are global.
    ledgered.close()?;
    let outcome = outcome?;
    marked?;
    Ok((peak, outcome))
}

/// Runs `inner` with `mode` entered. A mode is left only if it was entered: leaving one that was
/// not would pop another off torch's stack.
fn within<T>(mode: &Bound<PyAny>, inner: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    mode.call_method0("__enter__")?;
    let outcome = inner();
    let none = mode.py().None();
    let left = mode.call_method1("__exit__", (&none, &none, &none));
    let outcome = outcome?;
    left?;
    Ok(outcome)
}

/// What the dispatch mode and the hooks share: the ledger, which storage is which entry, and
/// the weak references that tell the ledger when a storage is freed.
struct Books {
    ledger: Ledger,
    entries: HashMap<usize, Entry>,
    weakrefs: Vec<Py<PyAny>>,
    last_op: Option<Py<PyAny>>,
    /// Per operator: whether each of its returns aliases an input (a view, an in-place result).
    aliases: HashMap<usize, Vec<bool>>,
}

type Shared = Arc<Mutex<Books>>;

/// The books, locked. Never held across a call into Python: a storage freed there calls back.
fn books(shared: &Shared) -> MutexGuard<'_, Books> {
    lock(shared)
}

/// What the dispatch closure needs of Python, kept as it is called on torch's threads too.
struct Context {
    target: Py<PyAny>,
    tensor: Py<PyType>,
    fake_tensor: Py<PyType>,
    current_node: Py<PyAny>,
    weakref: Py<PyAny>,
}

/// A step run in progress: the ledger, the hooks that mark gradients and optimizer state, and
/// the dispatch mode.
pub(super) struct Ledgered<'py> {
    py: Python<'py>,
    shared: Shared,
    context: Arc<Context>,
    params: Vec<Bound<'py, PyAny>>,
    optimizers: Vec<Bound<'py, PyAny>>,
    hooks: Vec<Bound<'py, PyAny>>,
    mode: Bound<'py, PyAny>,
    /// Fakes of tensors on the `meta` device: loaded before the step, not allocated now.
    from_meta: HashSet<usize>,
}

impl<'py> Ledgered<'py> {
    fn open(fakes: &Fakes<'py>, memory: &Memory) -> PyResult<Ledgered<'py>> {
        let py = fakes.py;
        let (target, rounding) = match memory {
            Memory::Cuda(index) => (fakes.torch.getattr("device")?.call1(("cuda", *index))?, Rounding::CudaCaching),
            _ => (fakes.torch.getattr("device")?.call1(("cpu",))?, Rounding::Exact),
        };
        let context = Arc::new(Context {
            target: target.unbind(),
            tensor: fakes.tensor.clone().unbind(),
            fake_tensor: fakes.fake_tensor.clone().unbind(),
            current_node: fakes.torch.getattr("_C")?.getattr("_current_autograd_node")?.unbind(),
            weakref: py.import("weakref")?.getattr("ref")?.unbind(),
        });
        let shared = Arc::new(Mutex::new(Books {
            ledger: Ledger::new(rounding),
            entries: HashMap::new(),
            weakrefs: Vec::new(),
            last_op: None,
            aliases: HashMap::new(),
        }));
        let mut ledgered = Ledgered {
            py,
            shared,
            context,
            params: fakes.params.clone(),
            optimizers: fakes.optimizers.iter().map(|o| o.optimizer.clone()).collect(),
            hooks: Vec::new(),
            mode: py.None().into_bound(py),
            from_meta: fakes.from_meta.clone(),
        };
        match ledgered.prepare(fakes) {
            Ok(()) => Ok(ledgered),
            Err(error) => {
                ledgered.close()?;
                Err(error)
            }
        }
    }

    /// Enters what exists in the ledger, installs the hooks and makes the dispatch mode.
    fn prepare(&mut self, fakes: &Fakes<'py>) -> PyResult<()> {
        for param in &fakes.params {
            self.enter_existing(param, Category::Parameters)?;
            self.enter_existing(&param.getattr("grad")?, Category::Gradients)?;
        }
        for buffer in &fakes.buffers {
            self.enter_existing(buffer, Category::Buffers)?;
        }
        for tensor in self.state_tensors()? {
            self.enter_existing(&tensor, Category::OptimizerState)?;
        }
        self.install_hooks()?;
        self.mode = self.dispatch_mode()?;
        Ok(())
    }

    fn on_target(&self, tensor: &Bound<'py, PyAny>) -> bool {
        on_target(&self.context, tensor)
    }

    fn enter_existing(&self, tensor: &Bound<'py, PyAny>, category: Category) -> PyResult<()> {
        if tensor.is_none() || !self.on_target(tensor) {
            return Ok(());
        }
        let storage = tensor.call_method0("untyped_storage")?;
        let key = storage.as_ptr() as usize;
        if books(&self.shared).entries.contains_key(&key) {
            return Ok(());
        }
        let nbytes: u64 = storage.call_method0("nbytes")?.extract()?;
        let mut books = books(&self.shared);
        let entry = if self.from_meta.contains(&(tensor.as_ptr() as usize)) {
            books.ledger.loaded(nbytes, category)
        } else {
            books.ledger.existing(nbytes, category)
        };
        drop(books);
        watch(&self.shared, &self.context, &storage, key, entry)
    }

    /// The tensors in the (fake) state of every swapped optimizer.
    fn state_tensors(&self) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let tensor = self.context.tensor.bind(self.py);
        let mut found = Vec::new();
        for optimizer in &self.optimizers {
            for values in optimizer.getattr("state")?.cast::<PyDict>()?.values() {
                let Ok(values) = values.cast_into::<PyDict>() else { continue };
                found.extend(values.values().iter().filter(|v| v.is_instance(tensor).unwrap_or(false)));
            }
        }
        Ok(found)
    }

    /// How many parameters have optimizer state: it grows when a step creates it.
    pub(super) fn optimizer_state_entries(&self) -> PyResult<usize> {
        self.optimizers.iter().map(|o| o.getattr("state")?.len()).sum()
    }

    /// Marks a made storage as what it turned out to be.
    fn mark(&self, tensor: &Bound<'py, PyAny>, category: Category) -> PyResult<()> {
        if tensor.is_none() {
            return Ok(());
        }
        let key = tensor.call_method0("untyped_storage")?.as_ptr() as usize;
        let mut books = books(&self.shared);
        if let Some(entry) = books.entries.get(&key).copied() {
            books.ledger.mark(entry, category);
        }
        Ok(())
    }

    fn mark_gradients_and_state(&self) -> PyResult<()> {
        for param in &self.params {
            self.mark(&param.getattr("grad")?, Category::Gradients)?;
        }
        for tensor in self.state_tensors()? {
            self.mark(&tensor, Category::OptimizerState)?;
        }
        Ok(())
    }

    /// The optimizer's step is its own phase, and marks the state it made; each gradient is
    /// marked as it is accumulated, since the step may free it (`zero_grad`) before it ends.
    fn install_hooks(&mut self) -> PyResult<()> {
        let py = self.py;
        let optimizers = py.import("torch.optim.optimizer")?;
        let shared = self.shared.clone();
        // Hooks return None: a tuple would be taken for new arguments, `()` included.
        let before = PyCFunction::new_closure(py, None, None, move |args, _kwargs| -> Py<PyAny> {
            books(&shared).ledger.enter(Phase::Optimizer);
            args.py().None()
        })?;
        let (shared, context) = (self.shared.clone(), self.context.clone());
        let after = PyCFunction::new_closure(py, None, None, move |args, _kwargs| -> PyResult<Py<PyAny>> {
            let optimizer = args.get_item(0)?;
            let tensor = context.tensor.bind(args.py());
            for values in optimizer.getattr("state")?.cast::<PyDict>()?.values() {
                let Ok(values) = values.cast_into::<PyDict>() else { continue };
                for value in values.values().iter().filter(|v| v.is_instance(tensor).unwrap_or(false)) {
                    mark_storage(&shared, &value, Category::OptimizerState)?;
                }
            }
            books(&shared).ledger.enter(Phase::Forward);
            Ok(args.py().None())
        })?;
        self.hooks.push(optimizers.call_method1("register_optimizer_step_pre_hook", (before,))?);
        self.hooks.push(optimizers.call_method1("register_optimizer_step_post_hook", (after,))?);
        for param in &self.params {
            if !param.getattr("requires_grad")?.extract::<bool>()? {
                continue;
            }
            let shared = self.shared.clone();
            let accumulated = PyCFunction::new_closure(py, None, None, move |args, _kwargs| -> PyResult<Py<PyAny>> {
                mark_storage(&shared, &args.get_item(0)?.getattr("grad")?, Category::Gradients)?;
                Ok(args.py().None())
            })?;
            self.hooks.push(param.call_method1("register_post_accumulate_grad_hook", (accumulated,))?);
        }
        Ok(())
    }

    /// A `TorchDispatchMode` whose `__torch_dispatch__` is a Rust closure over the books.
    fn dispatch_mode(&self) -> PyResult<Bound<'py, PyAny>> {
        let py = self.py;
        let (shared, context) = (self.shared.clone(), self.context.clone());
        let dispatch = PyCFunction::new_closure(py, None, None, move |args, _kwargs| -> PyResult<Py<PyAny>> {
            dispatch(&shared, &context, args)
        })?;
        let base = py.import("torch.utils._python_dispatch")?.getattr("TorchDispatchMode")?;
        let class = py.get_type::<PyType>().call1(("GpuexpLedgerMode", (base,), PyDict::new(py)))?;
        let mode = class.call0()?;
        // Torch wants a method bound to the mode; set on the instance, the base class does not
        // wrap it for torch.compile.
        let method = py.import("types")?.getattr("MethodType")?.call1((dispatch, &mode))?;
        mode.setattr("__torch_dispatch__", method)?;
        Ok(mode)
    }

    /// The step's error as `NoEstimate`, naming the operator it failed at.
    pub(super) fn no_estimate(&self, py: Python, error: PyErr) -> PyErr {
        if error.is_instance_of::<NoEstimate>(py) {
            return error;
        }
        let value = error.value(py);
        let operator = value
            .getattr("func")
            .ok()
            .filter(|f| !f.is_none())
            .or_else(|| books(&self.shared).last_op.as_ref().map(|op| op.bind(py).clone()))
            .map(|op| op.to_string())
            .unwrap_or_else(|| "its first operator".into());
        let kind = value.get_type().name().map(|n| n.to_string()).unwrap_or_default();
        let message = format!(
            "no estimate was made: the step failed under fake tensors at {operator} ({kind}: {})",
            value.str().map(|s| s.to_string()).unwrap_or_default().lines().next().unwrap_or("")
        );
        let wrapped = NoEstimate::new_err(message);
        wrapped.set_cause(py, Some(error));
        wrapped
    }

    /// Removes the hooks and drops the weak references, so that nothing calls back any more.
    fn close(self) -> PyResult<()> {
        let weakrefs = std::mem::take(&mut books(&self.shared).weakrefs);
        drop(weakrefs);
        self.hooks.iter().try_for_each(|hook| hook.call_method0("remove").map(drop))
    }
}

fn on_target(context: &Context, tensor: &Bound<PyAny>) -> bool {
    let py = tensor.py();
    // A fake tensor's device is a plain attribute; `device` would dispatch to the fake mode.
    let device = tensor.getattr("fake_device").or_else(|_| tensor.getattr("device"));
    device.and_then(|d| d.eq(context.target.bind(py))).unwrap_or(false)
}

fn mark_storage(shared: &Shared, tensor: &Bound<PyAny>, category: Category) -> PyResult<()> {
    if tensor.is_none() {
        return Ok(());
    }
    let key = tensor.call_method0("untyped_storage")?.as_ptr() as usize;
    let mut books = books(shared);
    if let Some(entry) = books.entries.get(&key).copied() {
        books.ledger.mark(entry, category);
    }
    Ok(())
}

/// Tells the ledger when `storage` is freed: a weak reference whose callback runs as it dies.
fn watch(shared: &Shared, context: &Context, storage: &Bound<PyAny>, key: usize, entry: Entry) -> PyResult<()> {
    let py = storage.py();
    let callback_books = shared.clone();
    let freed = PyCFunction::new_closure(py, None, None, move |args, _kwargs| -> Py<PyAny> {
        let mut books = books(&callback_books);
        books.ledger.freed(entry);
        if books.entries.get(&key) == Some(&entry) {
            books.entries.remove(&key);
        }
        args.py().None()
    })?;
    let weakref = context.weakref.bind(py).call1((storage, freed))?;
    let mut books = books(shared);
    books.entries.insert(key, entry);
    books.weakrefs.push(weakref.unbind());
    Ok(())
}

/// `mode.__torch_dispatch__(func, types, args, kwargs)`: runs the operator (in the fake mode below)
/// and enters the storages it made.
fn dispatch(shared: &Shared, context: &Context, call: &Bound<PyTuple>) -> PyResult<Py<PyAny>> {
    let py = call.py();
    // (mode, func, types, args, kwargs)
    let func = call.get_item(1)?;
    let args = call.get_item(3)?.cast_into::<PyTuple>()?;
    let kwargs = call.get_item(4).ok().filter(|k| !k.is_none()).map(|k| k.cast_into::<PyDict>()).transpose()?;
    let in_backward = !context.current_node.bind(py).call0()?.is_none();
    let previous = {
        let mut books = books(shared);
        books.ledger.count_op();
        match (in_backward, books.ledger.phase()) {
            (true, _) => books.ledger.enter(Phase::Backward),
            (false, Phase::Backward) => books.ledger.enter(Phase::Forward),
            _ => {}
        }
        books.last_op.replace(func.clone().unbind())
    };
    drop(previous);
    refuse_real_leaves(context, &args, kwargs.as_ref())?;
    refuse_cudnn_rnn(&func, &args)?;
    let out = func.call(&args, kwargs.as_ref())?;
    enter_outputs(shared, context, &func, &out)?;
    Ok(out.unbind())
}

/// A real tensor that requires grad would tie the step's graph to the real model, and backward
/// would set its `.grad` to a fake: a parameter the walk did not find stops the estimate.
fn refuse_real_leaves(context: &Context, args: &Bound<PyTuple>, kwargs: Option<&Bound<PyDict>>) -> PyResult<()> {
    let py = args.py();
    let (tensor, fake) = (context.tensor.bind(py), context.fake_tensor.bind(py));
    let check = |value: &Bound<PyAny>| -> PyResult<()> {
        if value.is_instance(tensor)? && !value.is_instance(fake)? && value.getattr("requires_grad")?.is_truthy()? {
            let shape = value.getattr("shape")?.str()?.to_string();
            return Err(NoEstimate::new_err(format!(
                "no estimate was made: the step uses a tensor that requires grad ({shape}) that is in no module or \
                 optimizer reachable from the step or your names; make the model a global or a closure variable of the step"
            )));
        }
        Ok(())
    };
    let values = args.iter().chain(kwargs.into_iter().flat_map(|k| k.values().iter()));
    for value in values {
        if value.is_instance_of::<PyList>() || value.is_instance_of::<PyTuple>() {
            value.try_iter()?.try_for_each(|item| check(&item?))?;
        } else {
            check(&value)?;
        }
    }
    Ok(())
}

/// cuDNN sizes an RNN's workspace at run time, by the algorithm it picks for the shapes, and no
/// fake implementation can know it (see `crate::cudnn_rnn`).
fn refuse_cudnn_rnn(func: &Bound<PyAny>, args: &Bound<PyTuple>) -> PyResult<()> {
    let name: String = func.getattr("__name__").and_then(|n| n.extract()).unwrap_or_default();
    if !name.starts_with("_cudnn_rnn.") {
        return Ok(());
    }
    // `_cudnn_rnn(input, weight, weight_stride0, weight_buf, hx, cx, mode, hidden_size, proj_size, ...)`
    let mode: i64 = args.get_item(6).and_then(|m| m.extract()).unwrap_or(-1);
    Err(NoEstimate::new_err(crate::cudnn_rnn::refusal(mode)))
}

fn aliases(shared: &Shared, func: &Bound<PyAny>) -> PyResult<Vec<bool>> {
    let key = func.as_ptr() as usize;
    if let Some(known) = books(shared).aliases.get(&key) {
        return Ok(known.clone());
    }
    let mut aliased = Vec::new();
    if let Ok(returns) = func.getattr("_schema").and_then(|s| s.getattr("returns")) {
        for ret in returns.try_iter()? {
            aliased.push(!ret?.getattr("alias_info")?.is_none());
        }
    }
    books(shared).aliases.insert(key, aliased.clone());
    Ok(aliased)
}

/// Enters each storage an operator's outputs made. Outputs the schema marks as aliases (views,
/// in-place and `out=` results) made nothing, unless a known storage grew (`resize_`).
fn enter_outputs(shared: &Shared, context: &Context, func: &Bound<PyAny>, out: &Bound<PyAny>) -> PyResult<()> {
    let aliased = aliases(shared, func)?;
    let several = aliased.len() > 1 && out.is_instance_of::<PyTuple>();
    let positions: Vec<Bound<PyAny>> =
        if several { out.try_iter()?.collect::<PyResult<_>>()? } else { vec![out.clone()] };
    let tensor = context.tensor.bind(out.py());
    for (position, value) in positions.iter().enumerate() {
        let alias = aliased.get(position).copied().unwrap_or(false);
        let items: Vec<Bound<PyAny>> = if value.is_instance_of::<PyList>() || value.is_instance_of::<PyTuple>() {
            value.try_iter()?.collect::<PyResult<_>>()?
        } else {
            vec![value.clone()]
        };
        for item in items.iter().filter(|i| i.is_instance(tensor).unwrap_or(false) && on_target(context, i)) {
            let Ok(storage) = item.call_method0("untyped_storage") else { continue };
            let key = storage.as_ptr() as usize;
            let nbytes: u64 = storage.call_method0("nbytes")?.extract()?;
            let made = {
                let mut books = books(shared);
                match books.entries.get(&key).copied() {
                    Some(entry) => {
                        books.ledger.grew(entry, nbytes);
                        None
                    }
                    None if alias || nbytes == 0 => None,
                    None => Some(books.ledger.made(nbytes)),
                }
            };
            if let Some(entry) = made {
                watch(shared, context, &storage, key, entry)?;
            }
        }
    }
    Ok(())
}
