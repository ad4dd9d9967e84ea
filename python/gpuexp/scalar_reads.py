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
    reported with ``books.read`` by the ledger. ``remove()`` puts torch's methods back."""

    def __init__(self, mode, books):
        torch = sys.modules["torch"]
        from torch._subclasses.fake_tensor import FakeTensor

        self._undo = []
        env, text = mode.shape_env, books.STAND_IN

        def ours(value):
            return getattr(getattr(value, "node", None), "shape_env", None) is env

        def shown(original):
            def show(value, *args):
                return text if ours(value) else original(value, *args)

            return show

        try:
            for kind in (torch.SymInt, torch.SymFloat, torch.SymBool):
                for name in ("__repr__", "__str__", "__format__"):
                    self._replace(kind, name, shown(getattr(kind, name)))
            symbol_float = torch.SymFloat.__float__

            def float_of_symbol(value):
                if ours(value):
                    books.nan(*users_place(sys._getframe(1)))
                    return math.nan
                return symbol_float(value)

            tensor_float = torch.Tensor.__float__

            def float_of_tensor(tensor):
                if isinstance(tensor, FakeTensor) and tensor.fake_mode is mode:
                    value = tensor.item()
                    if ours(value):
                        books.nan(*users_place(sys._getframe(1)))
                        return math.nan
                    return float(value)
                return tensor_float(tensor)

            self._replace(torch.SymFloat, "__float__", float_of_symbol)
            self._replace(torch.Tensor, "__float__", float_of_tensor)
        except BaseException:
            self.remove()
            raise

    def _replace(self, kind, name, method):
        missing = object()
        own = vars(kind).get(name, missing)
        setattr(kind, name, method)
        if own is missing:
            self._undo.append(lambda: delattr(kind, name))
        else:
            self._undo.append(lambda: setattr(kind, name, own))

    def remove(self):
        """Puts torch's own methods back; safe to call twice."""
        while self._undo:
            self._undo.pop()()
