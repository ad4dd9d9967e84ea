"""The public experiment scopes. State and teardown live in ``gpuexp._core``."""

import atexit
import gc
import os
import sys
import threading

from . import _core, ipython, live
from .devices import device_indices
from .monitor import seconds
from .torch_peaks import watch_torch_peak_resets

_NOT_COPIED = (
    "a GPUExperiment can't be copied or pickled: a copy would share its scope, and finishing the "
    "copy would delete your names while the experiment is still open. Pass the experiment itself "
    "around, and copy or pickle its report instead: exp.data, or the report exp.finish() returns."
)


class GPUExperiment:
    """A memory experiment over host RAM and every visible GPU.

    Everything the experiment's cells create is deleted and freed when it finishes
    (``del exp``, ``exp.finish()`` or the end of a ``with`` block), and a table shows what it
    consumed, what came back and the peak. Names that existed before are never touched unless
    the experiment rebound them. Opening it prints the state it starts from.

    :param name: what the report, ``gpuexp.history()`` and ``gpuexp.compare()`` call it (``exp-N`` by
        default). Opening another experiment of the same name finishes this one first.
    :param devices: the GPUs it covers: ``0``, ``[0, 1]``, ``'cuda:1'``, ``'cuda'`` (torch's current
        GPU) or ``torch.device`` objects; by default every visible one.
    :param cell_log: while it is open, a cell where memory moved is followed by a compact memory
        block, and a long cell shows its memory live; False turns both off.
    :param limit: caps torch's allocations while it is open ("24GiB" or bytes: the per-process memory
        fraction), so a large card behaves like a smaller one; restored at finish.
    :param monitor: records a timeline of the host and every GPU, every 100 ms (True) or at an
        interval ("20ms"); ``report.plot()`` draws it.
    :param params: what the experiment varied, for ``gpuexp.compare()``: ``params={"bs": 64}``; by
        default read from the name (``"bs=64,lr=3e-4"``).
    :param trace: ``True`` (or ``"cuda"``) records torch's CUDA allocation history while it is open,
        and the report then says where in the code each GPU peaked (``report.trace``), where
        what is still held was allocated, and why it peaks higher than another traced
        experiment (``report.diff(other)``). ``"host"`` traces Python's allocations instead
        (tracemalloc: objects, NumPy's buffers) and the report says which lines grew the host's
        memory; ``"all"`` does both. ``gpuexp.config(trace=True)`` turns it on for every
        experiment.
    :param delete: False measures and reports but deletes nothing: the names stay their owner's (a
        trainer's callback opens one so).
    """

    _gpu = True
    _tool = False  # opened by one of gpuexp's tools (a trainer's callback): see integrations/run.py

    _id = None  # the scope's id, once this object's opening has registered it
    _pid = None

    def __init__(self, name=None, *, devices=None, cell_log=True, limit=None, monitor=False, params=None,
                 trace=None, delete=True):
        # An open experiment re-initialised would leave its scope open with no owner: refused,
        # before anything of this object changes. Only an object that opened one asks: a new one
        # can have the id of a dead owner whose finish waits for the main thread.
        if self._id is not None:
            _core.refuse_reopening(id(self))
        check_name(name)
        if params is not None and not isinstance(params, dict):
            raise TypeError(f"params must be a dict such as params={{'bs': 64}}, got {type(params).__name__}")
        if not isinstance(delete, bool):
            raise TypeError(f"delete must be True or False (False: measure and delete nothing), got {delete!r}")
        if not isinstance(cell_log, bool):
            raise ValueError(f"cell_log must be True or False (False: no line after each cell), got {cell_log!r}")
        devices = device_indices(devices) if self._gpu else None
        creator = _creator_frame()
        # What the cell binds to a constructor is this experiment's only where the cell itself
        # calls it: a function's or a class body's `exp = GPUExperiment()` binds no global. A
        # measuring experiment (delete=False) is bound to no name of the user's and protects none.
        handles = ipython.assignment_targets(creator) if delete and creator.f_globals is creator.f_locals else set()
        self._pid = os.getpid()
        # Which running code made it: while that code runs, a constructor of the same name nests.
        self._creator = (id(creator), creator.f_code)
        # The core finishes the experiments this one replaces (same name, or bound to a name
        # this cell binds again) before it opens; names the cell binds above stay theirs.
        self._id, start, replaced, interrupted = _core.open_scope(
            name,
            gpu=self._gpu,
            devices=devices,
            adapter=ipython.namespace_for(creator) if delete else None,
            owner=self,
            cell_log=cell_log,
            limit=size(limit, "limit"),
            # True: every 100 ms; an interval such as "20ms" otherwise. report.plot() draws it.
            monitor_s=None if monitor is False else seconds("100ms" if monitor is True else monitor),
            handles=handles,
            in_use=ipython.names_bound_before(creator.f_lineno) if delete else set(),
            on_stack=_on_stack(),
            params=params,
            trace=trace,
            tool=self._tool,
        )
        try:
            for report in replaced:
                ipython.show(report)
            # From now on the scope's torch peaks must survive a user's reset.
            watch_torch_peak_resets()
            ipython.show(start)
            if interrupted:  # held while the scope opened
                raise KeyboardInterrupt("gpuexp held this interrupt until the experiment had opened")
        except BaseException as error:
            # The constructor raises, so no name of the user's will hold this experiment: it
            # finishes now, deleting nothing (what the cell binds next, the `k` of `except
            # KeyboardInterrupt as k`, is not its own), and the error goes on as itself.
            reports, _ = _core.finish_cut_opening(self._id, type(error).__name__)
            for report in reports:
                ipython.show(report)
            raise

    @property
    def name(self):
        """The experiment's name, as its report shows it."""
        return _core.scope_name(self._id)

    @property
    def data(self):
        """The report as it stands: live while open, final once finished."""
        return _core.scope_report(self._id)

    @property
    def cells(self):
        """The per-cell log of the cells run while the experiment was open (``CellRecord`` list)."""
        return _core.scope_cells(self._id)

    def keep(self, *names):
        """Protects names from deletion at finish: ``exp.keep("model", "opt")``. Each must exist."""
        self._in_this_process()
        for name in names:
            if not isinstance(name, str):
                raise TypeError(
                    f"keep() takes the names of your variables as strings, e.g. exp.keep('model', 'opt'); "
                    f"got {name!r} ({type(name).__name__})"
                )
        _core.keep(self._id, list(names))

    def finish(self):
        """Deletes what the experiment created, frees it, shows and returns the report.

        Calling it again returns the same report and deletes nothing more. Experiments
        opened inside this one are finished first, but those whose ``with`` block is still
        running (in another asyncio task or thread): they finish at its end. Called on another
        thread it returns None at once: the teardown and the report come at the main thread's
        next safe point (the end of the running cell), never from under a running statement.
        """
        self._in_this_process()
        if not _core.is_open(self._id):
            return _core.scope_report(self._id)
        if not _core.owned_by(self._id, id(self)):
            raise RuntimeError(
                f"this object is a copy of experiment {self.name!r} (rebuilt from its state), not the experiment: "
                "only the experiment itself finishes it. Call finish() on the object GPUExperiment(...) returned."
            )
        if threading.current_thread() is not threading.main_thread():
            at_cell_end = _core.finish_off_main_thread(self._id, in_shell=ipython.listening())
            when = "at the end of the running cell" if at_cell_end else "at the next experiment's opening or at exit"
            ipython.warn(f"experiment {self.name!r} was finished on another thread: its teardown and its report "
                         f"come {when}, on the main thread, where no name is deleted from under running code")
            return None
        # `%reset` deletes every name itself, and fails on one deleted under it.
        reports, interrupted = _core.finish(self._id, during_reset=ipython.resetting())
        # Its own report comes last; where the cell displays what this returns, that shows it.
        shown_as_result = not interrupted and ipython.cell_displays_finish()
        for report in reports[:-1] if shown_as_result else reports:
            ipython.show(report)
        if interrupted:  # held while the teardown ran: every step ran and the report is shown
            raise KeyboardInterrupt("gpuexp held this interrupt until the experiment had finished")
        return _core.scope_report(self._id)

    def _in_this_process(self):
        if self._pid != os.getpid():
            raise RuntimeError(
                f"this experiment belongs to process {self._pid}, which forked this one: a forked child "
                "has none of its parent's experiments, and its names are the parent's copies. Finish it "
                "in the parent, or open a new experiment here."
            )

    def __copy__(self):
        raise TypeError(_NOT_COPIED)

    def __deepcopy__(self, memo):
        raise TypeError(_NOT_COPIED)

    def __reduce_ex__(self, protocol):
        raise TypeError(_NOT_COPIED)

    def __reduce__(self):
        raise TypeError(_NOT_COPIED)

    def __setstate__(self, state):
        # A pickle made elsewhere (another kernel, an older gpuexp) must never act on this kernel's scopes.
        raise TypeError(_NOT_COPIED)

    def __enter__(self):
        _core.scope_entered(self._id, True)  # while it runs, no outer finish and no same name finishes it
        return self

    def __exit__(self, *exc_info):
        _core.scope_entered(self._id, False)
        if exc_info[1] is not None and _core.is_open(self._id):
            # A rank's published record says what ended its experiment (an OOM, with what it asked for).
            _core.note_scope_error(self._id, exc_info[1])
        self.finish()
        return False

    def __del__(self):
        scope_id = self._id
        if scope_id is None or self._pid != os.getpid() or sys.is_finalizing() or not _core.is_open(scope_id):
            return
        if not _core.owned_by(scope_id, id(self)):  # a copy rebuilt from its state: not the experiment
            return
        # Found by the cycle collector (which marks an object finalized before calling __del__;
        # a reference count reaching zero marks it after), or dropped on another thread: this
        # could be the middle of any statement, so the core keeps the teardown for a safe point.
        by_collector = gc.is_finalized(self)
        on_main_thread = threading.current_thread() is threading.main_thread()
        if not _core.dropped(scope_id, by_collector=by_collector, on_main_thread=on_main_thread,
                             in_shell=ipython.listening()):
            _finish_unreachable_at_exit()
            return
        try:
            self.finish()
        except KeyboardInterrupt as error:
            ipython.hold_interrupt(error)  # __del__ cannot raise it
        except Exception as error:  # __del__ cannot raise; say what happened instead
            ipython.warn(f"finishing experiment {scope_id} failed: {error!r}")

    def __repr__(self):
        state = "open" if _core.is_open(self._id) else "finished"
        return f"<{type(self).__name__} {self.name!r} {state}>\n{self.data}"

    def _repr_html_(self):
        return self.data._repr_html_()


