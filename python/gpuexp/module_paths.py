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

Only blocks are marked in forward (the model and its modules that have submodules, a plain
``Sequential`` inside it aside): a leaf module (a ``Linear``, a ``ReLU``) counts to its block.
Backward follows fewer of them, the model's layers (``_layers``): each followed block costs every
step a call from autograd's thread. Global module hooks would put every module call on torch's
slow path and cost a transformer's step 3 to 8% on an H100 (bench/RESULTS.md), so a global hook
only finds models: the first call of a model not seen yet, at the top level, hooks that model's
blocks one by one and the global hook goes. It comes back at each cell and each traced
experiment, to find the models made since.
"""

import functools
import sys
import threading
import weakref

_handles = []  # the blocks' hooks
_discovery = []  # the global hook that finds models, while armed
_hooked = weakref.WeakSet()  # models whose blocks are hooked
_state = threading.local()
_paths = weakref.WeakKeyDictionary()
_pass = [0]
# torch's functions the hooks call, bound by install().
_set = _is_compiling = _grad_enabled = _tensor = None
_failure = []  # the first error a hook met: marking stops, the model runs on


def _guarded(hook):
    """A hook that never breaks the user's forward or backward: an error stops the marking and
    is kept for the report's note."""

    @functools.wraps(hook)
    def guarded(*args):
        if _failure:
            return None
        try:
            return hook(*args)
        except Exception as error:  # noqa: BLE001 - any error is the hooks', never the user's
            _failure.append(f"module paths stopped: {type(error).__name__}: {error}")
            return None

    return guarded


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


def _named_tree(root):
    prefix = _root_name(root)
    paths = {id(sub): name or prefix for name, sub in root.named_modules(prefix=prefix)}
    _paths[root] = paths
    return paths


def _path_of(module, stack):
    if not stack:
        paths = _paths.get(module)
        _state.paths = paths if paths is not None else _named_tree(module)
    path = _state.paths.get(id(module))
    if path is None:
        # A module added since the root was named, or one outside its tree (made on the fly).
        _state.paths = _named_tree(stack[0][0])
        path = _state.paths.setdefault(id(module), f"{stack[-1][1]}.{type(module).__name__}")
    return path


def _first_grad_fn(value):
    # Tensors only: a user's object is never asked for attributes it may compute.
    if isinstance(value, _tensor):
        return value.grad_fn
    if isinstance(value, (tuple, list)):
        items = value
    elif isinstance(value, dict):
        items = value.values()
    else:
        items = ()
    for item in items:
        if isinstance(item, _tensor) and item.grad_fn is not None:
            return item.grad_fn
    return None


def _backward_enter(path, number, is_root):
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


def _backward_leave(path, number):
    stack = getattr(_state, "backward", None) or []
    for index in range(len(stack) - 1, -1, -1):
        if stack[index] == (number, path):
            del stack[index]
            break
    _mark_backward(stack)


@_guarded
def _gradient_reached(steps, _grad_outputs):
    for step in steps:
        step()


def _when_gradient_reaches(node, step):
    """Runs `step` (a block's backward entered or left) when the gradient reaches `node`. A block's
    output is often the next block's input: that node's one hook runs both steps, in the order
    they were asked for, since a hook costs a launch-bound step more than its steps do."""
    last = getattr(_state, "last_hooked", None)
    if last is not None and last[0] is node:
        last[1].append(step)
        return
    steps = [step]
    node.register_prehook(functools.partial(_gradient_reached, steps))
    _state.last_hooked = (node, steps)


def _mark_backward(stack):
    _set(f"backward {stack[-1][0]}: {stack[-1][1]}" if stack else "")


@_guarded
def _forward_pre(follows_backward, module, args):
    if _is_compiling():
        return
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    if not stack:
        _pass[0] += 1
    path = _path_of(module, stack)
    stack.append((module, path))
    _set(f"forward {_pass[0]}: {path}")
    if follows_backward and _grad_enabled():
        grad_fn = _first_grad_fn(args)
        if grad_fn is not None:
            _when_gradient_reaches(grad_fn, functools.partial(_backward_leave, path, _pass[0]))


@_guarded
def _forward_post(follows_backward, module, _args, output):
    if _is_compiling():
        return
    stack = getattr(_state, "stack", None)
    if not stack or stack[-1][0] is not module:
        return
    _, path = stack.pop()
    _set(f"forward {_pass[0]}: {stack[-1][1]}" if stack else "")
    if follows_backward and _grad_enabled():
        grad_fn = _first_grad_fn(output)
        if grad_fn is not None:
            _when_gradient_reaches(grad_fn, functools.partial(_backward_enter, path, _pass[0], not stack))
    if not stack:
        _state.last_hooked = None  # no node outlives its forward pass here


def _layers(model, nn):
    """The modules whose backward is followed: the model, its own children and each element of a
    ModuleList, Sequential or ModuleDict (a transformer's layers, a ResNet's blocks). Each costs
    a hook or two that autograd's thread calls in every step, which cost a 6-layer transformer's
    step 2 to 3% on an H100 when every block had them (bench/RESULTS.md)."""
    containers = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
    parents = (parent for parent in model.modules() if parent is model or isinstance(parent, containers))
    return {id(model)} | {id(child) for parent in parents for child in parent.children()}


@_guarded
def _discover(module, args):
    # A layer called on its own (a loss module) is no model: the search goes on.
    if _is_compiling() or getattr(_state, "stack", None) or not module._modules:
        return
    _disarm()
    if module in _hooked:
        return
    _hooked.add(module)
    nn = _torch().nn
    layers = _layers(module, nn)
    for block in module.modules():
        # A plain Sequential only chains its layers: its block already names them.
        if block is module or (block._modules and type(block) is not nn.Sequential):
            follows_backward = id(block) in layers
            pre = functools.partial(_forward_pre, follows_backward)
            _handles.append(block.register_forward_pre_hook(pre))
            post = functools.partial(_forward_post, follows_backward)
            _handles.append(block.register_forward_hook(post, always_call=True))
    # This call began before its own hooks existed.
    _forward_pre(True, module, args)


def _disarm():
    if _discovery:
        _discovery.pop().remove()


def arm():
    """Finds the next model called at the top level (a cell's start, an experiment's opening)."""
    if _set is not None and not _discovery:
        _discovery.append(_torch().nn.modules.module.register_module_forward_pre_hook(_discover))


def install():
    """Starts marking allocations with module paths; returns why not where it cannot."""
    global _set, _is_compiling, _grad_enabled, _tensor
    if _set is not None:
        arm()
        return None
    why = available()
    if why is not None:
        return why
    torch = _torch()
    # Bound once: the hooks run on every block's call.
    _set = torch.cuda.memory._set_memory_metadata
    _is_compiling = torch.compiler.is_compiling
    _grad_enabled = torch.is_grad_enabled
    _tensor = torch.Tensor
    _failure.clear()
    arm()
    return None


def uninstall():
    """Removes the hooks and this thread's mark (autograd's thread keeps its last one, which
    nothing records once the history stops); returns the error that stopped the marking, if any."""
    global _set
    if _set is None:
        return None
    _disarm()
    for handle in _handles:
        handle.remove()
    _handles.clear()
    _hooked.clear()
    _state.stack = []
    _state.last_hooked = None
    try:
        _set("")
    finally:
        _set = None
    return _failure[0] if _failure else None
