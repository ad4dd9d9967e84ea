//! The fake side of an estimate. The real model's parameters, gradients and buffers and its
//! optimizers' state are swapped for fake copies made by one `FakeTensorMode`; the step runs
//! under that mode and under a dispatch mode that enters every storage the step makes or
//! frees in the core's [`Ledger`]; then everything swapped is put back, the very objects.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::prelude::*;
use pyo3::types::{PyCFunction, PyDict, PyList, PyTuple, PyType};

use super::estimate::NoEstimate;
use super::holders::Memory;
use crate::estimate::{Category, Entry, Ledger, Peak, Phase, Rounding};

/// Real tensors swapped for fake ones, until `restore`.
pub(super) struct Fakes<'py> {
    py: Python<'py>,
    torch: Bound<'py, PyAny>,
    mode: Bound<'py, PyAny>,
    tensor: Bound<'py, PyType>,
    fake_tensor: Bound<'py, PyType>,
    /// Real tensor (by address) → its fake copy: a weight tied in two places stays one tensor.
    by_real: HashMap<usize, Bound<'py, PyAny>>,
    params: Vec<Bound<'py, PyAny>>,
    buffers: Vec<Bound<'py, PyAny>>,
    /// (a module's `_parameters` or `_buffers`, the name, the real tensor).
    swapped: Vec<(Bound<'py, PyDict>, Bound<'py, PyAny>, Bound<'py, PyAny>)>,
    optimizers: Vec<SwappedOptimizer<'py>>,
    /// Whether attention's fast path was on before: its nested tensors can't be faked, so it is
    /// off while the step runs.
    fastpath_was: Option<bool>,
    /// An attention module in eval mode was swapped: at inference the fast path would have run.
    pub(super) fastpath_skipped: bool,
}

struct SwappedOptimizer<'py> {
    optimizer: Bound<'py, PyAny>,
    real_state: Bound<'py, PyAny>,
    /// Each param group with its contents before: learning rates that a scheduler in the step
    /// changes come back too.
    groups: Vec<(Bound<'py, PyDict>, Bound<'py, PyDict>)>,
}

fn truthy(value: Option<Bound<PyAny>>) -> bool {
    value.is_some_and(|v| v.is_truthy().unwrap_or(false))
}