class CPUExperiment(GPUExperiment):
    """A memory experiment over host RAM only: no GPU rows, no NVML, no torch allocator. The
    arguments are ``GPUExperiment``'s, less those about GPUs; ``trace="host"`` says which lines
    grew the host's memory (tracemalloc)."""

    _gpu = False

    def __init__(self, name=None, *, cell_log=True, monitor=False, params=None, trace=None, delete=True):
        super().__init__(name, cell_log=cell_log, monitor=monitor, params=params, trace=trace, delete=delete)


def find_batch_size(step, start=8, max=4096, *, limit=None, margin=None, power_of_two=False,
                    multiple_of=1, device=None, verifications=2, steps=2, progress=True, estimate=True,
                    ranks_timeout=600, want=None):
    """The largest batch size ``step(batch_size)`` runs at within the GPU's memory, found by
    prediction rather than by trying until it fails.

    ``step`` runs one real step at a batch size (a training step with its backward and
    optimizer, an inference step, or a step over (batch, seq_len) where only the batch varies).
    Two small sizes are probed for torch's exact peak, a line is fitted and checked by a further
    probe, the largest size under the budget is predicted and verified by running it
    ``verifications`` times; an out-of-memory error or an overshoot falls back to bisection,
    which stops within 1% of the edge and holds ``margin`` of that size back. Each trial runs
    the step ``steps`` times in a row, from an emptied cache at each new size: the second step
    shows the steady state (optimizer state, and the blocks the first step left cached), which
    is where a size that fits once can still run out. Every out-of-memory error is cleaned up
    as the OOM rescue does, and torch's cache is emptied at the end, so the next run starts as
    the trials did. A step that raises anything else stops the search with that error.

    The memory a step may use is what torch holds plus what is free on the device, less what
    torch keeps cached at a small size and ``margin`` (default 5%) of the part that grows with
    the batch, or ``limit`` (``"24GiB"``:
    aim for a smaller card; torch's allocations are capped there during the search, so the
    limit is the budget and ``margin`` defaults to 2%, room for the allocator's rounding and
    fragmentation at the cap). A verification that fails steps down 3% once before the search
    bisects. ``power_of_two`` and
    ``multiple_of`` round the answer down.
    With ``estimate`` (the default), the step's peak is first estimated under fake tensors at
    a few sizes (``gpuexp.estimate``, nothing allocated): the search then runs one trial a
    little below the size the estimates predict and one at the size its measured peak corrects
    to. A step that can't run under fake tensors is searched by trials as above, and the table
    says why.

    Called on every rank of an initialised process group, each rank searches its own GPU and
    then all agree, through the group's store, on the largest size that fits on every rank:
    every rank gets that one answer, and the table shows each rank's. A rank whose answer has
    not come after ``ranks_timeout`` seconds is named in a RuntimeError.
    Returns a result whose ``batch_size`` is the answer and which shows every trial as a table.
    When the answer is below ``want`` (by default ``max``) and the step was estimated, its table
    says which option of ``gpuexp.fit`` raises it, and to about what.
    With ``progress``, each trial shows as it ends: in Jupyter the table so far, updated in place;
    in a terminal one line, rewritten; in a script a line per trial.
    """
    count(start, "start", "find_batch_size(step, start=8)")
    count(max, "max", "find_batch_size(step, max=4096)")
    if want is not None:
        count(want, "want", "find_batch_size(step, want=512)")
    if isinstance(verifications, bool) or not isinstance(verifications, int) or not 0 <= verifications < 1 << 32:
        raise ValueError(f"verifications is how often the answer is run again, 0 or more, e.g. verifications=2; "
                         f"got {verifications!r}")
    if isinstance(device, str) and device.strip().lower() in ("cpu", "host"):
        raise ValueError(f"find_batch_size(device={device!r}): the search runs real steps on a GPU and measures "
                         "torch's CUDA allocator; for the host, gpuexp.estimate(step, 64, device='cpu') or "
                         "gpuexp.fit(step, 64, device='cpu') predict the peak")
    return _core.find_batch_size(
        step, start, max, device=None if device is None else device_indices(device, argument="device")[0],
        limit=size(limit, "limit"),
        margin=margin, power_of_two=power_of_two, multiple_of=multiple_of, verifications=verifications, steps=steps,
        progress=live.Progress() if progress else None, estimate=estimate, ranks_timeout=ranks_timeout,
        adapter=ipython.DetachedNamespace(), want=want,
    )


