"""Types of ``gpuexp._core``, the native module built from ``rust/src/bindings/``.

tests/test_native_stub.py fails when this file and the built module disagree: a function, class,
method or argument added, removed or renamed in the bindings must be changed here too. The
signatures are written here by hand; the docstrings of what the module has are not: they are its
``__doc__``s (the Rust doc comments), copied by ``python docs/stub.py`` after a build.
"""

import os
from collections.abc import Iterable, Sequence
from typing import Any, Literal, Protocol, TypedDict, final

# The id of an experiment scope, as `open_scope` returns it.
_ScopeId = int
_Path = str | os.PathLike[str]

class _NamespaceAdapter(Protocol):
    """What the core calls on the namespace glue (``gpuexp.ipython``: ``ShellNamespace`` in a
    notebook, ``ModuleNamespace`` for a script's module globals, ``DetachedNamespace`` inside a
    function). The core decides what to delete and in which order; an adapter only reads and
    removes entries where IPython or a module keeps them."""

    @property
    def namespace(self) -> dict[str, Any] | None:
        """The dict the scope's names live in (``user_ns``, module globals); None: nothing to delete."""

    def system_names(self) -> Iterable[str]:
        """Names of the namespace that belong to the shell, not the user (``user_ns_hidden``)."""

    def hidden_refs(self) -> dict[str, object]:
        """The references kept behind the user's back, by the label a report lists them under:
        ``Out[n]``, ``_``, ``__``, ``___``, ``last exception``, ``last cell result``, ``last traceback``."""

    def drop_hidden(self, label: str) -> None:
        """Removes the reference ``hidden_refs`` listed under ``label``, with its twins."""

    def ipythons_own(self) -> dict[Any, object]:
        """The entries IPython itself keeps in the namespace (``user_ns_hidden``): an entry that
        is the same object there is IPython's, and a report never lists it as left."""

    def drop_exception(self, error: BaseException) -> list[str]:
        """After a CUDA out-of-memory error: clears the frames of ``error`` and of the exceptions
        it chains, drops the stored references to it; returns what it cleared, for the report."""

class _Settings(TypedDict):
    sample_interval_ms: float
    cell_log_all_gpus: bool
    oom_rescue: bool
    flight_recorder: bool
    trace_sampling: bool
    cell_log_min_change: int
    live_view_after_s: float | None
    trace: bool | Literal["host", "all"]
    host_peak: Literal["exact", "sampled"]

class _Progress(Protocol):
    """How ``find_batch_size`` shows its trials (``gpuexp.live.Progress``)."""

    def update(self, line: str, html: str) -> None:
        """After each trial: its line, and the table of the trials so far."""

    def finish(self, line: str, html: str) -> None:
        """Once the search stops: its title, and the table."""

class NvmlUnavailable(RuntimeError):
    """A RuntimeError: NVIDIA's management library (NVML) could not be opened: no NVIDIA driver on
    this machine, or none this process can load."""

# ---- what gpuexp shows: each is a text table (str), an HTML one (_repr_html_) and JSON --------

class _Table:
    """Not a class at runtime: the methods rust/src/bindings/report.rs's `shown_as_table!` adds
    (with ``__str__`` and ``__repr__``, the text table)."""

    def to_json(self) -> str:
        """The same data as JSON text (its schema: docs/json.md)."""
    def to_dict(self) -> dict[str, Any]:
        """The same data as dicts, lists, numbers and strings: ``json.loads(self.to_json())``."""
    def _repr_html_(self) -> str:
        """The table as HTML, which Jupyter shows."""

@final
class Metric:
    """One figure of a report (host RSS, torch allocated, NVML process, ...), in bytes."""

    @property
    def start(self) -> int:
        """When the scope opened."""
    @property
    def before_teardown(self) -> int:
        """Just before the teardown deleted anything (now, while the scope is open)."""
    @property
    def end(self) -> int | None:
        """After the teardown; None while the scope is open."""
    @property
    def peak(self) -> int:
        """The highest it went during the scope."""
    @property
    def consumed(self) -> int:
        """before_teardown - start; can be negative."""
    @property
    def reclaimed(self) -> int | None:
        """before_teardown - end: what the teardown gave back; None while open."""
    @property
    def reclaimed_share(self) -> float | None:
        """reclaimed / consumed; None while open or when nothing was consumed."""

@final
class HostReport:
    """The host's figures in a report (``report.host``)."""

    @property
    def rss(self) -> Metric:
        """This process's resident memory."""
    @property
    def available(self) -> int:
        """What the host can still give, capped by the cgroup's headroom where a limit applies."""
    @property
    def total(self) -> int:
        """The system's total memory."""
    @property
    def cgroup_limit(self) -> int | None:
        """The cgroup's memory limit; None where there is none."""

