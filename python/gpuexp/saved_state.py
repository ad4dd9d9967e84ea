"""Everything a real training step changes, copied to host memory and put back bit for bit.

``verify`` runs the user's step for real, which moves the parameters, the gradients, the
optimizer's state and step counters, a GradScaler's scale and the RNG. ``capture`` copies all of
it first; ``SavedState.restore`` puts the values back into the very objects that held them
(identity, storage and autograd's version counters as before), so that the notebook goes on as
if the step had never run. What could not be put back is named, and its saved value kept.
"""

import sys

from . import _core

# Containers deeper than this below an optimizer, scaler or object are saved whole but not walked.
DEEPEST = 8


class RestoreFailed(RuntimeError):
    """Some state could not be put back. ``failed`` names each piece and why; ``saved`` maps the
    name of each piece not put back to its value before (a tensor on the host, or a container's
    items), so nothing is lost."""

    def __init__(self, failed, saved):
        self.failed = failed
        """Each piece not put back, with the error that stopped it."""
        self.saved = saved
        """The value before of each piece not put back, by name."""
        listed = "; ".join(failed)
        super().__init__(
            f"verify could not put back {len(failed)} piece(s) of state as it was before the step: {listed}. "
            "Everything else was restored. The values before are in this error's .saved (host copies, by name): "
            "copy them back (tensor.data.copy_(error.saved[name])) before training on."
        )


class _Tensor:
    """A tensor the step may change: the object, its value on the host, its version."""

    __slots__ = ("name", "tensor", "host", "version", "shape", "dtype", "device", "requires_grad")

    def __init__(self, name, tensor):
        self.name = name
        self.tensor = tensor
        self.host = tensor.detach().to("cpu", copy=True)
        # Inference tensors have no version counter (and take in-place updates only in inference mode).
        self.version = None if tensor.is_inference() else tensor._version
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self.requires_grad = tensor.requires_grad  # a step may turn it off (freezing a layer)


class _Grad:
    """A leaf's gradient. The object is kept for its identity, but its storage is handed to a
    stand-in for the step: a step that drops the gradient (``zero_grad(set_to_none=True)``) frees
    that memory as it would without verify, and the object gets its value back afterwards."""

    __slots__ = ("name", "leaf", "grad", "host", "version", "pointer")

    def __init__(self, torch, name, leaf):
        self.name, self.leaf, self.grad, self.host = name, leaf, leaf.grad, None
        # None, or a sparse gradient (replaced by a step, never updated in place): only its object is kept.
        if self.grad is None or self.grad.layout != torch.strided:
            return
        self.host = self.grad.detach().to("cpu", copy=True)
        self.version = self.grad._version
        self.pointer = self.grad.data_ptr()
        stand_in = self.grad.detach()  # the same storage, another tensor object
        leaf.grad = stand_in
        self.grad.data = torch.empty(0, dtype=self.grad.dtype, device=self.grad.device)

    def restore(self, torch):
        now = self.leaf.grad
        if self.grad is None or self.host is None:
            self.leaf.grad = self.grad
            return
        # Where the step kept the storage (accumulated or zeroed in place), the object shares it
        # again, at the same address; where it dropped it, the value comes back in new memory.
        kept = (now is not None and now.data_ptr() == self.pointer and now.shape == self.host.shape
                and now.dtype == self.host.dtype)
        self.grad.data = now if kept else self.host.to(self.grad.device)
        with torch.no_grad():
            self.grad.copy_(self.host)
        self.leaf.grad = self.grad


class SavedState:
    """What ``capture`` copied; ``restore()`` puts it back (once)."""

    def __init__(self, torch):
        self._torch = torch
        self._tensors = {}  # id -> _Tensor
        self._grads = []
        self._containers = []  # (name, container, shallow copy)
        self._training = []  # (name, module, flag)
        self._rngs = None  # the core's saving of the four RNGs (`_core.save_rngs`)
        self._restored = False

    def _add_tensor(self, name, tensor):
        if id(tensor) in self._tensors or tensor.is_meta or tensor.layout != self._torch.strided:
            return
        self._tensors[id(tensor)] = _Tensor(name, tensor)

    def _walk(self, name, value, depth, seen):
        """Saves the dicts and lists below an optimizer, scaler or object, and the tensors in them."""
        torch = self._torch
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            self._add_tensor(name, value)
            return
        if depth > DEEPEST:
            return
        if isinstance(value, dict):
            self._containers.append((name, value, dict(value)))
            for key, item in list(value.items()):
                self._walk(f"{name}[{self._key(key)}]", item, depth + 1, seen)
        elif isinstance(value, list):
            self._containers.append((name, value, list(value)))
            for index, item in enumerate(value):
                self._walk(f"{name}[{index}]", item, depth + 1, seen)
        elif isinstance(value, tuple):
            for index, item in enumerate(value):
                self._walk(f"{name}[{index}]", item, depth + 1, seen)

    def _key(self, key):
        if isinstance(key, self._torch.Tensor):
            saved = self._tensors.get(id(key))
            return saved.name if saved else f"<{type(key).__name__}>"
        return repr(key)

    def restore(self):
        """Puts every value back into the object that held it. Raises ``RestoreFailed`` naming
        what could not be put back; everything else is restored all the same."""
        if self._restored:
            return
        self._restored = True
        torch = self._torch
        failed, kept = [], {}
        for name, container, before in self._containers:
            if not _attempt(failed, name, lambda c=container, b=before: _refill(c, b)):
                kept[name] = before
        versions = []
        for saved in self._tensors.values():
            if _attempt(failed, saved.name, lambda s=saved: _put_back(torch, s)):
                if saved.version is not None:
                    versions.append((saved.tensor, saved.version))
            else:
                kept[saved.name] = saved.host
        for grad in self._grads:
            if _attempt(failed, f"{grad.name}.grad", lambda g=grad: g.restore(torch)):
                if grad.host is not None:
                    versions.append((grad.grad, grad.version))
            elif grad.host is not None:
                kept[f"{grad.name}.grad"] = grad.host
        _attempt(failed, "autograd version counters", lambda: _set_versions(torch, versions))
        for name, module, flag in self._training:
            _attempt(failed, f"{name}.training", lambda m=module, f=flag: setattr(m, "training", f))
        if self._rngs is not None:
            failed.extend(self._rngs.restore())
        if failed:
            raise RestoreFailed(failed, kept)


