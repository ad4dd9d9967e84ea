"""The public experiment scopes. State and teardown live in ``gpuexp._core``."""

import sys
import weakref

from . import _core, ipython, live
from .devices import device_indices
from .monitor import seconds
from .torch_peaks import watch_torch_peak_resets

_open = {}  # scope id -> weak reference to its experiment, for the cell events that notice `del exp`


class GPUExperiment:
    """A memory experiment over host RAM and every visible GPU.

    Everything the experiment's cells create is deleted and freed when it finishes
    (``del exp``, ``exp.finish()`` or the end of a ``with`` block), and a table shows what it
    consumed, what came back and the peak. Names that existed before are never touched unless
    the experiment rebound them. While it is open, a cell where memory moved is followed by a
    compact memory block, and a long cell shows its memory live (``cell_log=False`` turns both
    off). ``params={"bs": 64}`` says what the experiment varied, for ``gpuexp.compare()``; by
    default it is read from the name (``"bs=64,lr=3e-4"``). ``delete=False`` measures and
    reports but deletes nothing: the names stay their owner's (a trainer's callback opens one so).
    """

    _gpu = True

    def __init__(self, name=None, *, devices=None, cell_log=True, limit=None, monitor=False, params=None,
                 delete=True):
        self._id = None
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a string such as 'bs=64', got {type(name).__name__}")
        if params is not None and not isinstance(params, dict):
            raise TypeError(f"params must be a dict such as params={{'bs': 64}}, got {type(params).__name__}")
        if not isinstance(delete, bool):
            raise TypeError(f"delete must be True or False (False: measure and delete nothing), got {delete!r}")
        devices = device_indices(devices) if self._gpu else None
        # Measuring only, the experiment is bound to no name of the user's and protects none.
        self._handles = ipython.assignment_targets() if delete else set()
        creator = _creator_frame() if delete else None
        # The core finishes the experiments this one replaces (same name, or bound to a name
        # this cell binds again) before it opens; names the cell binds above stay theirs.
        self._id, start, replaced, interrupted = _core.open_scope(
            name,
            gpu=self._gpu,
            devices=devices,
            adapter=ipython.namespace_for(creator) if delete else None,
            owner=self,
            cell_log=cell_log,
            limit=_size(limit, "limit"),
            # True: every 100 ms; an interval such as "20ms" otherwise. report.plot() draws it.
            monitor_s=None if monitor is False else seconds("100ms" if monitor is True else monitor),
            handles=self._handles,
            in_use=ipython.names_bound_before(creator.f_lineno) if delete else set(),
            params=params,
        )
        for report in replaced:
            ipython.show(report)
        _open[self._id] = weakref.ref(self)
        # From now on the scope's torch peaks must survive a user's reset.
        watch_torch_peak_resets()
        ipython.show(start)
        if interrupted:  # held while the scope opened; the experiment is open and tracked now
            raise KeyboardInterrupt("gpuexp held this interrupt until the experiment had opened")

    @property
    def name(self):
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
        """Protects names from deletion at finish. Each must exist."""
        _core.keep(self._id, list(names))

    def finish(self):
        """Deletes what the experiment created, frees it, shows and returns the report.

        Calling it again returns the same report and deletes nothing more. Experiments
        opened inside this one are finished first.
        """
        if not _core.is_open(self._id):
            return _core.scope_report(self._id)
        reports, interrupted = _core.finish(self._id)
        for report in reports:
            ipython.show(report)
        if interrupted:  # held while the teardown ran: every step ran and the report is shown
            raise KeyboardInterrupt("gpuexp held this interrupt until the experiment had finished")
        return _core.scope_report(self._id)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        if exc_info[1] is not None and _core.is_open(self._id):
            # A rank's published record says what ended its experiment (an OOM, with what it asked for).
            _core.note_scope_error(self._id, exc_info[1])
        self.finish()
        return False

    def __del__(self):
        scope_id = getattr(self, "_id", None)
        if scope_id is None or sys.is_finalizing() or not _core.is_open(scope_id):
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
    """A memory experiment over host RAM only: no GPU rows, no NVML, no torch allocator."""

    _gpu = False

    def __init__(self, name=None, *, cell_log=True, monitor=False, params=None, delete=True):
        super().__init__(name, cell_log=cell_log, monitor=monitor, params=params, delete=delete)


def find_batch_size(step, start=8, max=4096, *, limit=None, margin=None, power_of_two=False,
                    multiple_of=1, device=None, verifications=2, steps=2, progress=True, estimate=True,
                    ranks_timeout=600):
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
    With ``progress``, each trial shows as it ends: in Jupyter the table so far, updated in place;
    in a terminal one line, rewritten; in a script a line per trial.
    """
    return _core.find_batch_size(
        step, start, max, device=None if device is None else device_indices(device)[0], limit=_size(limit, "limit"),
        margin=margin, power_of_two=power_of_two, multiple_of=multiple_of, verifications=verifications, steps=steps,
        progress=live.Progress() if progress else None, estimate=estimate, ranks_timeout=ranks_timeout,
        adapter=ipython.DetachedNamespace(),
    )


def _size(value, name):
    """Bytes from an int or a string such as "24GiB"; None stays None."""
    if value is None:
        return None
    if isinstance(value, str):
        return _core.parse_size(value)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ValueError(f"{name}={value!r}: write a size such as {name}=\"24GiB\" or a number of bytes")


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


def tracked():
    """The open experiments, by scope id."""
    live = {}
    for scope_id, ref in list(_open.items()):
        experiment = ref()
        if experiment is None or not _core.is_open(scope_id):
            _open.pop(scope_id, None)
        else:
            live[scope_id] = experiment
    return live