@final
class GpuReport:
    """One GPU's figures in a report (``report.gpus``)."""

    @property
    def torch_index(self) -> int:
        """N in ``cuda:N``."""
    @property
    def nvml_index(self) -> int:
        """The GPU's index in NVML's order (nvidia-smi's)."""
    @property
    def uuid(self) -> str:
        """The GPU's UUID, as nvidia-smi shows it (``GPU-…``)."""
    @property
    def name(self) -> str:
        """The GPU's model, e.g. "NVIDIA H100 80GB HBM3"."""
    @property
    def total(self) -> int:
        """The GPU's memory, in bytes."""
    @property
    def torch_allocated(self) -> Metric | None:
        """What torch's tensors occupy; None when torch was never imported."""
    @property
    def torch_reserved(self) -> Metric | None:
        """What torch's caching allocator holds (allocated plus its cache); None when torch was
        never imported."""
    @property
    def process_used(self) -> Metric | None:
        """NVML's figure for this process; None where the driver doesn't list it."""
    @property
    def device_used(self) -> Metric | None:
        """NVML's figure for the device; None if NVML could not read it."""
    @property
    def num_ooms(self) -> int | None:
        """The CUDA out-of-memory errors torch counted during the scope."""

@final
class Report(_Table):
    """What an experiment found (``exp.data``, ``exp.finish()``, ``gpuexp.history()``): its figures,
    what its teardown did, and its notes. Sizes are in bytes. ``str()`` is the text table."""

    @property
    def name(self) -> str:
        """The experiment's name (``exp-N`` when it was given none)."""
    @property
    def finished(self) -> bool:
        """False while the scope is open."""
    @property
    def started_at(self) -> str:
        """When the scope opened, RFC 3339 UTC."""
    @property
    def finished_at(self) -> str | None:
        """When it finished; None while open."""
    @property
    def duration_s(self) -> float:
        """Seconds from opening to finishing (so far, while open)."""
    @property
    def deleted(self) -> list[str]:
        """The names the teardown deleted."""
    @property
    def rebound(self) -> list[str]:
        """Names from before the scope that it rebound to other objects (deleted too)."""
    @property
    def kept(self) -> list[str]:
        """Names left alone: modules, ``keep()``, names the constructor cell still uses."""
    @property
    def cleared(self) -> list[str]:
        """IPython's references the teardown dropped: ``Out[n]``, ``_``, the last exception, ..."""
    def __copy__(self) -> Report:
        """The report itself: it never changes."""
    def __deepcopy__(self, _memo: Any) -> Report:
        """The report itself: it never changes."""
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        """Pickled as its JSON (``report_from_json``)."""
    @property
    def not_deleted(self) -> list[str]:
        """Names the teardown meant to delete that are still bound, each with why."""
    @property
    def left(self) -> list[str]:
        """Entries the scope made that look like IPython's (``_1``, ``__cache__``), left in place."""
    @property
    def notes(self) -> list[str]:
        """What the table alone would not say: a figure missing and why, memory still held, ..."""
    @property
    def host(self) -> HostReport:
        """Host RSS and memory."""
    @property
    def gpus(self) -> list[GpuReport]:
        """One per GPU the experiment covers."""
    @property
    def rank(self) -> int | None:
        """In a rank of a distributed run, its rank; None outside one (so for the three below)."""
    @property
    def local_rank(self) -> int | None:
        """The rank's index on its host (``LOCAL_RANK``)."""
    @property
    def world_size(self) -> int | None:
        """How many ranks the run has."""
    @property
    def hostname(self) -> str | None:
        """The host the rank ran on."""
    @property
    def child_processes(self) -> list[dict[str, Any]]:
        """Descendants still holding GPU memory at finish, as dicts: pid, command, torch_index, used."""
    def plot(self, path: _Path | None = None) -> Any:
        """The timeline of the experiment's monitor (``monitor=True``) as a matplotlib figure, saved
        to ``path`` when given."""
    @property
    def trace(self) -> Trace | None:
        """With ``trace=True``: where in the code each GPU peaked; None otherwise."""
    def diff(self, other: Report | Trace) -> SiteDiff:
        """Why this experiment peaks higher (or lower) than ``other`` (a traced Report or a Trace),
        by site, sorted by growth, each site's growth related to the params that changed."""
    def plot_timeline(self) -> Timeline:
        """Torch allocated over the experiment, stacked by its top sites (``trace=True``)."""
    def save_snapshot(self, path: _Path) -> None:
        """Writes the experiment's torch snapshot (``trace=True``) for memory_viz and Mosaic; the file
        is replaced atomically."""

