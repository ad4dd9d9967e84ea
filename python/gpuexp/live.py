"""What gpuexp shows while something runs: the live view of a long cell, and the progress of
``find_batch_size``. In Jupyter, one output updated in place (a display id); in IPython on a
terminal, one line rewritten with ``\\r``; in a plain script, no live view and a line per trial.

The core decides when a view is due and renders it (``_core.live_view_wait``, ``live_view``);
this module only puts it on the page. One daemon thread draws the views: it waits in the core
without the GIL, so a cell shorter than the delay never wakes it, and takes the GIL only to draw.
"""

import atexit
import contextvars
import shutil
import sys
import threading
import uuid

from . import _core
from .ipython import bundle, shell, show, warn

# A drawing and the end of its cell never interleave: once a cell has ended under this lock,
# its view is never drawn again, so the block that replaces it stays.
_lock = threading.Lock()
_drawer = None
_NOT_YET = object()
_mode = _NOT_YET
_EMPTY = {"text/plain": ""}
# Display ids outlive a kernel in the page (JupyterLab updates every output with the id): a
# restarted kernel's windows count from 1 again, so each process gets ids of its own.
_PROCESS = uuid.uuid4().hex[:12]


def frontend():
    """Where output goes: "jupyter" in a kernel, "terminal" in IPython on a terminal, else None."""
    ip = shell()
    if ip is None:
        return None
    if getattr(ip, "kernel", None) is not None:
        return "jupyter"
    isatty = getattr(sys.stdout, "isatty", None)
    return "terminal" if isatty is not None and isatty() else None


def line_width():
    return max(shutil.get_terminal_size().columns - 1, 20)


def start():
    """Starts the drawing thread, once, where there is somewhere to draw (a cell begins)."""
    global _drawer, _mode
    if _drawer is not None:
        return
    if _mode is _NOT_YET:
        _mode = frontend()
    if _mode is not None:
        _drawer = _Drawer(_mode)


def end_cell(execution_count):
    """Ends the cell in the core: (its record if its block shows, its live view's window if drawn)."""
    with _lock:
        return _core.end_cell(execution_count)


def replace(window, block):
    """Puts the cell's block (or nothing) where its live view was; without a view, shows the block."""
    if window is not None and _mode == "jupyter":
        from IPython.display import update_display

        data = bundle(block) if block is not None else _EMPTY
        update_display(data, raw=True, display_id=_display_id(window))
        return
    if window is not None and _mode == "terminal":
        sys.stdout.write("\r\x1b[K")
        sys.stdout.flush()
    if block is not None:
        show(block)


def _display_id(window):
    return f"gpuexp-live-{_PROCESS}-{window}"


class _Drawer:
    def __init__(self, mode):
        self.mode = mode
        self.failed = False
        self.thread = threading.Thread(target=self._run, name="gpuexp-live-view", daemon=True)
        self.thread.start()
        atexit.register(self.stop)

    def _run(self):
        while True:
            tick = _core.live_view_wait()
            if tick is None:
                return
            window, first = tick
            with _lock:
                try:
                    # ipykernel sends a display to the parent a context variable names, else to the
                    # running cell's: an empty context, whatever the thread inherited, means the latter.
                    contextvars.Context().run(self._draw, window, first)
                except Exception as error:  # a thread cannot raise into the cell: say it once
                    if not self.failed:
                        self.failed = True
                        warn(f"the live view could not be drawn: {error!r}")

    def _draw(self, window, first):
        view = _core.live_view(window, line_width())
        if view is None:  # the cell ended meanwhile
            return
        line, text, html = view
        if self.mode == "terminal":
            sys.stdout.write("\r" + line + "\x1b[K")
            sys.stdout.flush()
            return
        from IPython.display import display, update_display

        data = {"text/plain": text, "text/html": html}
        if first:
            display(data, raw=True, display_id=_display_id(window))
        else:
            update_display(data, raw=True, display_id=_display_id(window))

    def stop(self):
        """At exit: the thread leaves the core's wait before the interpreter goes."""
        _core.live_view_stop()
        self.thread.join(timeout=2)


class Progress:
    """How ``find_batch_size`` shows its trials as they end: in Jupyter, the table so far in one
    output updated in place; in a terminal, the last trial's line rewritten; in a script, a line
    per trial. The core calls ``update`` after each trial and ``finish`` once it stops."""

    def __init__(self):
        self.mode = frontend()
        self.display_id = None
        self.started = False

    def update(self, line, html):
        if self.mode == "jupyter":
            from IPython.display import display, update_display

            data = {"text/plain": line, "text/html": html}
            if self.display_id is None:
                self.display_id = f"gpuexp-finder-{uuid.uuid4().hex}"
                display(data, raw=True, display_id=self.display_id)
            else:
                update_display(data, raw=True, display_id=self.display_id)
        elif self.mode == "terminal":
            sys.stdout.write("\r" + line[: line_width()] + "\x1b[K")
            sys.stdout.flush()
        else:
            print(line, flush=True)
        self.started = True

    def finish(self, line, html):
        if not self.started:
            return
        if self.mode == "jupyter":
            from IPython.display import update_display

            update_display({"text/plain": line, "text/html": html}, raw=True, display_id=self.display_id)
        elif self.mode == "terminal":
            sys.stdout.write("\r" + line[: line_width()] + "\x1b[K\n")
            sys.stdout.flush()
