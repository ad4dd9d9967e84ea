"""Where a leak hunt starts outside the notebook's namespace, found by reading the interpreter.

The bindings (``bindings/interpreter/hunt_roots.rs``) call these and hand what they return to the core,
which decides which kind of root each is and their order (``holders_walk``). Nothing here
decides: each function only reads, and an object that raises when read is passed over, as the
hunt passes over any object it cannot inspect. A module's globals are read from its dict, never
through the module's own attribute lookup, so a lazy module is not imported.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any


def install_prefixes() -> list[str]:
    """The interpreter's install prefixes, for the core to tell installed code from the user's."""
    prefixes = (getattr(sys, name, None) for name in ("prefix", "base_prefix", "exec_prefix"))
    return [prefix for prefix in prefixes if isinstance(prefix, str)]


def thread_frames() -> tuple[int, list[tuple[int, str, list[tuple[str | None, Any]]]]]:
    """The current thread's ident, and every thread's frames, innermost first: its ident, its
    name and each frame with its code's file. The current thread's start at the frame that
    called into gpuexp's native code, so that this function's own frame is never among them."""
    import threading

    current = threading.get_ident()
    names = {thread.ident: thread.name for thread in threading.enumerate() if thread.ident is not None}
    tops = sys._current_frames()
    tops[current] = sys._getframe(1)
    threads = []
    for ident, top in tops.items():
        frames = []
        frame = top
        while frame is not None:
            frames.append((text_of(frame.f_code.co_filename), frame))
            frame = frame.f_back
        threads.append((ident, names.get(ident, str(ident)), frames))
    return current, threads


def text_of(value: object) -> str | None:
    """A string's text read without running the user's code (a namespace key, a file name): a
    ``str`` subclass may define ``__hash__``, ``__eq__`` or ``__str__`` to raise, so it is read
    with ``str.__str__``. None for a value that is no string."""
    return str.__str__(value) if isinstance(value, str) else None


def module_globals() -> list[tuple[str, str | None, bool, list[tuple[str, Any]]]]:
    """Every module's globals: its name, its file, whether it is the main module, and its
    string-keyed entries. The main module comes once, as ``__main__``, under whichever names
    ``sys.modules`` gives it (torch's multiprocessing adds ``__mp_main__``)."""
    modules = sys.modules.copy()
    main = modules.get("__main__")
    found = []
    for name, module in modules.items():
        if not isinstance(name, str) or not isinstance(module, ModuleType):
            continue
        is_main = module is main
        if is_main and name != "__main__":
            continue
        # Not `vars(module)`: a lazy module's own `__getattribute__` would import it.
        globals_ = object.__getattribute__(module, "__dict__")
        entries = [(text, value) for key, value in globals_.items() if (text := text_of(key)) is not None]
        found.append((name, text_of(globals_.get("__file__")), is_main, entries))
    return found


def _task_names() -> dict[int, str]:
    """The names of pending asyncio tasks, by the id of their coroutine."""
    module = sys.modules.get("asyncio.tasks")
    names: dict[int, str] = {}
    # The registries of live tasks (a WeakSet each); their names differ across versions.
    for registry in ("_scheduled_tasks", "_all_tasks"):
        tasks = getattr(module, registry, None)
        if tasks is None:
            continue
        for task in tasks.copy():
            try:
                names[id(task.get_coro())] = str(task.get_name())
            except Exception:  # noqa: BLE001 - a task that raises when read is passed over
                continue
    return names


_SUSPENDED = {"generator": ("gi", "generator"), "coroutine": ("cr", "coroutine")}


def suspended_frames(suspended: list[Any]) -> list[tuple[str | None, str | None, str, Any]]:
    """The frames of ``suspended`` (generators and coroutines the collector knows) that are
    paused at a ``yield`` or an ``await``: each with its code's file, its asyncio task's name
    (None where it is no task's), and what it is. A running one is on the hunter's own stack."""
    tasks = _task_names()
    found = []
    for thing in suspended:
        prefix, what = _SUSPENDED.get(type(thing).__name__, ("ag", "async generator"))
        try:
            frame = getattr(thing, f"{prefix}_frame")
            running = bool(getattr(thing, f"{prefix}_running"))
        except Exception:  # noqa: BLE001 - one that raises when read is passed over
            continue
        if frame is None or running:
            continue
        found.append((text_of(frame.f_code.co_filename), tasks.get(id(thing)), what, frame))
    return found


def hooks() -> list[tuple[str, Any]]:
    """The interpreter's hooks that hold user functions (and what their closures hold) where no
    module global does: trace and profile functions, signal handlers. Others (``sys.excepthook``,
    ``sys.meta_path``, ``gc.callbacks``, ``weakref.finalize._registry``) are module globals or
    class attributes, walked with their modules."""
    found: list[tuple[str, Any]] = []
    for hook in ("gettrace", "getprofile"):
        function = getattr(sys, hook)()
        if function is not None:
            found.append((f"sys.{hook}()", function))
    import signal

    try:
        numbers = list(signal.valid_signals())
    except Exception:  # noqa: BLE001 - a platform without them has no handlers to walk
        numbers = []
    for number in numbers:
        try:
            handler = signal.getsignal(number)
        except Exception:  # noqa: BLE001 - a signal that cannot be read holds nothing we can see
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            found.append((f"signal handler {getattr(number, 'name', number)}", handler))
    return found