@final
class Trace:
    """Where in the code one traced experiment (``report.trace``) or a snapshot file
    (``gpuexp.load_snapshot``) peaked: each GPU's live memory at its peak, grouped by the line of
    code that allocated it. ``str()`` is the text tables, ``_repr_html_`` the HTML ones."""

    def to_json(self) -> str:
        """One entry per GPU as JSON text: its peak by site (each with its stack), its timeline, the
        blocks still held at the end and the out-of-memory errors (the first 100; ``ooms_not_analysed``
        counts the others). A file with no GPU gives an object that says so: ``{"devices": [], "note": ...}``."""
    def to_dict(self) -> list[dict[str, Any]]:
        """The same data as lists, dicts, numbers and strings: ``json.loads(self.to_json())``."""
    def _repr_html_(self) -> str:
        """The tables as HTML, which Jupyter shows."""
    def diff(self, other: Report | Trace) -> SiteDiff:
        """Why this trace peaks higher (or lower) than ``other``'s (a traced Report or a Trace), by
        site, sorted by growth."""
    def plot_timeline(self) -> Timeline:
        """Torch allocated over time stacked by the top sites, the peak marked: inline SVG in
        Jupyter; ``.figure()`` draws it with matplotlib."""
    def save_snapshot(self, path: _Path) -> None:
        """Writes torch's snapshot in its own pickle format, which memory_viz and Mosaic open; the
        file is replaced atomically."""

@final
class SiteDiff:
    """``b.diff(a)``: the difference in peak between two traces, attributed to sites, sorted by
    growth. ``str()`` is the table."""

    def to_dict(self) -> dict[str, Any]:
        """The two peaks, the param that changed, and each site's bytes in both with its growth, as
        dicts, lists, numbers and strings."""
    def _repr_html_(self) -> str:
        """The table as HTML, which Jupyter shows."""

@final
class Timeline:
    """Torch allocated over a traced experiment, stacked by its top sites: inline SVG in Jupyter (no
    script, nothing fetched); ``.figure()`` is a matplotlib Figure of the same data."""

    def to_dict(self) -> list[dict[str, Any]]:
        """One entry per GPU as dicts, lists and numbers: the points' times, the total and each top
        site's series, stacked bottom to top, and the peak."""
    def _repr_html_(self) -> str:
        """The timeline as inline SVG, which Jupyter shows."""
    def figure(self, path: _Path | None = None) -> Any:
        """The timeline as a matplotlib Figure, saved to ``path`` when given."""

@final
class CellRecord(_Table):
    """One cell of the cell log (``exp.cells``, ``gpuexp.cells()``): what it did to memory. ``str()``
    is the compact text block, ``_repr_html_`` the HTML one."""

    @property
    def execution_count(self) -> int:
        """The cell's number: N in ``In [N]``."""
    @property
    def wall_s(self) -> float:
        """How long the cell ran, in seconds."""
    @property
    def notes(self) -> list[str]:
        """What the block alone would not say, e.g. that torch's peak counters were reset during the cell."""

@final
class Holders(_Table):
    """What holds memory, largest first (``gpuexp.holders()``)."""

    @property
    def paths(self) -> list[str]:
        """The paths, largest holder first."""
    def __len__(self) -> int: ...

@final
class OomDiagnosis(_Table):
    """What the OOM rescue shows under a CUDA out-of-memory traceback."""

    @property
    def requested(self) -> int | None:
        """What the failed allocation asked for, in bytes; None where torch's message doesn't say."""
    @property
    def hints(self) -> list[str]:
        """What a person can do, from the figures: the batch that should fit, ``expandable_segments``
        against fragmentation, other processes to stop."""
    @property
    def training(self) -> str | None:
        """Where the training run that raised it stood ("epoch 1, step 7, batch input_ids (8, 128) int64")."""

@final
class Snapshot(_Table):
    """One reading of the host and every visible GPU (``gpuexp.snapshot()``)."""

    @property
    def notes(self) -> list[str]:
        """What the table alone would not say: a figure missing and why."""
    @property
    def gpus(self) -> list[dict[str, Any]]:
        """One dict per visible GPU: its identity, NVML's figures and torch's (its JSON shape)."""
    @property
    def host(self) -> dict[str, Any]:
        """The host's figures as a dict: RSS, available, total, the cgroup's limit (its JSON shape)."""