impl<'py> Fakes<'py> {
    /// Swaps the tensors of `owners` (modules and optimizers) for fakes. On an error, what was
    /// swapped so far is put back before it returns.
    pub(super) fn swap_in(py: Python<'py>, owners: &[Bound<'py, PyAny>]) -> PyResult<Fakes<'py>> {
        let torch = py.import("sys")?.getattr("modules")?.get_item("torch")?;
        let fake_tensor = py.import("torch._subclasses.fake_tensor")?;
        let options = PyDict::new(py);
        options.set_item("allow_non_fake_inputs", true)?;
        let mut fakes = Fakes {
            py,
            mode: fake_tensor.getattr("FakeTensorMode")?.call((), Some(&options))?,
            tensor: torch.getattr("Tensor")?.cast_into()?,
            fake_tensor: fake_tensor.getattr("FakeTensor")?.cast_into()?,
            torch,
            by_real: HashMap::new(),
            params: Vec::new(),
            buffers: Vec::new(),
            swapped: Vec::new(),
            optimizers: Vec::new(),
            fastpath_was: None,
            fastpath_skipped: false,
        };
        if let Err(error) = fakes.swap_owners(owners).and_then(|()| fakes.turn_fastpath_off()) {
            fakes.restore()?;
            return Err(error);
        }
        fakes.forget_conversions();
        Ok(fakes)
    }

    fn swap_owners(&mut self, owners: &[Bound<'py, PyAny>]) -> PyResult<()> {
        let module = self.torch.getattr("nn")?.getattr("Module")?;
        let mut seen = std::collections::HashSet::new();
        let (modules, optimizers): (Vec<_>, Vec<_>) =
            owners.iter().partition(|owner| owner.is_instance(&module).unwrap_or(false));
        for owner in modules {
            for sub in owner.call_method0("modules")?.try_iter()? {
                let sub = sub?;
                if seen.insert(sub.as_ptr() as usize) {
                    self.swap_module(&sub)?;
                }
            }
        }
        for optimizer in optimizers {
            if seen.insert(optimizer.as_ptr() as usize) {
                self.swap_optimizer(optimizer)?;
            }
        }
        Ok(())
    }

    fn mha(&self) -> Option<Bound<'py, PyAny>> {
        self.torch
            .getattr("backends")
            .ok()?
            .getattr("mha")
            .ok()
            .filter(|m| m.hasattr("set_fastpath_enabled").unwrap_or(false))
    }

    fn turn_fastpath_off(&mut self) -> PyResult<()> {
        if let Some(mha) = self.mha() {
            self.fastpath_was = Some(mha.call_method0("get_fastpath_enabled")?.extract()?);
            mha.call_method1("set_fastpath_enabled", (false,))?;
        }
        Ok(())
    }

    fn is_real_tensor(&self, value: &Bound<'py, PyAny>) -> PyResult<bool> {
        Ok(value.is_instance(&self.tensor)? && !value.is_instance(&self.fake_tensor)?)
    }

    fn fake(&mut self, real: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let key = real.as_ptr() as usize;
        if let Some(fake) = self.by_real.get(&key) {
            return Ok(fake.clone());
        }
        let fake = self.mode.call_method1("from_tensor", (real,))?;
        self.by_real.insert(key, fake.clone());
        Ok(fake)
    }

    /// A parameter's fake, with a fake of its gradient.
    fn fake_parameter(&mut self, real: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let known = self.by_real.contains_key(&(real.as_ptr() as usize));
        let fake = self.fake(real)?;
        if !known {
            let grad = real.getattr("grad")?;
            if !grad.is_none() {
                fake.setattr("grad", self.fake(&grad)?)?;
            }
            self.params.push(fake.clone());
        }
        Ok(fake)
    }

    fn swap_module(&mut self, module: &Bound<'py, PyAny>) -> PyResult<()> {
        let nn = self.torch.getattr("nn")?;
        for attention in ["TransformerEncoderLayer", "MultiheadAttention"] {
            if module.is_instance(&nn.getattr(attention)?)? && !module.getattr("training")?.is_truthy()? {
                self.fastpath_skipped = true;
            }
        }
        for (attribute, parameters) in [("_parameters", true), ("_buffers", false)] {
            let Ok(tensors) = module.getattr(attribute).and_then(|d| Ok(d.cast_into::<PyDict>()?)) else { continue };
            for (name, real) in tensors.copy()?.iter() {
                if !self.is_real_tensor(&real)? {
                    continue;
                }
                let fake = if parameters {
                    self.fake_parameter(&real)?
                } else {
                    let fake = self.fake(&real)?;
                    self.buffers.push(fake.clone());
                    fake
                };
                tensors.set_item(&name, fake)?;
                self.swapped.push((tensors.clone(), name, real));
            }
        }
        Ok(())
    }

    /// An optimizer's state as fakes. A scalar on the host (Adam's `step`) becomes a fake that
    /// keeps a copy of its value, since the optimizer reads it with `.item()`.
    fn fake_state(&mut self, real: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let scalar = real.call_method0("numel")?.extract::<u64>()? <= 1;
        let on_host = real.getattr("device")?.getattr("type")?.extract::<String>()? == "cpu";
        if !(scalar && on_host) {
            return self.fake(real);
        }
        let options = PyDict::new(self.py);
        options.set_item("make_constant", true)?;
        let converter = self.mode.getattr("fake_tensor_converter")?;
        converter.call_method("from_real_tensor", (&self.mode, real.call_method0("clone")?), Some(&options))
    }

    fn swap_optimizer(&mut self, optimizer: &Bound<'py, PyAny>) -> PyResult<()> {
        let py = self.py;
        let real_state = optimizer.getattr("state")?;
        let state = py.import("collections")?.getattr("defaultdict")?.call1((py.get_type::<PyDict>(),))?;
        for (param, values) in real_state.cast::<PyDict>()?.iter() {
            let copy = PyDict::new(py);
            if let Ok(values) = values.cast::<PyDict>() {
                for (key, value) in values.iter() {
                    let value = if self.is_real_tensor(&value)? { self.fake_state(&value)? } else { value };
                    copy.set_item(key, value)?;
                }
            }
            state.set_item(self.fake_parameter(&param)?, copy)?;
        }
        // The optimizer picks its implementation from its parameters' type, and fakes would get
        // the per-tensor loop, whose peak differs: the real parameters choose, as they would.
        let choose = py.import("torch.optim.optimizer")?.getattr("_default_to_fused_or_foreach")?;
        let mut groups = Vec::new();
        for group in optimizer.getattr("param_groups")?.try_iter()? {
            let group = group?.cast_into::<PyDict>()?;
            let before = group.copy()?;
            let reals = group.get_item("params")?.ok_or_else(|| pyo3::exceptions::PyKeyError::new_err("params"))?;
            let default_foreach = group.get_item("foreach")?.is_some_and(|f| f.is_none());
            if default_foreach && !truthy(group.get_item("fused")?) {
                let differentiable = truthy(group.get_item("differentiable")?);
                let (_, foreach): (bool, bool) = choose.call1((&reals, differentiable))?.extract()?;
                // As the optimizers do: a tensor learning rate without `capturable` keeps the loop.
                let lr_tensor = group.get_item("lr")?.is_some_and(|lr| lr.is_instance(&self.tensor).unwrap_or(false));
                let loop_kept = lr_tensor && !truthy(group.get_item("capturable")?);
                group.set_item("foreach", foreach && !loop_kept)?;
            }
            let fakes = PyList::empty(py);
            for real in reals.try_iter()? {
                fakes.append(self.fake_parameter(&real?)?)?;
            }
            group.set_item("params", fakes)?;
            groups.push((group, before));
        }
        optimizer.setattr("state", state)?;
        self.optimizers.push(SwappedOptimizer { optimizer: optimizer.clone(), real_state, groups });
        Ok(())
    }

    /// The converter remembers each real tensor's fake; forgetting lets a fake gradient that
    /// the step sets to None be freed, as the real one would be.
    fn forget_conversions(&self) {
        let Ok(converter) = self.mode.getattr("fake_tensor_converter") else { return };
        let meta = converter.getattr("meta_converter").ok();
        let memos = [
            converter.getattr("tensor_memo").ok(),
            meta.as_ref().and_then(|m| m.getattr("tensor_memo").ok()),
            meta.as_ref().and_then(|m| m.getattr("storage_memo").ok()),
        ];
        for memo in memos.into_iter().flatten() {
            let _ = memo.call_method0("clear");
        }
    }

    /// Puts back every real tensor, state and param group, and attention's fast path; safe to
    /// call twice.
    pub(super) fn restore(&mut self) -> PyResult<()> {
        let mut first_error = None;
        if let (Some(was), Some(mha)) = (self.fastpath_was.take(), self.mha()) {
            if let Err(error) = mha.call_method1("set_fastpath_enabled", (was,)) {
                first_error.get_or_insert(error);
            }
        }
        for (tensors, name, real) in self.swapped.drain(..).rev() {
            if let Err(error) = tensors.set_item(name, real) {
                first_error.get_or_insert(error);
            }
        }
        for swapped in self.optimizers.drain(..) {
            if let Err(error) = swapped.optimizer.setattr("state", swapped.real_state) {
                first_error.get_or_insert(error);
            }
            for (group, before) in swapped.groups {
                group.clear();
                if let Err(error) = group.update(before.as_mapping()) {
                    first_error.get_or_insert(error);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Runs `body` with the ledger's dispatch mode inside the fake mode; the peak it found.
    pub(super) fn run<T>(
        &mut self,
        memory: &Memory,
        body: impl FnOnce(&Ledgered<'py>) -> PyResult<T>,
    ) -> PyResult<(Peak, T)> {
        let ledgered = Ledgered::open(self, memory)?;
        self.mode.call_method0("__enter__")?;
        let entered = ledgered.mode.call_method0("__enter__");
        let outcome = entered.and_then(|_| body(&ledgered));
        let none = self.py.None();
        let exited = ledgered
            .mode
            .call_method1("__exit__", (&none, &none, &none))
            .and(self.mode.call_method1("__exit__", (&none, &none, &none)));
        let marked = ledgered.mark_gradients_and_state();
        let peak = books(&ledgered.shared).ledger.peak();
        ledgered.close()?;
        let outcome = outcome?;
        exited?;
        marked?;
        Ok((peak, outcome))
    }
}

impl Drop for Fakes<'_> {
    fn drop(&mut self) {
        let _ = self.restore();
    }
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
    shared.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
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
        };
        for param in &fakes.params {
            ledgered.enter_existing(param, Category::Parameters)?;
            ledgered.enter_existing(&param.getattr("grad")?, Category::Gradients)?;
        }
        for buffer in &fakes.buffers {
            ledgered.enter_existing(buffer, Category::Buffers)?;
        }
        for tensor in ledgered.state_tensors()? {
            ledgered.enter_existing(&tensor, Category::OptimizerState)?;
        }
        ledgered.install_hooks()?;
        ledgered.mode = ledgered.dispatch_mode()?;
        Ok(ledgered)
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
        let entry = books(&self.shared).ledger.existing(nbytes, category);
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
