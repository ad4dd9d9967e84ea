"""Namespace glue: the namespace a scope works on, the references IPython keeps behind the
user's back, what the running cell binds, and where reports are shown.

The core (``gpuexp._core``) decides what to delete and in which order; the adapters here
only read and remove entries where IPython (or a plain module) keeps them. They are the
namespace adapter protocol of ``gpuexp/_core.pyi``. The cell events and magics are in
``extension.py``.
"""

import _thread
import ast
import gc
import sys
import threading
import traceback
import types

from . import _core
from .hunt_roots import text_of

_EXPERIMENT_CLASSES = {"GPUExperiment", "CPUExperiment"}


def shell():
    """The running IPython shell, or None in plain Python. Never imports IPython."""
    module = sys.modules.get("IPython")
    # In a process forked from a kernel (a rank): it runs no cells, and the shell is the parent's.
    if module is None or _core.is_forked_child():
        return None
    try:
        return module.get_ipython()
    except Exception:
        return None


# Ids of the shells whose cell events gpuexp listens to (the extension registers them). Kept here,
# beside `shell`, so that an experiment can ask without importing the extension, which imports it.
listened_shells = set()


def listening():
    """Whether gpuexp listens to the running shell's cell events: a cell's end will come to it."""
    ip = shell()
    return ip is not None and id(ip) in listened_shells


def show(obj):
    """Displays a report, snapshot or cell record: HTML in a notebook, text in a terminal or script."""
    ip = shell()
    if ip is None:
        print(obj)
        return
    # Both formats straight to the display publisher: IPython's formatter would probe a dozen
    # repr methods first.
    ip.display_pub.publish(data=bundle(obj), metadata={})


def bundle(obj):
    """What a report, snapshot or cell record shows as: its text table and its HTML one."""
    return {"text/plain": str(obj), "text/html": obj._repr_html_()}


def warn(message):
    print(f"gpuexp: {message}", file=sys.stderr)


class _Namespace:
    """The stored last exception, which both a notebook and a script can hold."""

    namespace = None

    def cache_refs(self, obj):
        """How many references to ``obj`` IPython's caches hold (none outside IPython)."""
        return 0

    def ipythons_own(self):
        """The entries IPython itself keeps in the namespace (``_i9``, ``_1``), by name: an entry
        that is the same object is IPython's, not the user's."""
        return {}

    def hidden_refs(self):
        refs = {}
        exc = getattr(sys, "last_value", None) or getattr(sys, "last_exc", None)
        if exc is not None:
            refs["last exception"] = exc
        return refs

    def drop_hidden(self, label):
        if label == "last exception":
            tb = getattr(sys, "last_traceback", None)
            if tb is not None:
                _clear_frames(tb)
            for name in ("last_type", "last_value", "last_traceback", "last_exc"):
                if hasattr(sys, name):
                    delattr(sys, name)

    def drop_exception(self, error):
        """After an OOM: clears the frames of the exception (and those it chains) and drops the
        stored references to it. Returns what it cleared."""
        cleared = ["frames of the failed call"]
        seen = set()
        while error is not None and id(error) not in seen:
            seen.add(id(error))
            if error.__traceback__ is not None:
                _clear_frames(error.__traceback__)
                # Clearing alone left the failed call's array alive in our tests (CPython
                # 3.11, IPython 9); dropping the traceback frees it. ipykernel's reply
                # needs only the exception's name and text.
                error.__traceback__ = None
            error = error.__cause__ or error.__context__
        if getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None:
            self.drop_hidden("last exception")
            cleared.append("last exception")
        return cleared


def _clear_frames(tb):
    # The frames of a failed call keep its locals (an OOM's tensors) alive for as long as
    # anything holds the traceback.
    try:
        traceback.clear_frames(tb)
    except RuntimeError:
        pass  # a frame still executing (the current cell) cannot be cleared, nor needs to be