@final
class BatchSizeResult(_Table):
    """The search ``gpuexp.find_batch_size`` ran: every trial, the fit, the answer. ``str()`` and
    ``_repr_html_`` are its table."""

    @property
    def batch_size(self) -> int | None:
        """The largest batch size that ran within the budget (None if none did)."""
    @property
    def trials(self) -> int:
        """How many trials the search ran."""
    @property
    def verdict(self) -> str:
        """The answer in a sentence: what was found, against which budget, or why nothing was."""

@final
class Comparison(_Table):
    """Experiments side by side (``gpuexp.compare``): ``str()`` and ``_repr_html_`` are the table,
    ``to_dict()`` is ``{"rows": [...]}`` with each report's figures in its own JSON shape."""

    def __len__(self) -> int: ...
    def to_pandas(self) -> Any:
        """One row per experiment, one column per param (numbers stay numbers) and per figure: a
        pandas DataFrame."""
    def plot(self, x: str | None = None) -> Any:
        """The peak of each layer against a numeric param (``x``, or the only one that varies), the
        device's total and the limit as levels, and a fit extrapolated to the largest value
        that fits: a matplotlib Figure."""
    def sites(self) -> SiteDiff:
        """Why the last traced experiment compared peaks higher (or lower) than the first, by site:
        ``last.diff(first)``, each site's growth related to the params that changed."""

# ---- the monitor and the gpuexp command -------------------------------------------------------

@final
class Monitor:
    """The native recorder behind ``gpuexp.Monitor``: it starts at construction, sampling the host
    and every GPU each ``interval_s`` from a native thread, and appends each sample to ``path``
    when given."""

    def __new__(cls, interval_s: float, path: _Path | None = None, gpus: bool = True) -> Monitor: ...
    @staticmethod
    def check(interval_s: float, path: _Path | None = None) -> None:
        """Refuses what `Monitor(...)` would refuse at start, without starting or writing anything."""
    def samples_json(self) -> str:
        """The samples so far, as a JSON list (the Python side turns it into dicts)."""
    @property
    def running(self) -> bool:
        """Whether the recording thread still runs."""
    @property
    def failure(self) -> str | None:
        """Why the recording stopped early (a write to ``path`` failed, ...); None while it is well."""
    def stop(self) -> None:
        """Stops the recording thread and waits for it; the samples stay."""

@final
class GpuStatus:
    """``gpuexp status``: the driver, and every GPU with its compute processes (when asked). Raises
    NvmlUnavailable without a driver."""

    def __new__(cls, cuda_order: bool = False, processes: bool = True) -> GpuStatus: ...
    @property
    def cuda(self) -> str:
        """The newest CUDA version the driver supports, e.g. "13.0"."""
    def __len__(self) -> int: ...
    def to_json(self) -> str:
        """The driver and every GPU as JSON text, as ``gpuexp status --json`` prints it."""

@final
class Watch:
    """``gpuexp watch``: devices opened once, then a refresh every interval, written from Rust.
    Raises NvmlUnavailable without a driver; ``style`` is "live", "csv" or "json"."""

    def __new__(cls, cuda_order: bool, style: Literal["live", "csv", "json"], interval_s: float) -> Watch: ...
    def run(self, log: _Path | None = None, redraw: bool = False) -> None:
        """Runs until Ctrl-C (KeyboardInterrupt) or until standard output closes, writing to ``log``
        too when given; ``redraw`` clears the screen before each refresh."""

# ---- scopes ------------------------------------------------------------------------------------

def open_scope(
    name: str | None = None,
    *,
    gpu: bool = True,
    devices: Sequence[int] | None = None,
    adapter: _NamespaceAdapter | None = None,
    owner: object | None = None,
    cell_log: bool = True,
    limit: int | None = None,
    monitor_s: float | None = None,
    handles: Iterable[str] = ...,
    in_use: Iterable[str] = ...,
    on_stack: Iterable[_ScopeId] = ...,
    params: dict[str, int | float | bool | str] | None = None,
    trace: bool | Literal["cuda", "host", "all"] | None = None,
    tool: bool = False,
) -> tuple[_ScopeId, Snapshot, list[Report], bool]:
    """Opens a scope; returns its id, the state it starts from, the reports of the scopes it
    replaced (see [`crate::scope::Registry::replaced_by`]; `on_stack`: the open scopes whose code
    is still running, never replaced by name), which finish first keeping `in_use`:
    names the constructor's cell binds above the constructor, and whether an interrupt came
    while it opened (held until then: see `interrupts`). `adapter` is None outside any
    namespace (a function body in a script): the scope then measures and reports but deletes nothing.
    `tool`: gpuexp opens it for one of its tools (a trainer's callback), see [`Owner`]."""
