"""What a step reads from its tensors while ``gpuexp.estimate`` runs it on fake tensors, as torch
shows it: ``.item()`` and ``.tolist()`` give torch's unbacked symbols (the fake mode has a
``ShapeEnv``), and this module makes them show as stand-ins (``StandIns``), finds where in the
user's code a read was made or needed (``users_place``), and reads which symbols a guard needed
(``guarded_symbols``). What a read means, what a stand-in shows and why one stops an estimate
are the core's (``rust/src/scalar_reads.rs``), reached through the books.

Torch instrumentation, so Python (docs/ARCHITECTURE.md): torch is imported when these run.
"""

import linecache
import math
import os
import sys
import threading


def is_users(path):
    """Whether code in ``path`` is the user's: outside torch and gpuexp."""
    parts = os.path.normpath(path).split(os.sep)
    return "torch" not in parts and "gpuexp" not in parts


def _place(frame, line):
    path = frame.f_code.co_filename
    return f"{path}:{line}", linecache.getline(path, line).strip() or None


def users_place(frame):
    """``(file:line, its code)`` of the user's frame nearest ``frame`` going out; Nones where none is."""
    while frame is not None:
        if is_users(frame.f_code.co_filename):
            return _place(frame, frame.f_lineno)
        frame = frame.f_back
    return None, None


def users_place_in(trace):
    """``(file:line, its code)`` of the innermost frame of the user's in a traceback."""
    users = None
    while trace is not None:
        if is_users(trace.tb_frame.f_code.co_filename):
            users = trace
        trace = trace.tb_next
    return (None, None) if users is None else _place(users.tb_frame, users.tb_lineno)


def guarded_symbols(error):
    """The symbols of the expression whose value a ``GuardOnDataDependentSymNode`` needed; None
    where ``error`` is another error."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    if not isinstance(error, GuardOnDataDependentSymNode):
        return None
    return sorted(str(symbol) for symbol in getattr(getattr(error, "cond", None), "free_symbols", ()))


class StandIns:
    """While installed, what stands in for a value the step read from a fake tensor of ``mode``
    shows ``books.STAND_IN`` when printed or formatted; ``float()`` of such a tensor or symbol,
    which must return a Python float, returns NaN, and ``books.nan`` hears where. Each read is
    reported with ``books.read`` by the ledger. ``remove()`` ends it; safe to call twice.

    Torch's methods are replaced once for all the estimates running (one per thread at most),
    and put back when the last ends: each estimate's symbols are known by their ``ShapeEnv``."""

    def __init__(self, mode, books):
        self._key = id(mode.shape_env)
        with _LOCK:
            if not _RUNNING:
                _replace_torchs_methods()
            _RUNNING[self._key] = (mode, books)

    def remove(self):
        with _LOCK:
            if _RUNNING.pop(self._key, None) is not None and not _RUNNING:
                while _UNDO:
                    _UNDO.pop()()


_LOCK = threading.Lock()
_RUNNING = {}  # id of a running estimate's ShapeEnv: its fake mode and its books
_UNDO = []  # what puts torch's own methods back


def _running_in(env):
    """The ``(mode, books)`` of the running estimate whose fake mode has ``env``; None for any other."""
    running = _RUNNING.get(id(env))
    return running if running is not None and running[0].shape_env is env else None


def _running_of(value):
    """The ``(mode, books)`` of the estimate whose read ``value`` stands for; None for any other."""
    return _running_in(getattr(getattr(value, "node", None), "shape_env", None))


def _replace_torchs_methods():
    torch = sys.modules["torch"]
    from torch._subclasses.fake_tensor import FakeTensor

    def shown(original):
        def show(value, *args):
            running = _running_of(value)
            return running[1].STAND_IN if running is not None else original(value, *args)

        return show

    symbol_float, tensor_float = torch.SymFloat.__float__, torch.Tensor.__float__

    def float_of_symbol(value):
        running = _running_of(value)
        if running is None:
            return symbol_float(value)
        running[1].nan(*users_place(sys._getframe(1)))
        return math.nan

    def float_of_tensor(tensor):
        running = _running_in(getattr(tensor.fake_mode, "shape_env", None)) if isinstance(tensor, FakeTensor) else None
        if running is None:
            return tensor_float(tensor)
        value = tensor.item()
        if _running_of(value) is None:  # a constant's value (a host scalar the estimate copied)
            return float(value)
        running[1].nan(*users_place(sys._getframe(1)))
        return math.nan

    try:
        for kind in (torch.SymInt, torch.SymFloat, torch.SymBool):
            for name in ("__repr__", "__str__", "__format__"):
                _replace(kind, name, shown(getattr(kind, name)))
        _replace(torch.SymFloat, "__float__", float_of_symbol)
        _replace(torch.Tensor, "__float__", float_of_tensor)
    except BaseException:
        while _UNDO:
            _UNDO.pop()()
        raise


def _replace(kind, name, method):
    missing = object()
    own = vars(kind).get(name, missing)
    setattr(kind, name, method)
    if own is missing:
        _UNDO.append(lambda: delattr(kind, name))
    else:
        _UNDO.append(lambda: setattr(kind, name, own))
