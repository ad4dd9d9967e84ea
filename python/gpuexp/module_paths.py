"""Module paths on a traced experiment's allocations (``model.layers.3.attn``), through torch's
per-thread memory metadata (``torch.cuda.memory._set_memory_metadata``), which the allocation
history stores on every event.

These are torch hooks, not core logic, and they stay Python functions on purpose: under
``torch.compile`` they return at once (``is_compiling``), where a native callable would break the
graph (and fail ``fullgraph=True``). What the marks mean is decided by the core
(``rust/src/trace/modules.rs``), which reads them back from the snapshot:

- ``forward N: PATH`` while ``PATH``'s forward runs, in the thread that calls the model;
- ``backward N: PATH`` in autograd's thread, from the moment the gradient reaches ``PATH``'s
  output until it leaves through ``PATH``'s input. Autograd's thread keeps its mark after a
  backward ends; ``N``, the forward pass the mark belongs to, lets the core drop such a stale
  mark when a later pass's backward (the loss's own) runs before any module's.
"""

import sys
import threading
import weakref

_handles = []
_state = threading.local()
_paths = weakref.WeakKeyDictionary()
_pass = [0]


def _torch():
    return sys.modules.get("torch")


def available():
    """None when module paths can be recorded, else why not (torch too old, another allocator
    backend, or the user's own metadata, which is never overwritten)."""
    memory = getattr(getattr(_torch(), "cuda", None), "memory", None)
    if memory is None or not hasattr(memory, "_set_memory_metadata"):
        return "module paths need torch >= 2.10 (torch.cuda.memory._set_memory_metadata)"
    supported = getattr(memory, "_memory_metadata_supported", None)
    if supported is not None and not supported():
        return "module paths need torch's native caching allocator (PYTORCH_CUDA_ALLOC_CONF backend)"
    if memory._get_memory_metadata():
        return "module paths are off: this thread already sets its own memory metadata"
    return None


def _root_name(root):
    """The root's name in the user's namespace (``model``), else its class."""
    main = sys.modules.get("__main__")
    for name, value in list(getattr(main, "__dict__", {}).items()):
        if value is root and not name.startswith("_"):
            return name
    return type(root).__name__


def _path_of(module, parent):
    stack = _state.stack
    root = stack[0][0] if stack else module
    paths = _paths.get(root)
    if paths is None or id(module) not in paths:
        prefix = _root_name(root)
        paths = {id(sub): name or prefix for name, sub in root.named_modules(prefix=prefix)}
        _paths[root] = paths
    # A module outside the root's tree (made on the fly) is named once, under its caller.
    return paths.setdefault(id(module), f"{parent}.{type(module).__name__}")


def _first_grad_fn(value):
    if hasattr(value, "grad_fn"):
        return value.grad_fn
    if isinstance(value, (tuple, list)):
        items = value
    elif isinstance(value, dict):
        items = value.values()
    else:
        items = ()
    for item in items:
        if hasattr(item, "grad_fn") and item.grad_fn is not None:
            return item.grad_fn
    return None


def _set(mark):
    _torch().cuda.memory._set_memory_metadata(mark)


def _backward_enter(path, number, is_root):
    def hook(_grad_outputs):
        stack = getattr(_state, "backward", None) or []
        if is_root:
            stack = [entry for entry in stack if entry[0] == number]
        # Modules that share an output node (a block and its last layer) enter in the order
        # their forwards ended, innermost first: a module goes below its own submodules.
        position = len(stack)
        while position and stack[position - 1][1].startswith(path + "."):
            position -= 1
        stack.insert(position, (number, path))
        _state.backward = stack
        _mark_backward(stack)

    return hook


def _backward_leave(path, number):
    def hook(_grad_outputs):
        stack = getattr(_state, "backward", None) or []
        for index in range(len(stack) - 1, -1, -1):
            if stack[index] == (number, path):
                del stack[index]
                break
        _mark_backward(stack)

    return hook


def _mark_backward(stack):
    _set(f"backward {stack[-1][0]}: {stack[-1][1]}" if stack else "")


def _forward_pre(module, args):
    torch = _torch()
    if torch.compiler.is_compiling():
        return
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    if not stack:
        _pass[0] += 1
    path = _path_of(module, stack[-1][1] if stack else "")
    stack.append((module, path))
    _set(f"forward {_pass[0]}: {path}")
    if torch.is_grad_enabled():
        grad_fn = _first_grad_fn(args)
        if grad_fn is not None:
            grad_fn.register_prehook(_backward_leave(path, _pass[0]))


def _forward_post(module, _args, output):
    torch = _torch()
    if torch.compiler.is_compiling():
        return
    stack = getattr(_state, "stack", None)
    if not stack or stack[-1][0] is not module:
        return
    _, path = stack.pop()
    _set(f"forward {_pass[0]}: {stack[-1][1]}" if stack else "")
    if torch.is_grad_enabled():
        grad_fn = _first_grad_fn(output)
        if grad_fn is not None:
            grad_fn.register_prehook(_backward_enter(path, _pass[0], not stack))


def install():
    """Starts marking allocations with module paths; returns why not where it cannot."""
    if _handles:
        return None
    why = available()
    if why is not None:
        return why
    hooks = _torch().nn.modules.module
    _handles.append(hooks.register_module_forward_pre_hook(_forward_pre))
    _handles.append(hooks.register_module_forward_hook(_forward_post, always_call=True))
    return None


def uninstall():
    """Removes the hooks and this thread's mark (autograd's thread keeps its last one, which
    nothing records once the history stops)."""
    if not _handles:
        return
    for handle in _handles:
        handle.remove()
    _handles.clear()
    _state.stack = []
    torch = _torch()
    if torch is not None:
        _set("")