def scope_name(id: _ScopeId) -> str: ...
def is_open(id: _ScopeId) -> bool: ...
def open_experiments() -> dict[_ScopeId, Any]:
    """The open experiments (their teardown not begun) whose objects are alive, by scope id."""
def keep(id: _ScopeId, names: Sequence[str]) -> None:
    """Protects names from deletion; each must exist now."""
def finish(id: _ScopeId, keep: Sequence[str] = ..., during_reset: bool = False) -> tuple[list[Report], bool]:
    """Finishes a scope, and first every scope opened inside it. Returns the reports of the
    scopes it finished, innermost first (empty when this scope's teardown is already under
    way), and whether an interrupt came meanwhile: it is held until every step has run, and the
    caller raises it once the reports are shown. `keep` adds names to protect, without the
    existence check of `keep()`. `during_reset`: IPython's `%reset` is clearing the namespace
    and would fail on a name deleted under it, so the teardown leaves every name to the reset."""
def dropped(id: _ScopeId, *, by_collector: bool, on_main_thread: bool, in_shell: bool) -> bool:
    """The experiment's last reference went (its `__del__` runs): returns whether to finish it now.
    Otherwise the core keeps it for the next safe point (see [`crate::scope::Finish`])."""
def unreachable_waiting() -> bool: ...
def scope_entered(id: _ScopeId, begins: bool) -> None:
    """A `with` block over the experiment begins (`begins`) or ends."""
def owned_by(id: _ScopeId, identity: int) -> bool:
    """Whether the object `identity` (its `id()`) is the one that opened the experiment."""
def refuse_reopening(identity: int) -> None:
    """Raises RuntimeError where the object `identity` already owns an open experiment: a second
    `__init__` on it would leave that one open with no owner."""
def finish_off_main_thread(id: _ScopeId, *, in_shell: bool) -> bool:
    """The experiment was finished on another thread: its teardown waits for the main thread's next
    safe point. Returns whether that is the running cell's end (else the next opening or exit)."""
def finish_cut_opening(id: _ScopeId, cut_by: str) -> tuple[list[Report], bool]:
    """Finishes an experiment whose opening `cut_by` (an error's type) stopped before it was bound
    to a name, deleting no name. Returns the reports and whether an interrupt came meanwhile."""
def cell_ended_for_scopes(adapter: _NamespaceAdapter, sighted: Iterable[_ScopeId], bound: Iterable[str]) -> None:
    """A cell has ended: `sighted`, the open experiments one of the user's names still leads to;
    `bound`, the names the cell's own code binds; `adapter`, the user's namespace."""
def finish_unreachable(at: Literal["cell_end", "opening", "exit"]) -> tuple[list[Report], bool]:
    """Finishes the experiments found unreachable whose teardown may run at `at` ("cell_end",
    "opening", "exit"). Returns their reports, innermost first, and whether an interrupt was held."""
def scope_report(id: _ScopeId) -> Report:
    """The report of a scope as it stands: live while open, final once finished."""
def scope_cells(id: _ScopeId) -> list[CellRecord]:
    """The records of the cells that ran while a scope was open."""
def history() -> list[Report]: ...
def history_json() -> str: ...
def snapshot(gpu: bool = True) -> Snapshot:
    """The current state of the host and (with `gpu`) every visible GPU."""
def rescue_oom(error: BaseException, adapter: _NamespaceAdapter | None = None) -> OomDiagnosis | None:
    """The rescue after a cell's error, when it is a CUDA out-of-memory error and the rescue is on
    (`config(oom_rescue=)`): the adapter clears the failed cell's frames and the references to
    its exception, then memory is released as at a teardown. Returns the diagnosis (what was
    asked for, what the device had, what came back), or None when there was nothing to rescue."""
def holders(memory: int | None, min_bytes: int, adapter: _NamespaceAdapter | None = None) -> Holders:
    """What holds memory on a GPU (by torch index) or the host, largest first."""

# ---- training runs (gpuexp.integrations) -------------------------------------------------------

def begin_run(id: _ScopeId) -> None:
    """The open scope `id` measures a training run from now on: its first interval starts here."""
def run_step(id: _ScopeId, epoch: int, step: int) -> None:
    """The run is at `step` (the optimizer steps completed) of `epoch`."""
def run_batch(id: _ScopeId, batch: object) -> None:
    """The batch the run is about to take: its shapes are read now, and no reference is kept."""
def run_peaks(id: _ScopeId, every: Literal["epoch", "steps"] = "epoch") -> dict[str, float]:
    """The peaks of the run's epoch (`every="epoch"`) or of its steps since the last step-level
    log (`every="steps"`), as a trainer logs them: `{"gpuexp/torch_allocated_peak_mib": 812.5, ...}`.
    The next interval of that kind starts here."""