class ShellNamespace(_Namespace):
    """A notebook's ``user_ns`` and the references IPython keeps to displayed and raised objects."""

    def __init__(self, ip):
        self.shell = ip
        self.namespace = ip.user_ns

    def system_names(self):
        return self.shell.user_ns_hidden.keys()

    def ipythons_own(self):
        return self.shell.user_ns_hidden

    def output_cache(self):
        """IPython's own output cache (``Out``, ``_oh``), found by identity: a user's own
        ``Out = {...}`` is the user's data, never cleared."""
        history = getattr(self.shell, "history_manager", None)
        cache = getattr(history, "output_hist", None)
        return cache if isinstance(cache, dict) else {}

    def cache_refs(self, obj):
        count = sum(value is obj for value in list(self.output_cache().values()))
        for names in (self.namespace, self.shell.user_ns_hidden):
            count += sum(value is obj for name, value in list(names.items()) if _is_output_name(name))
        displayhook = self.shell.displayhook
        count += sum(getattr(displayhook, name, None) is obj for name in ("_", "__", "___"))
        result = self.shell.last_execution_result
        count += result is not None and getattr(result, "result", None) is obj
        return count

    def hidden_refs(self):
        refs = super().hidden_refs()
        for number, value in list(self.output_cache().items()):
            refs[f"Out[{number}]"] = value
        for name in ("_", "__", "___"):
            if name in self.namespace:
                refs[name] = self.namespace[name]
        if self.shell.last_execution_result is not None:
            refs["last cell result"] = self.shell.last_execution_result
        tb = getattr(self.shell.InteractiveTB, "tb", None)
        if tb is not None:
            refs["last traceback"] = tb
        return refs

    def drop_hidden(self, label):
        if label.startswith("Out["):
            # Out[n] has twins: _n in user_ns, and in user_ns_hidden where the display hook pushes it.
            number = int(label[4:-1])
            self.output_cache().pop(number, None)
            self.namespace.pop(f"_{number}", None)
            self.shell.user_ns_hidden.pop(f"_{number}", None)
        elif label in ("_", "__", "___"):
            # The display hook keeps its own copies, and pushes them into user_ns_hidden too.
            self.namespace[label] = ""
            setattr(self.shell.displayhook, label, "")
            if label in self.shell.user_ns_hidden:
                self.shell.user_ns_hidden[label] = ""
        elif label == "last cell result":
            self.shell.last_execution_result = None
        elif label == "last traceback":
            _clear_frames(self.shell.InteractiveTB.tb)
            self.shell.InteractiveTB.tb = None
        else:
            super().drop_hidden(label)

    def drop_exception(self, error):
        cleared = super().drop_exception(error)
        if getattr(self.shell.InteractiveTB, "tb", None) is not None:
            self.drop_hidden("last traceback")
            cleared.append("last traceback")
        return cleared


def _is_output_name(name):
    """``_``, ``__``, ``___`` and ``_N``: where IPython's display hook keeps results."""
    name = text_of(name)
    if name is None:
        return False
    return name in ("_", "__", "___") or (name[:1] == "_" and name[1:].isascii() and name[1:].isdigit())


def resetting():
    """Whether IPython's ``%reset`` or ``%reset_selective`` is deleting names further up this
    call stack: each fails on a name deleted under it, so a teardown then leaves names to it."""
    ip = shell()
    frame = sys._getframe(1) if ip is not None else None
    while frame is not None:
        # The shell's `reset`, or the magic's `reset_selective`, which deletes the names itself.
        if frame.f_code.co_name in ("reset", "reset_selective") and _runs_on(frame, ip):
            return True
        frame = frame.f_back
    return False


def _runs_on(frame, ip):
    """Whether a method's frame runs on the shell, or on one of its magics."""
    owner = frame.f_locals.get("self")
    try:
        return owner is ip or getattr(owner, "shell", None) is ip
    except Exception:  # a user's object named `reset` whose `shell` raises is not IPython's
        return False


class ModuleNamespace(_Namespace):
    """A script's module globals, when an experiment is created at module level."""

    def __init__(self, module_globals):
        self.namespace = module_globals

    def system_names(self):
        return ()


class DetachedNamespace(_Namespace):
    """Inside a function of a script: nothing to delete, only the stored exception to drop."""

    def system_names(self):
        return ()


def namespace_for(frame):
    """The namespace an experiment created in ``frame`` works on."""
    ip = shell()
    if ip is not None:
        return ShellNamespace(ip)
    if frame.f_globals is frame.f_locals:
        return ModuleNamespace(frame.f_globals)
    return DetachedNamespace()


def running_cell():
    """The syntax tree of the cell being executed, or None outside IPython."""
    ip = shell()
    if ip is None:
        return None
    cells = ip.user_ns.get("_ih") or [""]
    try:
        return ast.parse(cells[-1])
    except SyntaxError:
        return None


def cell_displays_finish():
    """Whether the running cell ends with ``<experiment>.finish()`` as an expression that IPython
    displays itself (as ``Out``; no ``;`` after it): then ``finish()`` leaves its report to that
    display, so that it shows once."""
    ip = shell()
    tree = running_cell()
    if ip is None or tree is None or not tree.body:
        return False
    last = tree.body[-1]
    ends_with_finish = (isinstance(last, ast.Expr) and isinstance(last.value, ast.Call)
                        and isinstance(last.value.func, ast.Attribute) and last.value.func.attr == "finish"
                        and not last.value.args and not last.value.keywords)
    try:
        return ends_with_finish and ip.ast_node_interactivity != "none" and not ip.displayhook.quiet()
    except Exception:  # an unusual shell: show the report, as everywhere else
        return False


