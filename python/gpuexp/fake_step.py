"""What torch finds in place of its own objects, and calls back, while ``gpuexp.estimate`` runs a
step under fake tensors: the model's tensors and its optimizers' state swapped for fakes
(``Fakes``), the dispatch mode that enters each operator's storages in the core's ledger
(``LedgerMode``), the hooks that mark gradients, optimizer state and the optimizer's step
(``mark_hooks``), what they report to the core's books (``LedgerRun``), and a GradScaler's inf
check skipped (``assume_finite_gradients``).

This is torch instrumentation, so it is Python (docs/ARCHITECTURE.md, "Where torch
instrumentation goes"): it subclasses, hooks and stands in for torch's own code, written the way
torch documents it. What an operator made, which storage is which and what the step's peak is are
the core's (``rust/src/estimate.rs``), reached through plain calls
(``rust/src/bindings/instrumentation/ledger_mode.rs``). Torch is imported already when these run: the estimate
refuses to start without it.
"""

import collections
import sys
import weakref

from . import scalar_reads

# Fake tensors' probe of the GPU context, under its names in torch's versions.
_CONTEXT_PROBES = ("init_gpu_context", "init_cuda_context")


def _reads_env():
    """The fake mode's ``ShapeEnv``, there only so that a read (``.item()``, ``.tolist()``) gives
    torch's unbacked symbol instead of failing; sizes stay static (``static_shapes``), and an
    operator whose output's size depends on data (``nonzero``) is still refused, as without it."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return ShapeEnv(allow_scalar_outputs=True, allow_dynamic_output_shape_ops=False)


class Fakes:
    """The real parameters, gradients and buffers of ``owners`` (the modules and optimizers the
    step reaches) and their optimizers' state swapped for fake copies made by one
    ``FakeTensorMode``. ``target`` is the ``torch.device`` the estimate is for: tensors on the
    ``meta`` device are faked there. The real tensors, state and param groups are put back by the
    estimate's one state saving (``rust/src/step_state.rs``), which saved the containers they
    are swapped into before this ran (each module's ``_parameters`` and ``_buffers``, each
    optimizer's attributes and param groups); ``restore()`` puts back torch's own settings. On an
    error, those are put back before it raises."""

    def __init__(self, owners, target):
        from torch._subclasses import fake_tensor

        self._torch = torch = sys.modules["torch"]
        # Without a fake implementation torch would run the operator for real on zero-filled
        # tensors of the step's sizes, on the device the estimate is meant to spare: refused instead.
        self.mode = fake_tensor.FakeTensorMode(
            allow_non_fake_inputs=True, allow_fallback_kernels=False, shape_env=_reads_env(), static_shapes=True
        )
        self.tensor, self.fake_tensor = torch.Tensor, fake_tensor.FakeTensor
        self._target = target
        self._by_real = {}  # id of a real tensor: its fake, so a weight tied in two places stays one
        self.params, self.buffers, self.optimizers = [], [], []
        self.from_meta = set()  # ids of the fakes of meta tensors: loaded before the step, not allocated now
        # An attention module in eval mode was swapped: at inference the fast path would have run.
        self.fastpath_skipped = False
        self._undo = []  # what puts torch's own settings back: the context probe, attention's fast path
        try:
            # The probe is quieted first: making the first fakes, of the parameters, calls it.
            self._quiet_context_probe(fake_tensor)
            self._swap_owners(owners)
            self._turn_fastpath_off()
        except BaseException:
            self.restore()
            raise
        self._forget_conversions()
        # Tied weights are found while swapping; kept past it, this map would keep each fake
        # gradient alive after the step's `zero_grad(set_to_none=True)` drops it, and a step
        # that starts by freeing the last step's gradients would be estimated as if it did not.
        self._by_real.clear()

    def _swap_owners(self, owners):
        module = self._torch.nn.Module
        seen = set()
        for owner in [o for o in owners if isinstance(o, module)]:
            for sub in owner.modules():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    self._swap_module(sub)
        for optimizer in [o for o in owners if not isinstance(o, module)]:
            if id(optimizer) not in seen:
                seen.add(id(optimizer))
                self._swap_optimizer(optimizer)

    def _turn_fastpath_off(self):
        """Attention's fast path makes nested tensors, which can't be faked: off while the step runs."""
        mha = getattr(self._torch.backends, "mha", None)
        if hasattr(mha, "set_fastpath_enabled"):
            was = mha.get_fastpath_enabled()
            mha.set_fastpath_enabled(False)
            self._undo.append(lambda: mha.set_fastpath_enabled(was))

    def _quiet_context_probe(self, fake_tensor):
        """The first fake tensor on a GPU makes torch allocate a real one-element tensor there, once
        per device, so that CUDA is initialised before a backward. Where CUDA already has a context
        on that device (the model is there), that allocation only moves torch's peak: it is
        skipped, so an estimate allocates nothing at all. Elsewhere torch's probe runs. The probe
        is called for every fake tensor made, so the devices are looked up once, here."""
        name = next((name for name in _CONTEXT_PROBES if hasattr(fake_tensor, name)), None)
        if name is None:
            return
        cuda, with_context, current = self._torch.cuda, set(), 0
        # Asked only once CUDA is initialised: asking before would initialise it.
        if cuda.is_initialized():
            has_context = self._torch._C._cuda_hasPrimaryContext
            with_context = {index for index in range(cuda.device_count()) if has_context(index)}
            current = cuda.current_device()
        probe = getattr(fake_tensor, name)

        def quiet(*args, **kwargs):
            device = args[0] if args else None
            if getattr(device, "type", None) == "cuda":
                if (current if device.index is None else device.index) in with_context:
                    return None
            return probe(*args, **kwargs)

        setattr(fake_tensor, name, quiet)
        self._undo.append(lambda: setattr(fake_tensor, name, probe))

    def _is_real(self, value):
        return isinstance(value, self.tensor) and not isinstance(value, self.fake_tensor)

    def _fake(self, real):
        fake = self._by_real.get(id(real))
        if fake is None:
            if real.device.type == "meta":
                fake = self._fake_on_target(real)
                self.from_meta.add(id(fake))
            else:
                fake = self.mode.from_tensor(real)
            self._by_real[id(real)] = fake
        return fake

    def _fake_on_target(self, meta):
        """A tensor on the ``meta`` device has a size and no data: its fake is made on the
        estimate's device, as loading the weights there would make it."""
        with self.mode:
            fake = self._torch.empty_strided(meta.size(), meta.stride(), dtype=meta.dtype, device=self._target)
        return fake.requires_grad_(meta.requires_grad)

    def _fake_parameter(self, real):
        """A parameter's fake, with a fake of its gradient."""
        known = id(real) in self._by_real
        fake = self._fake(real)
        if not known:
            if real.grad is not None:
                fake.grad = self._fake(real.grad)
            self.params.append(fake)
        return fake

    def _swap_module(self, module):
        nn = self._torch.nn
        if isinstance(module, (nn.TransformerEncoderLayer, nn.MultiheadAttention)) and not module.training:
            self.fastpath_skipped = True
        for attribute, parameters in (("_parameters", True), ("_buffers", False)):
            tensors = getattr(module, attribute, None)
            if not isinstance(tensors, dict):
                continue
            for name, real in list(tensors.items()):
                if not self._is_real(real):
                    continue
                if parameters:
                    fake = self._fake_parameter(real)
                else:
                    fake = self._fake(real)
                    self.buffers.append(fake)
                tensors[name] = fake

    def _fake_state(self, real):
        """An optimizer's state as a fake. A scalar on the host (Adam's ``step``) becomes a fake
        that keeps a copy of its value, since the optimizer reads it with ``.item()``."""
        if real.numel() <= 1 and real.device.type == "cpu":
            converter = self.mode.fake_tensor_converter
            return converter.from_real_tensor(self.mode, real.clone(), make_constant=True)
        return self._fake(real)

    def _swap_optimizer(self, optimizer):
        from torch.optim.optimizer import _default_to_fused_or_foreach

        real_state = optimizer.state
        state = collections.defaultdict(dict)
        for param, values in real_state.items():
            copy = {}
            if isinstance(values, dict):
                copy = {key: self._fake_state(v) if self._is_real(v) else v for key, v in values.items()}
            state[self._fake_parameter(param)] = copy
        # The optimizer picks its implementation from its parameters' type, and fakes would get
        # the per-tensor loop, whose peak differs: the real parameters choose, as they would.
        for group in optimizer.param_groups:
            reals = group["params"]
            if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                _, foreach = _default_to_fused_or_foreach(reals, bool(group.get("differentiable")))
                # As the optimizers do: a tensor learning rate without `capturable` keeps the loop.
                loop_kept = isinstance(group.get("lr"), self.tensor) and not group.get("capturable")
                group["foreach"] = bool(foreach) and not loop_kept
            group["params"] = [self._fake_parameter(real) for real in reals]
        optimizer.state = state
        self.optimizers.append(optimizer)

    def _forget_conversions(self):
        """The converter remembers each real tensor's fake; forgetting (with ``_by_real``) lets a
        fake gradient that the step sets to None be freed, as the real one would be."""
        converter = getattr(self.mode, "fake_tensor_converter", None)
        meta = getattr(converter, "meta_converter", None)
        for owner, memo in ((converter, "tensor_memo"), (meta, "tensor_memo"), (meta, "storage_memo")):
            clear = getattr(getattr(owner, memo, None), "clear", None)
            if clear is not None:
                clear()

    def restore(self):
        """Puts back torch's own settings (the context probe, attention's fast path); safe to
        call twice. Each is put back before the first error met is raised."""
        errors = []
        while self._undo:
            try:
                self._undo.pop(0)()
            except Exception as error:  # noqa: BLE001  (raised below, once the rest is back)
                errors.append(error)
        if errors:
            raise errors[0]


def ledger_mode(dispatch):
    """A ``TorchDispatchMode`` that runs each operator through ``dispatch(func, args, kwargs)``,
    the core's books, which runs it (in the fake mode below) and enters what it made."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LedgerMode(TorchDispatchMode):
        pass

    def torch_dispatch(mode, func, types, args=(), kwargs=None):
        return dispatch(func, args, kwargs)

    # Set once the class is made: one written in its body, TorchDispatchMode wraps to keep
    # torch.compile out of it, a cost on every operator that the books do not need.
    LedgerMode.__torch_dispatch__ = torch_dispatch
    return LedgerMode()


def mark_hooks(params, before_step, after_step, accumulated):
    """Torch's hooks for the books: ``before_step(optimizer)`` and ``after_step(optimizer)`` around
    every optimizer's step (global hooks), ``accumulated(param)`` as each parameter that requires
    grad has its gradient accumulated. The handles, to remove them."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    # Hooks return None: a tuple would be taken for new arguments.
    def before(optimizer, args, kwargs):
        before_step(optimizer)

    def after(optimizer, args, kwargs):
        after_step(optimizer)

    def accumulated_grad(param):
        accumulated(param)

    handles = [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]
    for param in params:
        if param.requires_grad:
            handles.append(param.register_post_accumulate_grad_hook(accumulated_grad))
    return handles


def assume_finite_gradients(scaler):
    """``GradScaler._maybe_opt_step`` reads the inf check with ``.item()``, which has no value under
    fake tensors: for the estimate, the scaler steps its optimizer as it does when the gradients
    are finite, the step that needs the memory. Set on the instance, whose ``__dict__`` the
    estimate saved before, so putting it back removes this."""

    def step(optimizer, optimizer_state, *args, **kwargs):
        return optimizer.step(*args, **kwargs)

    scaler.__dict__["_maybe_opt_step"] = step


class LedgerRun:
    """The books of one estimate kept while its step runs: each storage on ``target`` (the
    ``torch.device`` of the estimate) that exists before the step, or that an operator makes, is
    reported to ``books`` (the core's ``estimate_books::LedgerBooks``, through
    ``rust/src/bindings/instrumentation/ledger_mode.rs``) with a weak reference that reports its freeing; torch's
    hooks report gradients, optimizer state and the optimizer's step. ``mode`` is the dispatch
    mode to enter inside ``fakes.mode``; ``close()`` removes the hooks and the weak references.
    On an error, what was installed so far is removed before it raises."""

    def __init__(self, fakes, books, target):
        torch = sys.modules["torch"]
        self._books, self._target = books, target
        self._tensor, self._fake_tensor = fakes.tensor, fakes.fake_tensor
        self._params, self._optimizers, self._from_meta = fakes.params, fakes.optimizers, fakes.from_meta
        self._current_node = torch._C._current_autograd_node
        self._weakrefs, self._hooks = [], []
        self._aliases = {}  # per operator: whether each of its returns aliases an input
        self.last_op = None  # the operator running or last run: an error names it
        self.mode = None
        self._read = torch.ops.aten._local_scalar_dense.default
        self._symbols = (torch.SymInt, torch.SymFloat, torch.SymBool)
        self._stand_ins = None
        try:
            self._stand_ins = scalar_reads.StandIns(fakes.mode, books)
            for param in fakes.params:
                self._enter_existing(param, "parameters")
                self._enter_existing(param.grad, "gradients")
            for buffer in fakes.buffers:
                self._enter_existing(buffer, "buffers")
            for tensor in self._state_tensors(self._optimizers):
                self._enter_existing(tensor, "optimizer state")
            self._hooks = mark_hooks(fakes.params, self._before_step, self._after_step, self._accumulated)
            self.mode = ledger_mode(self._dispatch)
        except BaseException:
            self.close()
            raise

    def _on_target(self, tensor):
        try:
            # A fake tensor's device is a plain attribute; `device` would dispatch to the fake mode.
            device = tensor.fake_device if hasattr(tensor, "fake_device") else tensor.device
            return bool(device == self._target)
        except Exception:  # noqa: BLE001  (a tensor whose device can't be read is not on the target)
            return False

    def _enter_existing(self, tensor, category):
        if tensor is None or not self._on_target(tensor):
            return
        storage = tensor.untyped_storage()
        entry = self._books.existing(id(storage), storage.nbytes(), category, id(tensor) in self._from_meta)
        if entry is not None:
            self._watch(storage, entry)

    def _watch(self, storage, entry):
        """Tells the books when ``storage`` is freed: a weak reference whose callback runs as it dies."""
        books, key = self._books, id(storage)
        self._weakrefs.append(weakref.ref(storage, lambda _: books.freed(key, entry)))

    def _state_tensors(self, optimizers):
        """The tensors in the (fake) state of ``optimizers``."""
        tensor = self._tensor
        found = []
        for optimizer in optimizers:
            for values in optimizer.state.values():
                if isinstance(values, dict):
                    found.extend(value for value in values.values() if isinstance(value, tensor))
        return found

    def _mark(self, tensor, category):
        if tensor is not None:
            self._books.mark(id(tensor.untyped_storage()), category)

    def optimizer_state_entries(self):
        """How many parameters have optimizer state: it grows when a step creates it."""
        return sum(len(optimizer.state) for optimizer in self._optimizers)

    def call_step(self, step, batch, returned):
        """Calls ``step(batch)``, keeping what it returns in ``returned`` (an output outlives the
        step); whether the call created optimizer state. Its error is raised as ``NoEstimate``,
        naming the operator it failed at."""
        from gpuexp._core import NoEstimate

        before = self.optimizer_state_entries()
        try:
            returned.append(step(batch))
        except (NoEstimate, KeyboardInterrupt, SystemExit):
            raise  # an interrupt or an exit leaves as itself
        except BaseException as error:  # noqa: BLE001  (each is raised again, as NoEstimate)
            symbols = scalar_reads.guarded_symbols(error)
            if symbols is not None:
                raise self._books.needed(symbols, *scalar_reads.users_place_in(error.__traceback__)) from error
            operator = getattr(error, "func", None)
            if operator is None:
                operator = self.last_op
            failed = self._books.failed_at(
                None if operator is None else str(operator), type(error).__name__, _text(error), _users_line(error)
            )
            raise failed from error
        return self.optimizer_state_entries() > before

    def mark_gradients_and_state(self):
        """Marks every gradient and optimizer state there is once the step has run."""
        for param in self._params:
            self._mark(param.grad, "gradients")
        for tensor in self._state_tensors(self._optimizers):
            self._mark(tensor, "optimizer state")

    # The optimizer's step is its own phase, and marks the state it made; each gradient is
    # marked as it is accumulated, since the step may free it (`zero_grad`) before it ends.
    def _before_step(self, optimizer):
        self._books.enter_optimizer()

    def _after_step(self, optimizer):
        for tensor in self._state_tensors([optimizer]):
            self._mark(tensor, "optimizer state")
        self._books.leave_optimizer()

    def _accumulated(self, param):
        self._mark(param.grad, "gradients")

    def _dispatch(self, func, args, kwargs):
        """Each operator of the step: runs it (in the fake mode below) and enters the storages it
        made. A read of a tensor's value makes nothing: it is no operator of the ledger's, and
        the symbol standing in for the value is reported with where the user's code read it."""
        if func is self._read:
            value = func(*args, **kwargs) if kwargs else func(*args)
            if isinstance(value, self._symbols):
                place = scalar_reads.users_place(sys._getframe(1))
                # A bool's stands for `Eq(u0, 1)`: its symbol is what a guard names.
                for symbol in value.node.expr.free_symbols:
                    self._books.read(str(symbol), *place)
            return value
        self._books.operator(self._current_node() is not None)
        self.last_op = func
        self._refuse_real_leaves(args, kwargs)
        name = getattr(func, "__name__", "")
        if isinstance(name, str) and name.startswith("_cudnn_rnn."):
            # `_cudnn_rnn(input, weight, weight_stride0, weight_buf, hx, cx, mode, hidden_size, ...)`
            mode = args[6] if len(args) > 6 and isinstance(args[6], int) else -1
            raise self._books.cudnn_rnn_refusal(mode)
        out = func(*args, **kwargs) if kwargs else func(*args)
        self._enter_outputs(func, out)
        return out

    def _refuse_real_leaves(self, args, kwargs):
        """A real tensor that requires grad would tie the step's graph to the real model, and
        backward would set its ``.grad`` to a fake: a parameter the walk did not find stops the estimate."""
        tensor, fake = self._tensor, self._fake_tensor
        values = list(args) + list(kwargs.values()) if kwargs else args
        for value in values:
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, tensor) and not isinstance(item, fake) and item.requires_grad:
                    raise self._books.unknown_parameter(id(item), str(item.shape))

    def _returns_aliased(self, func):
        known = self._aliases.get(func)
        if known is None:
            try:
                returns = func._schema.returns
            except Exception:  # noqa: BLE001  (an operator without a schema aliases nothing)
                returns = ()
            known = self._aliases[func] = [ret.alias_info is not None for ret in returns]
        return known

    def _enter_outputs(self, func, out):
        """Enters each storage an operator's outputs hold, with whether the schema marks that
        output an alias (the books decide what that means)."""
        aliased = self._returns_aliased(func)
        positions = list(out) if len(aliased) > 1 and isinstance(out, tuple) else [out]
        tensor, books = self._tensor, self._books
        for position, value in enumerate(positions):
            alias = aliased[position] if position < len(aliased) else False
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if not (isinstance(item, tensor) and self._on_target(item)):
                    continue
                try:
                    storage = item.untyped_storage()
                except Exception:  # noqa: BLE001, S112  (a tensor without storage made none)
                    continue
                entry = books.output(id(storage), storage.nbytes(), alias)
                if entry is not None:
                    self._watch(storage, entry)

    def close(self):
        """Removes the hooks and drops the weak references, so that nothing reports any more."""
        self._weakrefs.clear()
        if self._stand_ins is not None:
            self._stand_ins.remove()
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook.remove()


def _users_line(error):
    """Where the user's own code raised ``error``: ``file:line`` of the innermost frame outside
    torch and gpuexp, where the error was raised there (None where torch raised it: an operator
    under fake tensors, named by the caller)."""
    innermost, users = None, None
    trace = error.__traceback__
    while trace is not None:
        innermost = trace
        if scalar_reads.is_users(trace.tb_frame.f_code.co_filename):
            users = trace
        trace = trace.tb_next
    if users is None or users is not innermost:
        return None
    return f"{users.tb_frame.f_code.co_filename}:{users.tb_lineno}"


def _text(error):
    """``str(error)``, or nothing where that raises."""
    try:
        return str(error)
    except Exception:  # noqa: BLE001
        return ""