def runs_in_flight() -> list[_ScopeId]:
    """The runs still training, oldest first: when an error reaches the cell, they have ended."""
def note_run_error(id: _ScopeId, error: BaseException) -> None:
    """The run ended with `error`: its report says so and where it stood, and an OOM diagnosis of
    the same exception names that position."""
def compare(reports: Sequence[Report] | None = None) -> Comparison:
    """``reports`` side by side; by default this kernel's history."""

# ---- the cell log and settings -----------------------------------------------------------------

def cell_log_active() -> bool: ...
def set_standalone_log(on: bool, every_cell: bool = False) -> None:
    """`%gpuexp log on|all|off`: the cell log without an experiment; `every_cell` (`log all`) shows
    every cell's block, not only those of cells where something moved."""
def begin_cell() -> None:
    """Opens the window of a cell about to run (the `pre_run_cell` event): where the previous
    logged cell ended when nothing came in between, so that a cell reads memory once, at its end."""
def arm_recorder() -> None:
    """At a cell's start and an experiment's opening: arms the recorder where gpuexp is active, the
    recorder is on and torch has CUDA initialised (its first steps then run with the history)."""
RECORDER_HISTORY_STEPS: int
"""Completed steps after each cell's start (or experiment's opening) that the flight recorder
records with torch's allocation history; later steps read a level at their end."""
def mark_step(kind: Literal["optimizer step", "trainer step", "finder step", "cell"]) -> None:
    """A step completed ("optimizer step", "trainer step", "finder step" or "cell"): the OOM
    diagnosis counts what grew from the latest one, the recorder's schedule moves on, and a
    traced experiment's sampled stacks may switch on or off for the next."""
def end_cell(execution_count: int) -> tuple[CellRecord | None, int | None]:
    """Closes the running cell's window and records it (the `post_run_cell` event). Returns the
    record when its block shows (something moved by `cell_log_min_change`, or `%gpuexp log all`),
    and the window of the cell's live view if one was drawn: the caller replaces it."""
def cell_grew(holders: list[tuple[str, int, int]]) -> None:
    """The holders the running cell's code grows, each `(path, items, tensor_bytes)` as read at its
    end: the cell log notes a creep where three cells in a row each end higher growing one."""
def cells() -> list[CellRecord]:
    """Every cell record of this kernel, oldest first."""
def before_user_peak_reset() -> None:
    """Called by gpuexp's wrapper of `torch.cuda.reset_peak_memory_stats` just before the
    user's reset: the peaks seen so far are folded into the open windows, so none is lost."""
def config(
    sample_interval_ms: float | None = None,
    cell_log_all_gpus: bool | None = None,
    oom_rescue: bool | None = None,
    cell_log_min_change: int | None = None,
    live_view_after_s: float | Literal[False] | None = None,
    trace: bool | Literal["cuda", "host", "all"] | None = None,
    flight_recorder: bool | None = None,
    trace_sampling: bool | None = None,
) -> _Settings:
    """Reads and changes settings; returns them all. `host_peak` is read-only: "exact" where the
    kernel's peak RSS can be reset, "sampled" where the sampler thread stands in for it.
    `live_view_after_s` is seconds, or False for no live view (None leaves it as it is)."""
def shutdown() -> None:
    """Stops the sampler thread (at interpreter exit, and when a kernel shuts down)."""

# ---- the live view of a running cell -----------------------------------------------------------

def live_view_wait() -> tuple[int, bool] | None:
    """Blocks until a running cell's view is due: (the cell's window, whether the view is new);
    None once `live_view_stop` ran."""
def live_view(window: int, width: int) -> tuple[str, str, str] | None:
    """The view of the cell of `window` as it stands: (one line of at most `width` characters for
    a terminal, the text table, the HTML); None once that cell has ended."""
def live_view_stop() -> None:
    """Ends the drawing thread's wait for good (at interpreter exit)."""

# ---- the batch-size finder ---------------------------------------------------------------------

def find_batch_size(
    step: Any,
    start: int,
    max: int,
    *,
    device: int | None = None,
    limit: int | None = None,
    margin: float | None = None,
    power_of_two: bool = False,
    multiple_of: int = 1,
    verifications: int = 2,
    steps: int = 2,
    progress: _Progress | None = None,
    estimate: bool = True,
    ranks_timeout: float = 600.0,
    adapter: _NamespaceAdapter,
    want: int | None = None,
) -> BatchSizeResult:
    """Runs the search. The arguments are checked before anything touches the GPU. `adapter`
    clears a failed step's frames, as the OOM rescue does, so its tensors can be freed.
    `progress` (`gpuexp.live.Progress`) shows each trial as it ends: `update(line, html)` with
    the trial's line and the table so far, and `finish(line, html)` once the search stops."""

