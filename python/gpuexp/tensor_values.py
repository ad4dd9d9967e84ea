"""A real tensor's value and gradient, copied to host memory and put back into the very same
object, for the core's by-value state saving (``verify``'s: ``save_by_value`` in
rust/src/step_state.rs, which walks the containers, decides what is saved and in what order it is
put back). This only copies one tensor and puts it back: identity, storage and autograd's
version counter as before."""

import sys


def saved(tensor):
    """(value, gradient): the copies of ``tensor`` (None where it has no value to copy: a meta or
    sparse tensor) and, for a leaf that takes gradients, of its gradient (else None)."""
    torch = sys.modules["torch"]
    if tensor.is_meta or tensor.layout != torch.strided:
        return None, None
    value = Value(torch, tensor)
    return value, Grad(torch, tensor) if tensor.requires_grad and tensor.is_leaf else None


class Value:
    """A tensor the step may change: the object, its value on the host, its version."""

    __slots__ = ("torch", "tensor", "host", "version", "shape", "dtype", "device", "requires_grad")

    def __init__(self, torch, tensor):
        self.torch, self.tensor = torch, tensor
        self.host = tensor.detach().to("cpu", copy=True)
        # Inference tensors have no version counter (and take in-place updates only in inference mode).
        self.version = None if tensor.is_inference() else tensor._version
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self.requires_grad = tensor.requires_grad  # a step may turn it off (freezing a layer)

    def restore(self):
        torch, tensor = self.torch, self.tensor
        if tensor.shape != self.shape or tensor.dtype != self.dtype or tensor.device != self.device:
            tensor.data = self.host.to(self.device)  # the step resized it: the old shape, new memory
        with torch.inference_mode() if tensor.is_inference() else torch.no_grad():
            tensor.copy_(self.host)
        if tensor.is_leaf and tensor.requires_grad != self.requires_grad:
            tensor.requires_grad_(self.requires_grad)
        _set_version(torch, tensor, self.version)


class Grad:
    """A leaf's gradient. The object is kept for its identity, but its storage is handed to a
    stand-in for the step: a step that drops the gradient (``zero_grad(set_to_none=True)``) frees
    that memory as it would without verify, and the object gets its value back afterwards."""

    __slots__ = ("torch", "leaf", "grad", "host", "version", "pointer")

    def __init__(self, torch, leaf):
        self.torch, self.leaf, self.grad, self.host = torch, leaf, leaf.grad, None
        # None, or a sparse gradient (replaced by a step, never updated in place): only its object is kept.
        if self.grad is None or self.grad.layout != torch.strided:
            return
        self.host = self.grad.detach().to("cpu", copy=True)
        self.version = self.grad._version
        self.pointer = self.grad.data_ptr()
        leaf.grad = self.grad.detach()  # the same storage, another tensor object
        self.grad.data = torch.empty(0, dtype=self.grad.dtype, device=self.grad.device)

    def restore(self):
        torch, now = self.torch, self.leaf.grad
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
        _set_version(torch, self.grad, self.version)


def _set_version(torch, tensor, version):
    if version is not None:
        torch._C._autograd._unsafe_set_version_counter((tensor,), (version,))