def capture(modules=(), optimizers=(), scalers=(), objects=()):
    """Copies to host memory all a step can change in these objects, for ``restore()``.

    modules: ``nn.Module`` s: their parameters, gradients, buffers and every submodule's
        ``training`` flag. optimizers: their state (step counters too), ``param_groups`` and
        attributes. scalers: GradScalers (their scale, growth tracker and per-optimizer state).
        objects: anything else the step changes through its attributes (an LR scheduler, an EMA).
    Each is a dict of name to object (the names appear in messages) or a list. The CPU RNG, every
    initialised CUDA device's RNG, Python's ``random`` and NumPy's global RNG are saved too.

    A leaf tensor's gradient is handed to a stand-in tensor (the same storage) until ``restore``:
    the step sees the same values, and frees them if it drops them, as it would without this.
    """
    torch = imported_torch("capture")
    state = SavedState(torch)
    seen = set()
    for name, module in _named(modules, "modules"):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"modules: {name} is a {type(module).__name__}, not a torch.nn.Module")
        for path, parameter in module.named_parameters(prefix=name):
            state._add_tensor(path, parameter)
        for path, buffer in module.named_buffers(prefix=name):
            state._add_tensor(path, buffer)
        for path, sub in module.named_modules(prefix=name):
            state._training.append((path or name, sub, sub.training))
            # A step that rebinds a parameter or buffer (`self.count = self.count + 1`) puts a new
            # tensor in these dicts: they are put back as containers, the old tensors in them.
            for attribute in ("_parameters", "_buffers"):
                held = getattr(sub, attribute, None)
                if isinstance(held, dict):
                    state._containers.append((f"{path or name}.{attribute}", held, dict(held)))
    for kind, group in (("optimizers", optimizers), ("scalers", scalers), ("objects", objects)):
        for name, obj in _named(group, kind):
            attributes = getattr(obj, "__dict__", None)
            if not isinstance(attributes, dict):
                raise TypeError(f"{kind}: {name} ({type(obj).__name__}) has no attributes to save")
            # The attributes themselves first, so that tensors are named by their shortest path.
            state._walk(name, attributes, 0, seen)
    # Every leaf that takes gradients: the modules' parameters and those found in optimizers.
    leaves = [s for s in state._tensors.values() if s.tensor.requires_grad and s.tensor.is_leaf]
    for saved in leaves:
        state._grads.append(_Grad(torch, saved.name, saved.tensor))
    # The RNGs by the estimate's own state saving, the one there is (rust/src/step_state.rs).
    state._rngs = _core.save_rngs()
    return state


def imported_torch(what):
    """The torch the user imported: gpuexp never imports it (nor creates a CUDA context) itself."""
    torch = sys.modules.get("torch")
    if torch is None:
        raise RuntimeError(f"{what} works on the user's torch objects: import torch and build the model first")
    return torch


def _named(group, kind):
    if isinstance(group, dict):
        return list(group.items())
    if isinstance(group, (list, tuple)):
        return [(f"{kind}[{index}]", obj) for index, obj in enumerate(group)]
    raise TypeError(f"{kind} must be a dict of name to object or a list, e.g. {kind}={{'name': obj}}; got {group!r}")


def _refill(container, before):
    """The same container object, holding the same objects as before (where they differ)."""
    if isinstance(container, dict):
        if len(container) != len(before) or any(container.get(k, _MISSING) is not v for k, v in before.items()):
            container.clear()
            container.update(before)
    elif len(container) != len(before) or any(a is not b for a, b in zip(container, before)):
        container[:] = before


_MISSING = object()


def _put_back(torch, saved):
    tensor = saved.tensor
    if tensor.shape != saved.shape or tensor.dtype != saved.dtype or tensor.device != saved.device:
        tensor.data = saved.host.to(saved.device)  # the step resized it: the old shape, new memory
    with torch.inference_mode() if tensor.is_inference() else torch.no_grad():
        tensor.copy_(saved.host)
    if tensor.is_leaf and tensor.requires_grad != saved.requires_grad:
        tensor.requires_grad_(saved.requires_grad)


def _set_versions(torch, versions):
    if versions:
        tensors, numbers = zip(*versions)
        torch._C._autograd._unsafe_set_version_counter(tensors, numbers)


def _attempt(failed, name, put_back):
    try:
        put_back()
        return True
    except Exception as error:  # one piece that fails must not stop the others being restored
        failed.append(f"{name} ({type(error).__name__}: {error})")
        return False