# ---- where every byte goes, and a step's peak before it runs ------------------------------------

class NoEstimate(RuntimeError):
    """A RuntimeError: the step could not run under fake tensors, so no estimate was made; the
    message names the operator and why."""

@final
class Explanation(_Table):
    """How one device's memory adds up, in bytes by category (``gpuexp.explain()``). ``str()`` and
    ``_repr_html_`` are its table."""

    @property
    def device(self) -> str:
        """The device explained: ``cuda:N`` or ``cpu``."""
    @property
    def categories(self) -> dict[str, int]:
        """Bytes by category: parameters, gradients, optimizer_state, buffers, other_tensors,
        no_python_tensor, torch_cache, not_torch (None where a category does not apply)."""
    @property
    def paths(self) -> list[str]:
        """The paths of the other tensors, largest first."""
    @property
    def notes(self) -> list[str]:
        """What the table alone would not say: a figure NVML withholds, parts that exceed a total, how
        many objects were visited."""

@final
class Estimate(_Table):
    """The prediction of ``gpuexp.estimate``: the peak a step will reach, and whether it fits.
    ``str()`` and ``_repr_html_`` are its table."""

    @property
    def peak(self) -> int:
        """The predicted peak of torch allocated above what is allocated now, in bytes."""
    @property
    def batch_size(self) -> int:
        """The batch size the step was run at."""
    @property
    def device(self) -> str:
        """Where the step would run: ``cuda:N`` or ``cpu``."""
    @property
    def categories(self) -> dict[str, int]:
        """What was live at the peak, in bytes by category."""
    @property
    def fits_free_memory(self) -> bool:
        """Whether the peak fits the device's free memory (NVML's free plus torch's cache; for the
        host, its available memory)."""
    @property
    def fits_limit(self) -> bool | None:
        """Whether what is allocated now plus the peak fits ``limit=``; None without a limit."""
    @property
    def seconds(self) -> float:
        """How long the estimate took, in seconds."""

def explain(memory: int | None, adapter: _NamespaceAdapter | None = None) -> Explanation:
    """Explains a GPU's memory (by torch index) or, with None, the host's."""
def estimate(
    step: Any, batch_size: int, *, memory: int | None = None, limit: int | None = None, steps: int = 1
) -> Estimate:
    """`gpuexp.estimate`: the step's peak at one batch size, predicted without running it."""

@final
class SavedStep:
    """Everything a real step can change in the objects given to `save_step`, as it was: the
    containers by the identity of what they hold, the tensors' values and gradients (copied to
    host memory), the four RNGs. `restore()` puts them back."""

    def restore(self) -> tuple[list[str], dict[str, Any]]:
        """Puts every piece back, in the order saved; returns (failed, kept): each piece that could
        not be put back as "name (Error: message)", and the value before of each by name."""

def save_step(modules: Any, optimizers: Any, scalers: Any, objects: Any) -> SavedStep:
    """Saves by value all a real step can change in these objects (`gpuexp.saved_state.capture`'s
    arguments: each a dict of name to object, or a list): every container reachable from them,
    the value and gradient of every tensor there, every submodule's `training` flag (in its
    attributes), and the four RNGs."""

def estimating() -> bool:
    """`gpuexp.estimating()`: whether gpuexp is running a step on fake tensors on this thread now
    (an estimate, `fit`'s options, the finder's seed), so that a step can skip what needs its
    tensors' values then (a print of `loss.item()`, a branch on it)."""
def check_step(step: Any, call: str) -> None:
    """The one check that `step` is what `estimate`, `find_batch_size`, `fit` and `verify` take;
    `call` shows it called, e.g. `estimate(train_step, 64)`. Raises TypeError naming both."""

# ---- fit: what to change so a step fits ---------------------------------------------------------