def assignment_targets(frame):
    """Names the statement that makes a new experiment binds it to (``exp = GPUExperiment(...)``,
    ``a = b = GPUExperiment()``): the one the cell's ``frame`` is running, found by the position
    of its current instruction, so that two on one line are told apart.

    An open experiment already bound to one of them is about to be replaced, so it is
    finished before the new one takes its baseline; one bound to another name nests.
    """
    tree = running_cell()
    if tree is None:
        return set()
    line, column = _position(frame)
    targets = set()
    for node in ast.walk(tree):
        if (isinstance(node, (ast.Assign, ast.AnnAssign)) and _builds_experiment(node.value)
                and _encloses(node.value, line, column)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    targets.add(target.id)
    return targets


def _position(frame):
    """The line and column of the instruction ``frame`` runs; the column None where Python
    doesn't say (before 3.11: the line alone)."""
    positions = getattr(frame.f_code, "co_positions", None)
    if positions is not None and frame.f_lasti >= 0:
        for index, (line, _end_line, column, _end_column) in enumerate(positions()):
            if index == frame.f_lasti // 2 and line is not None:
                return line, column
    return frame.f_lineno, None


def _encloses(node, line, column):
    if column is None:
        return node.lineno <= line <= node.end_lineno
    return (node.lineno, node.col_offset) <= (line, column) <= (node.end_lineno, node.end_col_offset)


def names_bound_before(line):
    """Names the running cell binds above ``line`` (``bs = 128``, a loop variable): the cell
    still uses them, so an experiment it replaces must not delete them."""
    tree = running_cell()
    if tree is None:
        return set()
    names = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", line) >= line:
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
    return names


def names_the_cell_binds():
    """Every name the running cell's own code binds, anywhere in it (an assignment, a loop, an
    import, a def, a ``global`` in one of its functions): an experiment found unreachable keeps
    them, even where a new object took a freed one's address."""
    tree = running_cell()
    if tree is None:
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).partition(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            names.update(node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif type(node).__name__ in ("MatchAs", "MatchStar") and getattr(node, "name", None):
            names.add(node.name)
        elif type(node).__name__ == "MatchMapping" and getattr(node, "rest", None):
            names.add(node.rest)
    return names


# How far `in_sight` looks: references it reads in all, and the largest container it reads.
_SIGHT_BUDGET = 100_000
_SIGHT_CONTAINER = 10_000
_CONTAINERS = (list, tuple, dict, set, frozenset)


def in_sight(experiments, namespace):
    """The scope ids of the experiments that one of the user's names leads to, directly or two
    references away at most (``exp``; ``runs[0]``, ``r.exp``, ``Config.exp``). References are
    read with ``gc.get_referents``, which runs none of the user's code; modules and large
    containers are not looked into, and the look stops after a bounded number of references: an
    experiment not found is only judged more carefully if Python's garbage collector later finds
    it unreachable."""
    wanted = {id(experiment): scope_id for scope_id, experiment in experiments.items()}
    found = set()
    system = set(namespace.system_names())
    level = [value for name, value in list(namespace.namespace.items())
             if (text := text_of(name)) is not None and text not in system and not _is_output_name(text)]
    followed = set()
    budget = _SIGHT_BUDGET
    for depth in range(3):
        found.update(wanted[id(obj)] for obj in level if id(obj) in wanted)
        if len(found) == len(wanted) or depth == 2:
            break
        deeper = []
        for obj in level:
            if budget > 0 and id(obj) not in wanted and id(obj) not in followed and _worth_following(obj):
                followed.add(id(obj))
                referents = gc.get_referents(obj)
                budget -= len(referents)
                deeper.extend(referents)
        level = deeper
    return found


def _worth_following(obj):
    if isinstance(obj, types.ModuleType):
        return False
    return type(obj) not in _CONTAINERS or len(obj) <= _SIGHT_CONTAINER


def _builds_experiment(value):
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name in _EXPERIMENT_CLASSES


_held_interrupt = None


def hold_interrupt(error):
    """An interrupt gpuexp held while a teardown ran inside ``__del__`` (``del exp``), which cannot
    raise: in IPython it becomes the cell's error once the cell ends, as an interrupt that came
    after the teardown would have; in a script it is raised again in the main thread."""
    global _held_interrupt
    if shell() is not None:
        _held_interrupt = error
    else:
        threading.Timer(0.001, _thread.interrupt_main).start()


def raise_held_interrupt(result):
    """Makes an interrupt held during the cell its error (the cell-end event calls this)."""
    global _held_interrupt
    error, _held_interrupt = _held_interrupt, None
    ip = shell() if error is not None else None
    if ip is None or result is None or not result.success:
        return
    result.error_in_exec = error
    ip.showtraceback((type(error), error, error.__traceback__))


def source_line(filename, line):
    """How a person names a line of code an allocation came from, and its text:
    ``("In [12], line 4", "scores = q @ k.transpose(-2, -1)")`` for a notebook cell (IPython's
    compiler maps each cell's file to its execution count), ``(None, text)`` elsewhere."""
    import linecache

    label = None
    ip = shell()
    if ip is not None:
        number = getattr(getattr(ip, "compile", None), "_filename_map", {}).get(filename)
        if number is not None:
            label = f"In [{number}], line {line}"
    try:
        text = linecache.getline(filename, line).strip()
    except Exception:  # a loader that raises: the label stands alone
        text = ""
    return label, text
