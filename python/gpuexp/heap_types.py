"""The types the leak hunter's walk tells apart (``bindings/python_heap``), looked up once per hunt.

Torch, numpy and pandas are looked up only where already imported (never imported here), as is
``collections.deque``; what is missing is None, or left out of a list.
"""

from __future__ import annotations

import builtins
import sys
import types
import weakref
from typing import Any

# Refer to nothing worth following: numbers, strings, code, descriptors.
_ATOMIC_BUILTINS = ("str", "bytes", "bytearray", "int", "float", "complex", "bool", "range", "slice", "memoryview")
_ATOMIC_TYPES = (
    "NoneType",
    "CodeType",
    "BuiltinFunctionType",
    "MethodWrapperType",
    "WrapperDescriptorType",
    "MethodDescriptorType",
    "GetSetDescriptorType",
    "MemberDescriptorType",
    "ClassMethodDescriptorType",
    "EllipsisType",
    "NotImplementedType",
)
# Types walked by what they are exactly, each with the name the walk knows it by.
_EXACT = (
    ("TracebackType", "traceback"),
    ("FrameType", "frame"),
    ("FunctionType", "function"),
    ("MethodType", "method"),
    ("CellType", "cell"),
    ("GeneratorType", "generator"),
    ("CoroutineType", "coroutine"),
    ("AsyncGeneratorType", "async generator"),
)


def _imported(module: str, *path: str) -> Any:
    found = sys.modules.get(module)
    for name in path:
        found = getattr(found, name, None)
    return found


def heap_types() -> dict[str, Any]:
    """The types by the name the walk knows them by: a type, None where its module is not
    imported, or a list of types."""
    atomic = [getattr(builtins, name) for name in _ATOMIC_BUILTINS]
    atomic += [getattr(types, name) for name in _ATOMIC_TYPES if hasattr(types, name)]
    atomic.append(weakref.ReferenceType)
    deque = _imported("collections", "deque")
    owners = [_imported("torch", "nn", "Module"), _imported("torch", "optim", "Optimizer")]
    return {
        "atomic": atomic,
        "proxies": [weakref.ProxyType, weakref.CallableProxyType],
        "dict": dict,
        "list": list,
        "tuple": tuple,
        "iterable": [set, frozenset] + ([deque] if deque is not None else []),
        "module": types.ModuleType,
        "type": type,
        "exact": [(getattr(types, name), what) for name, what in _EXACT],
        "lru_cache": _imported("functools", "_lru_cache_wrapper"),
        "tensor": _imported("torch", "Tensor"),
        "ndarray": _imported("numpy", "ndarray"),
        "series": _imported("pandas", "Series"),
        "dataframe": _imported("pandas", "DataFrame"),
        "grad_fn": _imported("torch", "autograd", "graph", "Node"),
        "saved_tensor": _imported("torch", "_C", "_autograd", "SavedTensor"),
        "owners": [owner for owner in owners if owner is not None],
    }


def slot_names(cls: type) -> list[str]:
    """The names of a class's slots, across its bases (``__dict__`` and ``__weakref__`` left out)."""
    names = []
    for base in cls.__mro__:
        slots = vars(base).get("__slots__")
        if slots is None:
            continue
        for slot in [slots] if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__"):
                names.append(slot)
    return names


def saved_names(cls: type) -> list[str]:
    """The attributes of an autograd function's type that hold what it saved for backward, raw
    (``_raw_saved_self``, a custom Function's ``_raw_saved_tensors``): reading ``_saved_self`` or
    ``saved_tensors`` would run the saved-tensor hooks. And AccumulateGrad's ``variable``."""
    return [name for name in dir(cls) if name.startswith("_raw_saved_") or name == "variable"]