@final
class FitReport(_Table):
    """What ``gpuexp.fit`` found: why the step does not fit, and the options ranked by what they
    save, each with its predicted peak, its cost and its code. ``str()`` and ``_repr_html_`` are
    its tables."""

    @property
    def peak(self) -> int:
        """The step's predicted peak, in bytes above what is allocated now."""
    @property
    def budget(self) -> int | None:
        """Bytes the peak may reach (free memory, or ``limit=``); None where it is unknown."""
    @property
    def fits(self) -> bool | None:
        """Whether the step fits as it is; None without a budget."""
    @property
    def options(self) -> list[dict[str, Any]]:
        """The options, ranked, as dicts: option, title, peak, saves, fits, cost, code, refused."""
    @property
    def best(self) -> dict[str, Any] | None:
        """The first option that fits, else the one that saves the most; None where none was estimated."""
    @property
    def largest_batch(self) -> int | None:
        """The largest batch that fits as the step is, from the estimates' line."""
    def raises(self, answer: int) -> str | None:
        """Which options raise the batch that fits above ``answer``, and to about what, in a sentence."""

def fit_checkpoint_plan(input: str, more: int) -> dict[str, Any]:
    """The blocks to checkpoint so that the step fits, saving `more` bytes beyond what is needed:
    ``{"paths": [...], "saving": bytes, "forward_flops": n, "enough": bool}``."""
def fit_accumulation(input: str) -> dict[str, Any] | None:
    """Gradient accumulation's micro-batches: ``{"k": n, "micro_batch": n, "predicted": bytes}``, or None."""
def fit_report(input: str) -> FitReport:
    """The report, from everything Python gathered."""

# ---- across ranks ------------------------------------------------------------------------------

@final
class Ranks(_Table):
    """Every rank's latest report of one experiment (``gpuexp.ranks()``): ``str()`` and
    ``_repr_html_`` show the table, outliers flagged."""

    @property
    def name(self) -> str:
        """The experiment's name."""
    @property
    def world_size(self) -> int:
        """How many ranks the run has."""
    @property
    def reports(self) -> list[Report | None]:
        """One report per rank, in rank order; None for a rank that never reported."""
    @property
    def missing(self) -> list[int]:
        """The ranks that never reported."""
    @property
    def flags(self) -> list[str]:
        """The outliers in words: ranks missing, a rank that ran out of memory or raised, one that
        peaked more than 10% over the median."""
    @property
    def errors(self) -> list[str | None]:
        """The exception that ended each rank's experiment (None where none did), in rank order."""
    def to_pandas(self) -> Any:
        """One row per rank, indexed by rank, sizes in bytes: a pandas DataFrame."""

def default_device() -> int | None:
    """The GPU `explain`, `holders` and `estimate` mean by default, once CUDA is initialised: the
    rank's own in a rank, else torch's current one. None before (the host)."""
def load_snapshot(path: _Path) -> Trace:
    """Any torch memory snapshot (a cluster job's OOM dump, memory_viz's file), read and replayed:
    the same peak tables, diff and timeline as a traced experiment. ``gpuexp.load_snapshot``
    checks the path first. Only a regular file is read, without waiting on it (a FIFO or a device
    is refused); Ctrl-C stops the read and the parse, which run with the GIL released, and the
    analysis, which holds it."""
def write_atomically(path: _Path, data: bytes) -> None:
    """Replaces `path` with `data` atomically: the old file or the new one, never a cut-off one;
    the old file's mode kept; no temporary file left on failure."""
def ranks(name: str | None = None, timeout: float = 10.0) -> Ranks:
    """`gpuexp.ranks()`: every rank's latest report of an experiment, from the store
    `GPUEXP_RANKS_STORE` names (the kernel's own), or in a rank without one, its group's."""
def note_scope_error(id: _ScopeId, error: BaseException) -> None:
    """The exception that ended an experiment's `with` block: it goes into the published record."""
def last_publish_s() -> tuple[float, float] | None:
    """What the last publish took (identity, run token, both stores), for the bench: wall and
    CPU seconds."""
def kernel_ranks_store() -> str:
    """This kernel's private store directory for the ranks it launches, as `file://…`."""
def remove_kernel_ranks_store() -> None: ...
def host_ranks_store(address: str = "127.0.0.1", port: int = 0) -> str:
    """Hosts a TCPStore in this process, listening on `address` only (loopback by default);
    returns its address as `tcp://host:port`."""
def is_forked_child() -> bool:
    """Whether this process was forked from one that had gpuexp loaded (a rank forked from a
    kernel): it runs no cells, and the shell is the parent's."""
def after_fork_in_child() -> None:
    """Threads and sockets of the parent are forgotten, never joined or closed, since they don't
    exist here or aren't ours."""
def parse_size(text: str) -> int:
    """Bytes from "24GiB", "512MiB" or a number."""
def report_from_json(json: str) -> Report:
    """A report back from its JSON (how a pickled ``Report`` loads)."""
def parse_interval(interval: str | float) -> float:
    """Seconds from 0.1, "100ms", "1s" or "2min": a number is seconds, anything else is read as text."""
