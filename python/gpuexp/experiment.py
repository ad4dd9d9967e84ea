"""The public experiment scopes. State and teardown live in ``gpuexp._core``."""

import sys

from . import _core, ipython


class GPUExperiment:
    """A memory experiment over host RAM and every visible GPU.

    Everything the experiment's cells create is deleted and freed when it finishes
    (``del exp``, ``exp.finish()`` or the end of a ``with`` block), and a table shows what it
    consumed, what came back and the peak. Names that existed before are never touched unless
    the experiment rebound them. While it is open, each cell is followed by a compact memory
    block (``cell_log=False`` turns that off).
    """

    _gpu = True

    def __init__(self, name=None, *, devices=None, cell_log=True):
        self._id = None
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a string such as 'bs=64', got {type(name).__name__}")
        devices = _device_indices(devices) if self._gpu else None
        self._handles = ipython.assignment_targets()
        creator = _creator_frame()
        _finish_replaced(name, self._handles, in_use=ipython.names_bound_before(creator.f_lineno))
        self._id, start = _core.open_scope(
            name,
            gpu=self._gpu,
            devices=devices,
            adapter=ipython.namespace_for(creator),
            owner=self,
            cell_log=cell_log,
        )
        ipython.track(self)
        ipython.show(start)

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
        reports = _core.finish(self._id)
        for report in reports:
            ipython.show(report)
        return _core.scope_report(self._id)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.finish()
        return False

    def __del__(self):
        scope_id = getattr(self, "_id", None)
        if scope_id is None or sys.is_finalizing() or not _core.is_open(scope_id):
            return
        try:
            self.finish()
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

    def __init__(self, name=None, *, cell_log=True):
        super().__init__(name, cell_log=cell_log)


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


def _finish_replaced(name, targets, in_use):
    """Finishes the open experiment of the same name, and those about to be rebound, so the
    new baseline doesn't include their memory. Names in ``in_use`` are kept."""
    replaced = [e._id for e in ipython.tracked().values() if e._handles & targets]
    same_name = _core.open_scope_named(name) if name else None
    for scope_id in dict.fromkeys(replaced + ([same_name] if same_name else [])):
        if _core.is_open(scope_id):
            for report in _core.finish(scope_id, keep=sorted(in_use)):
                ipython.show(report)


def _device_indices(devices):
    """Torch indices from ints, 'cuda:N' strings or torch.device objects."""
    if devices is None:
        return None
    if isinstance(devices, (int, str)) or hasattr(devices, "type"):
        devices = [devices]
    indices = []
    for device in devices:
        index = _device_index(device)
        if index is None:
            raise ValueError(
                f"devices={devices!r}: use GPU indices as torch numbers them, "
                "e.g. devices=[0, 1], devices='cuda:1' or devices=torch.device('cuda', 1)"
            )
        indices.append(index)
    return indices


def _device_index(device):
    if isinstance(device, bool):
        return None
    if isinstance(device, int):
        return device if device >= 0 else None
    if isinstance(device, str):
        text = device.strip().lower()
        text = text[len("cuda:"):] if text.startswith("cuda:") else text
        return int(text) if text.isdigit() else None
    if getattr(device, "type", None) == "cuda":
        return device.index or 0
    return None
