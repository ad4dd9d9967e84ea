"""The holders a cell's code grows (``outs.append(out)``, ``cache[key] = value``, ``seen.add(x)``,
``losses += [loss]``), in the cell itself or in the notebook's functions it calls, read at the
cell's end for the cell log's creep note (the core decides it: ``_core.cell_grew``)."""

import ast
import inspect
import sys
import textwrap
from collections import deque

# The methods that grow a container in place.
_GROWING = frozenset({"append", "extend", "insert", "add", "update", "setdefault", "appendleft", "extendleft"})
_CONTAINERS = (list, tuple, dict, set, frozenset, deque)
# How much is read: the functions the cell calls whose code is looked at, the holders kept, and
# the items of one holder looked at for tensors.
_MOST_FUNCTIONS = 16
_MOST_HOLDERS = 8
_MOST_ITEMS = 10_000


def grown_holders(tree, namespace):
    """``[(name, items, tensor_bytes)]`` for each of the user's containers that the cell's code
    (``tree``) grows, by the name it has in ``namespace``; only plain names, never an attribute
    (reading one may run the user's code)."""
    names = _grown_names(tree)
    functions = 0
    for node in ast.walk(tree):
        if functions >= _MOST_FUNCTIONS:
            break
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            function = namespace.get(node.func.id)
            if inspect.isfunction(function) and function.__module__ == namespace.get("__name__"):
                functions += 1
                names |= _grown_names(_source_tree(function))
    readings = []
    for name in sorted(names):
        holder = namespace.get(name)
        if isinstance(holder, _CONTAINERS) and len(readings) < _MOST_HOLDERS:
            try:
                readings.append((name, len(holder), _tensor_bytes(holder)))
            except Exception:  # a subclass's own __len__ or values() that raises: not read
                continue
    return readings


def _grown_names(tree):
    """The plain names ``tree`` grows in place."""
    names = set()
    if tree is None:
        return names
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in _GROWING and isinstance(node.func.value, ast.Name)):
            names.add(node.func.value.id)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                    names.add(target.value.id)
                elif isinstance(node, ast.AugAssign) and isinstance(target, ast.Name):
                    names.add(target.id)
    return names


def _source_tree(function):
    """The syntax tree of a notebook function (IPython keeps its cells' sources), or None."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None


def _tensor_bytes(holder):
    """The bytes of the tensors among the holder's first items (a dict's values), each storage once."""
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    items = holder.values() if isinstance(holder, dict) else holder
    storages = {}
    for index, item in enumerate(items):
        if index >= _MOST_ITEMS:
            break
        if isinstance(item, torch.Tensor):
            try:
                storage = item.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, sparse)
                continue
    return sum(storages.values())
