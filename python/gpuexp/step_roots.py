"""Where ``gpuexp.estimate`` finds the model and optimizers a step uses: the step itself (a
closure's cells, a bound method's object, a partial's arguments, a callable object) and the
globals its code and the functions it reaches load, read from their code objects with ``dis``.

This only reads Python objects, so it is Python (docs/ARCHITECTURE.md, "Where torch
instrumentation goes"); what is swapped and saved from these roots is decided in the core
(``rust/src/bindings/api/estimate.rs`` calls ``step_roots``).
"""

import dis
import types

# The functions followed from the step at most: a step reaches its helpers, not a library.
_MOST_FUNCTIONS = 64
_MISSING = object()


def step_roots(step):
    """The roots of ``step`` as ``(name, value)`` pairs, the globals its code assigns to
    (``global`` names) as ``(namespace, name)`` pairs, and where each root that is not the step
    itself is held, as ``(namespace, name)`` for a global it loads and ``(cell, None)`` for a
    closure cell: a tensor there is swapped for a fake while the estimate runs."""
    roots, assigned, places = [("step", step)], [], []
    pending, seen = [step], set()
    while pending:
        callable_ = pending.pop()
        if id(callable_) in seen or len(seen) >= _MOST_FUNCTIONS:
            continue
        seen.add(id(callable_))
        for inner in ("__func__", "__wrapped__", "func"):
            value = _attribute(callable_, inner)
            if callable(value):
                pending.append(value)
        for arguments in ("args", "keywords"):
            values = _attribute(callable_, arguments, _MISSING)
            if values is not _MISSING:
                roots.append((f"step.{arguments}", values))
        if isinstance(callable_, types.MethodType):
            roots.append(("self", callable_.__self__))
        if not isinstance(callable_, types.FunctionType):
            call = _attribute(type(callable_), "__call__")
            if call is not None:
                pending.append(call)
            continue
        globals_ = callable_.__globals__
        loaded, stored = [], []
        _global_names(callable_.__code__, loaded, stored)
        assigned.extend((globals_, name) for name in stored)
        for name in loaded:
            if name in globals_:
                value = globals_[name]
                if isinstance(value, types.FunctionType):
                    pending.append(value)
                roots.append((name, value))
                places.append((globals_, name))
        for name, cell in zip(callable_.__code__.co_freevars, callable_.__closure__ or ()):
            contents = _attribute(cell, "cell_contents", _MISSING)
            if isinstance(contents, types.FunctionType):
                pending.append(contents)
            if contents is not _MISSING:
                roots.append((name, contents))
                places.append((cell, None))
    return roots, assigned, places


def _attribute(value, name, missing=None):
    """``value.name``, or ``missing`` where reading it fails (an empty cell, a user's property
    that raises)."""
    try:
        return getattr(value, name)
    except Exception:  # noqa: BLE001  (a root that can't be read is no root)
        return missing


def _global_names(code, loaded, stored):
    """The globals a code object and the code nested in it (inner functions, lambdas) load; not
    every name in ``co_names``, which has attribute names too (``opt.step`` is no global ``step``)."""
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            into = loaded
        elif instruction.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            into = stored
        else:
            continue
        if isinstance(instruction.argval, str):
            into.append(instruction.argval)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            _global_names(constant, loaded, stored)