def check_name(name):
    """An experiment's name: None (``exp-N``) or text that a table and a JSON file can show."""
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a string such as 'bs=64', got {type(name).__name__}")
    if name is not None and not name.isascii() and name.encode("utf-8", "replace").decode() != name:
        raise ValueError(f"name {name!r} holds a lone surrogate, which no file or table can show: "
                         "pass a name of plain text, e.g. name.encode('utf-8', 'replace').decode()")


def size(value, name, *, zero=False):
    """Bytes from an int or a string such as "24GiB", read alike ("0" where 0 is taken); None
    stays None. Past what any machine has is refused, never clamped; 0 only where ``zero``."""
    if value is None:
        return None
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            size = _core.parse_size(str(value))
        except ValueError as error:
            raise ValueError(f"{name}={value!r}: {error}") from None
        if size > 0 or zero:
            return size
    more = "" if zero else ", more than 0"
    raise ValueError(f"{name}={value!r}: write a size such as {name}=\"24GiB\" or a number of bytes{more}")


def count(value, name, example):
    """Raises ValueError naming ``name`` and showing ``example`` (a call that passes one) unless
    ``value`` is a positive int that the core can count (below 2**63): a batch size, a number of steps."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, e.g. {example}; got {value!r}")
    if value >= _PAST_ANY_COUNT:
        raise ValueError(f"{name}={value} is past what any step runs (gpuexp counts up to 2**63 - 1): "
                         f"pass a smaller one, e.g. {example}")


_PAST_ANY_COUNT = 1 << 63


def _creator_frame():
    """The frame of the code that created the experiment, past the constructors of this class
    and of user subclasses."""
    frame = sys._getframe(1)
    while frame.f_back is not None and (
        frame.f_globals.get("__name__", "").partition(".")[0] == __name__.partition(".")[0]
        or (frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), GPUExperiment))
    ):
        frame = frame.f_back
    return frame


def _on_stack():
    """The open experiments made by a frame on the current call stack: a constructor of the same
    name nests in them (as in those whose ``with`` block runs, which the core knows)."""
    running = set()
    frame = sys._getframe(1)
    while frame is not None:
        running.add((id(frame), frame.f_code))
        frame = frame.f_back
    return {scope_id for scope_id, experiment in tracked().items()
            if experiment._creator in running}


_at_exit = []


def _finish_unreachable_at_exit():
    """Finishes, when the interpreter exits, the experiments found unreachable that no safe point
    finished before. Registered once one waits: atexit runs it before the sampler stops."""
    if not _at_exit:
        _at_exit.append(atexit.register(_finish_at_exit))


def _finish_at_exit():
    try:
        finish_unreachable("exit")
    except Exception as error:  # the interpreter is going: say what happened, never raise
        ipython.warn(f"finishing the experiments found unreachable failed at exit: {error!r}")


def finish_unreachable(at):
    """Finishes the experiments found unreachable whose teardown may run ``at`` this point
    ("cell_end", "opening", "exit") and shows their reports; returns whether an interrupt came
    meanwhile (held until every teardown had run)."""
    reports, interrupted = _core.finish_unreachable(at)
    for report in reports:
        ipython.show(report)
    return interrupted


def open_experiment(scope_id):
    """The open experiment of a scope, or None."""
    return tracked().get(scope_id)


def tracked():
    """The open experiments, by scope id: the core keeps each in its record (a forked child has none)."""
    return _core.open_experiments()
