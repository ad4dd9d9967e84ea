//! The fake side of an estimate. The real model's parameters, gradients and buffers and its
//! optimizers' state are swapped for fake copies made by one `FakeTensorMode`; the step runs
//! under that mode and under the ledger's dispatch mode (`ledger_mode`); then everything
//! swapped is put back, the very objects.

use std::collections::{HashMap, HashSet};

use pyo3::prelude::*;
use pyo3::types::{PyCFunction, PyDict, PyList, PyModule, PyType};

/// Real tensors swapped for fake ones, until `restore`.
pub(super) struct Fakes<'py> {
    pub(super) py: Python<'py>,
    pub(super) torch: Bound<'py, PyAny>,
    pub(super) mode: Bound<'py, PyAny>,
    pub(super) tensor: Bound<'py, PyType>,
    pub(super) fake_tensor: Bound<'py, PyType>,
    /// Real tensor (by address) → its fake copy: a weight tied in two places stays one tensor.
    by_real: HashMap<usize, Bound<'py, PyAny>>,
    pub(super) params: Vec<Bound<'py, PyAny>>,
    pub(super) buffers: Vec<Bound<'py, PyAny>>,
    /// (a module's `_parameters` or `_buffers`, the name, the real tensor).
    swapped: Vec<(Bound<'py, PyDict>, Bound<'py, PyAny>, Bound<'py, PyAny>)>,
    pub(super) optimizers: Vec<SwappedOptimizer<'py>>,
    /// Whether attention's fast path was on before: its nested tensors can't be faked, so it is
    /// off while the step runs.
    fastpath_was: Option<bool>,
    /// An attention module in eval mode was swapped: at inference the fast path would have run.
    pub(super) fastpath_skipped: bool,
    /// Fake tensors' probe of the GPU context, replaced while the step runs: see [`Fakes::quiet_context_probe`].
    context_probe: Option<ContextProbe<'py>>,
    /// Where tensors on the `meta` device (a model planned before its weights exist) are faked.
    target: Bound<'py, PyAny>,
    /// Fakes made for tensors on the `meta` device, by address: they are not allocated now, and
    /// the ledger counts them as loaded before the step.
    pub(super) from_meta: HashSet<usize>,
}

/// `torch._subclasses.fake_tensor`'s function and the name it was found under.
struct ContextProbe<'py> {
    module: Bound<'py, PyAny>,
    name: &'static str,
    original: Bound<'py, PyAny>,
}

pub(super) struct SwappedOptimizer<'py> {
    pub(super) optimizer: Bound<'py, PyAny>,
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
    /// `target` is the `torch.device` the estimate is for.
    pub(super) fn swap_in(
        py: Python<'py>,
        owners: &[Bound<'py, PyAny>],
        target: Bound<'py, PyAny>,
    ) -> PyResult<Fakes<'py>> {
        let torch = py.import("sys")?.getattr("modules")?.get_item("torch")?;
        let fake_tensor = py.import("torch._subclasses.fake_tensor")?;
        let options = PyDict::new(py);
        options.set_item("allow_non_fake_inputs", true)?;
        // Without a fake implementation torch would run the operator for real on zero-filled
        // tensors of the step's sizes, on the device the estimate is meant to spare: refused instead.
        options.set_item("allow_fallback_kernels", false)?;
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
            context_probe: None,
            target,
            from_meta: HashSet::new(),
        };
        // The probe is quieted first: making the first fakes, of the parameters, calls it.
        let quieted = fakes.quiet_context_probe(&fake_tensor);
        let swapped = quieted.and_then(|()| fakes.swap_owners(owners)).and_then(|()| fakes.turn_fastpath_off());
        if let Err(error) = swapped {
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

    /// The first fake tensor on a GPU makes torch allocate a real one-element tensor there, once
    /// per device, so that CUDA is initialised before a backward. Where CUDA already has a
    /// context on that device (the model is there), that allocation only moves torch's peak:
    /// it is skipped, so an estimate allocates nothing at all. Elsewhere torch's probe runs.
    /// The probe is called for every fake tensor made, so the devices are looked up once, here.
    fn quiet_context_probe(&mut self, fake_tensor: &Bound<'py, PyModule>) -> PyResult<()> {
        let cuda = self.torch.getattr("cuda")?;
        let names = ["init_gpu_context", "init_cuda_context"];
        let Some(name) = names.into_iter().find(|n| fake_tensor.hasattr(*n).unwrap_or(false)) else { return Ok(()) };
        // Asked only once CUDA is initialised: asking before would initialise it.
        let (mut with_context, mut current) = (Vec::new(), 0);
        if cuda.call_method0("is_initialized")?.is_truthy()? {
            let has_context = self.torch.getattr("_C")?.getattr("_cuda_hasPrimaryContext")?;
            for index in 0..cuda.call_method0("device_count")?.extract::<i64>()? {
                if has_context.call1((index,))?.is_truthy()? {
                    with_context.push(index);
                }
            }
            current = cuda.call_method0("current_device")?.extract()?;
        }
        let original = fake_tensor.getattr(name)?;
        let probe = original.clone().unbind();
        let quiet = PyCFunction::new_closure(self.py, None, None, move |args, kwargs| -> PyResult<Py<PyAny>> {
            let py = args.py();
            let index = args.get_item(0).ok().and_then(|device| cuda_index(&device, current));
            if index.is_some_and(|index| with_context.contains(&index)) {
                return Ok(py.None());
            }
            Ok(probe.bind(py).call(args, kwargs)?.unbind())
        })?;
        fake_tensor.setattr(name, quiet)?;
        self.context_probe = Some(ContextProbe { module: fake_tensor.clone().into_any(), name, original });
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
        let on_meta = real.getattr("device")?.getattr("type")?.extract::<String>()? == "meta";
        let fake = if on_meta { self.fake_on_target(real)? } else { self.mode.call_method1("from_tensor", (real,))? };
        if on_meta {
            self.from_meta.insert(fake.as_ptr() as usize);
        }
        self.by_real.insert(key, fake.clone());
        Ok(fake)
    }

    /// A tensor on the `meta` device has a size and no data: its fake is made on the estimate's
    /// device, as loading the weights there would make it.
    fn fake_on_target(&self, meta: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let options = PyDict::new(self.py);
        options.set_item("dtype", meta.getattr("dtype")?)?;
        options.set_item("device", &self.target)?;
        let shape = (meta.call_method0("size")?, meta.call_method0("stride")?);
        self.mode.call_method0("__enter__")?;
        let made = self.torch.getattr("empty_strided")?.call(shape, Some(&options));
        let none = self.py.None();
        self.mode.call_method1("__exit__", (&none, &none, &none))?;
        let fake = made?;
        fake.call_method1("requires_grad_", (meta.getattr("requires_grad")?,))?;
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
        if let Some(probe) = self.context_probe.take() {
            if let Err(error) = probe.module.setattr(probe.name, probe.original) {
                first_error.get_or_insert(error);
            }
        }
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
}

/// The index of a `torch.device` of type cuda, `current` where it names none; None for other types.
fn cuda_index(device: &Bound<PyAny>, current: i64) -> Option<i64> {
    if device.getattr("type").ok()?.extract::<String>().ok()? != "cuda" {
        return None;
    }
    let index = device.getattr("index").ok()?;
    if index.is_none() {
        Some(current)
    } else {
        index.extract().ok()
    }
}

impl Drop for Fakes<'_> {
    fn drop(&mut self) {
        let _ = self.restore();
    }
}
