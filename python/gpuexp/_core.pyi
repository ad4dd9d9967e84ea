"""Types of ``gpuexp._core``, the native module built from ``rust/src/bindings/``.

tests/test_native_stub.py fails when this file and the built module disagree: a function, class,
method or argument added, removed or renamed in the bindings must be changed here too.
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
    """The NVIDIA driver's NVML library cannot be opened (no driver, or no GPU machine)."""

# ---- what gpuexp shows: each is a text table (str), an HTML one (_repr_html_) and JSON --------

class _Table:
    """Not a class at runtime: the methods rust/src/bindings/report.rs's `shown_as_table!` adds
    (with ``__str__`` and ``__repr__``, the text table)."""

    def to_json(self) -> str: ...
    def to_dict(self) -> dict[str, Any]: ...
    def _repr_html_(self) -> str: ...

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
    """The host's figures in a report."""

    @property
    def rss(self) -> Metric:
        """This process's resident memory."""
    @property
    def available(self) -> int:
        """What the host can still give, capped by the cgroup's headroom where a limit applies."""
    @property
    def total(self) -> int: ...
    @property
    def cgroup_limit(self) -> int | None:
        """The cgroup's memory limit; None where there is none."""

@final
class GpuReport:
    """One GPU's figures in a report."""

    @property
    def torch_index(self) -> int:
        """N in ``cuda:N``."""
    @property
    def nvml_index(self) -> int:
        """The GPU's index in NVML's order (nvidia-smi's)."""
    @property
    def uuid(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def total(self) -> int: ...
    @property
    def torch_allocated(self) -> Metric | None:
        """None when torch was never imported."""
    @property
    def torch_reserved(self) -> Metric | None: ...
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
    what its teardown did, and its notes. Sizes are in bytes."""

    @property
    def name(self) -> str: ...
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
    def duration_s(self) -> float: ...
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
    def local_rank(self) -> int | None: ...
    @property
    def world_size(self) -> int | None: ...
    @property
    def hostname(self) -> str | None: ...
    @property
    def child_processes(self) -> list[dict[str, Any]]:
        """Descendants still holding GPU memory at finish: pid, command, torch_index, used."""
    def plot(self, path: _Path | None = None) -> Any:
        """The timeline of ``monitor=True`` as a matplotlib figure."""
    @property
    def trace(self) -> Trace | None:
        """With ``trace=True``: where in the code each GPU peaked; None otherwise."""
    def diff(self, other: Report | Trace) -> SiteDiff:
        """Why this experiment peaks higher than ``other``, by site, sorted by growth."""
    def plot_timeline(self) -> Timeline:
        """Torch allocated over the experiment, stacked by its top sites (``trace=True``)."""
    def save_snapshot(self, path: _Path) -> None:
        """Torch's snapshot of the experiment (``trace=True``), for memory_viz and Mosaic."""

@final
class Trace:
    """Each GPU's live memory at its peak, grouped by the line of code that allocated it."""

    def to_json(self) -> str: ...
    def to_dict(self) -> list[dict[str, Any]]: ...
    def _repr_html_(self) -> str: ...
    def diff(self, other: Report | Trace) -> SiteDiff:
        """Why this trace peaks higher than ``other``'s, by site."""
    def plot_timeline(self) -> Timeline: ...
    def save_snapshot(self, path: _Path) -> None:
        """Torch's snapshot pickle, written atomically."""

@final
class SiteDiff:
    """The difference in peak between two traces, attributed to sites."""

    def to_dict(self) -> dict[str, Any]: ...
    def _repr_html_(self) -> str: ...

@final
class Timeline:
    """Allocated over time stacked by the top sites: inline SVG in Jupyter."""

    def to_dict(self) -> list[dict[str, Any]]: ...
    def _repr_html_(self) -> str: ...
    def figure(self, path: _Path | None = None) -> Any:
        """The same as a matplotlib Figure, saved to ``path`` when given."""

@final
class CellRecord(_Table):
    """One cell of the cell log (``exp.cells``, ``gpuexp.cells()``)."""

    @property
    def execution_count(self) -> int: ...
    @property
    def wall_s(self) -> float: ...
    @property
    def notes(self) -> list[str]: ...

@final
class Holders(_Table):
    """What holds memory, largest first (``gpuexp.holders()``)."""

    @property
    def paths(self) -> list[str]: ...
    def __len__(self) -> int: ...

@final
class OomDiagnosis(_Table):
    """What the OOM rescue shows after a CUDA out-of-memory error."""

    @property
    def requested(self) -> int | None:
        """What the failed allocation asked for; None where torch's message doesn't say."""
    @property
    def hints(self) -> list[str]: ...
    @property
    def training(self) -> str | None:
        """Where the training run that raised it stood: epoch, step, the batch's shapes."""

@final
class Snapshot(_Table):
    """One reading of the host and every visible GPU (``gpuexp.snapshot()``)."""

    @property
    def notes(self) -> list[str]: ...
    @property
    def gpus(self) -> list[dict[str, Any]]: ...
    @property
    def host(self) -> dict[str, Any]: ...

@final
class BatchSizeResult(_Table):
    """The search ``find_batch_size`` ran: every trial, the fit, the answer."""

    @property
    def batch_size(self) -> int | None: ...
    @property
    def trials(self) -> int: ...
    @property
    def verdict(self) -> str: ...

@final
class Comparison(_Table):
    """Experiments side by side (``gpuexp.compare``); ``to_dict()`` is ``{"rows": [...]}``."""

    def __len__(self) -> int: ...
    def to_pandas(self) -> Any:
        """One row per experiment, one column per param and figure (a pandas DataFrame)."""
    def plot(self, x: str | None = None) -> Any:
        """Each layer's peak against a numeric param, the levels and a fit (a matplotlib Figure)."""
    def sites(self) -> SiteDiff:
        """Why the last traced experiment peaks higher than the first, by site (``last.diff(first)``)."""

# ---- the monitor and the gpuexp command -------------------------------------------------------

@final
class Monitor:
    """The native recorder behind ``gpuexp.Monitor``: it starts at construction."""

    def __new__(cls, interval_s: float, path: _Path | None = None, gpus: bool = True) -> Monitor: ...
    @staticmethod
    def check(interval_s: float, path: _Path | None = None) -> None:
        """Raises what starting would (ValueError, OSError), without starting or writing anything."""
    def samples_json(self) -> str: ...
    @property
    def running(self) -> bool: ...
    @property
    def failure(self) -> str | None: ...
    def stop(self) -> None: ...

@final
class GpuStatus:
    """Raises NvmlUnavailable without a driver."""

    def __new__(cls, cuda_order: bool = False, processes: bool = True) -> GpuStatus: ...
    @property
    def cuda(self) -> str: ...
    def __len__(self) -> int: ...
    def to_json(self) -> str: ...

@final
class Watch:
    """Raises NvmlUnavailable without a driver."""

    def __new__(cls, cuda_order: bool, style: Literal["live", "csv", "json"], interval_s: float) -> Watch: ...
    def run(self, log: _Path | None = None, redraw: bool = False) -> None: ...

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
) -> tuple[_ScopeId, Snapshot, list[Report], bool]:
    """(id, the start, the reports of the scopes it replaced, whether an interrupt was held)."""
def scope_name(id: _ScopeId) -> str: ...
def is_open(id: _ScopeId) -> bool: ...
def keep(id: _ScopeId, names: Sequence[str]) -> None: ...
def finish(id: _ScopeId, keep: Sequence[str] = ..., during_reset: bool = False) -> tuple[list[Report], bool]:
    """(the reports of the scopes finished, innermost first; whether an interrupt was held)."""
def scope_report(id: _ScopeId) -> Report: ...
def scope_cells(id: _ScopeId) -> list[CellRecord]: ...
def history() -> list[Report]: ...
def history_json() -> str: ...
def snapshot(gpu: bool = True) -> Snapshot: ...
def rescue_oom(error: BaseException, adapter: _NamespaceAdapter | None = None) -> OomDiagnosis | None:
    """The rescue after a CUDA out-of-memory error; None for any other error, or with the rescue off."""
def holders(memory: int | None, min_bytes: int, adapter: _NamespaceAdapter | None = None) -> Holders: ...

# ---- training runs (gpuexp.integrations) -------------------------------------------------------

def begin_run(id: _ScopeId) -> None:
    """The open scope measures a training run from now on; its first interval starts."""
def run_step(id: _ScopeId, epoch: int, step: int) -> None: ...
def run_batch(id: _ScopeId, batch: object) -> None:
    """Reads the shapes of the batch's tensors and arrays; keeps no reference to it."""
def run_peaks(id: _ScopeId, every: Literal["epoch", "steps"] = "epoch") -> dict[str, float]:
    """The peaks in MiB by metric name (``gpuexp/torch_allocated_peak_mib``...) of the epoch or of
    the steps since the last step-level log; the next interval of that kind starts."""
def runs_in_flight() -> list[_ScopeId]: ...
def note_run_error(id: _ScopeId, error: BaseException) -> None:
    """The run raised ``error``: its report says so, and an OOM diagnosis of it names where it stood."""
def compare(reports: Sequence[Report] | None = None) -> Comparison:
    """``reports`` side by side; by default this kernel's history."""

# ---- the cell log and settings -----------------------------------------------------------------

def cell_log_active() -> bool: ...
def set_standalone_log(on: bool, every_cell: bool = False) -> None: ...
def begin_cell() -> None: ...
def end_cell(execution_count: int) -> tuple[CellRecord | None, int | None]:
    """(the record if its block shows, the window of the cell's live view if one was drawn)."""
def cells() -> list[CellRecord]: ...
def before_user_peak_reset() -> None: ...
def config(
    sample_interval_ms: float | None = None,
    cell_log_all_gpus: bool | None = None,
    oom_rescue: bool | None = None,
    cell_log_min_change: int | None = None,
    live_view_after_s: float | Literal[False] | None = None,
    trace: bool | Literal["cuda", "host", "all"] | None = None,
) -> _Settings:
    """``live_view_after_s``: seconds, False for no live view, None to leave it."""
def shutdown() -> None: ...

# ---- the live view of a running cell -----------------------------------------------------------

def live_view_wait() -> tuple[int, bool] | None:
    """Blocks, without the GIL, until a running cell's view is due: (its window, whether the view
    is new); None once ``live_view_stop`` ran."""
def live_view(window: int, width: int) -> tuple[str, str, str] | None:
    """(one terminal line of at most ``width`` characters, the text table, the HTML); None once
    that cell has ended."""
def live_view_stop() -> None: ...

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
) -> BatchSizeResult: ...

# ---- where every byte goes, and a step's peak before it runs ------------------------------------

class NoEstimate(RuntimeError):
    """A step could not run under fake tensors; the message names the operator or the object."""

@final
class Explanation(_Table):
    @property
    def device(self) -> str: ...
    @property
    def categories(self) -> dict[str, int]:
        """parameters, gradients, optimizer_state, buffers, other_tensors, no_python_tensor,
        torch_cache and not_torch, in bytes."""
    @property
    def paths(self) -> list[str]: ...
    @property
    def notes(self) -> list[str]: ...

@final
class Estimate(_Table):
    @property
    def peak(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def device(self) -> str: ...
    @property
    def categories(self) -> dict[str, int]: ...
    @property
    def fits_free_memory(self) -> bool: ...
    @property
    def fits_limit(self) -> bool | None: ...
    @property
    def seconds(self) -> float: ...

def explain(memory: int | None, adapter: _NamespaceAdapter | None = None) -> Explanation: ...
def estimate(
    step: Any, batch_size: int, *, memory: int | None = None, limit: int | str | None = None, steps: int = 1
) -> Estimate: ...

# ---- across ranks ------------------------------------------------------------------------------

@final
class Ranks(_Table):
    """Every rank's latest report of one experiment (``gpuexp.ranks()``)."""

    @property
    def name(self) -> str: ...
    @property
    def world_size(self) -> int: ...
    @property
    def reports(self) -> list[Report | None]: ...
    @property
    def missing(self) -> list[int]: ...
    @property
    def flags(self) -> list[str]: ...
    @property
    def errors(self) -> list[str | None]: ...
    def to_pandas(self) -> Any: ...

def default_device() -> int | None: ...
def load_snapshot(path: _Path) -> Trace: ...
def write_atomically(path: _Path, data: bytes) -> None: ...
def ranks(name: str | None = None, timeout: float = 10.0) -> Ranks: ...
def note_scope_error(id: _ScopeId, error: BaseException) -> None: ...
def last_publish_s() -> tuple[float, float] | None:
    """What the last publish cost: wall seconds and this thread's CPU seconds (for the bench)."""
def kernel_ranks_store() -> str: ...
def remove_kernel_ranks_store() -> None: ...
def host_ranks_store(address: str = "127.0.0.1", port: int = 0) -> str: ...
def before_fork() -> None: ...
def after_fork_in_parent() -> None: ...
def after_fork_in_child() -> None: ...
def parse_size(text: str) -> int: ...
def report_from_json(json: str) -> Report:
    """A report back from its JSON (how a pickled ``Report`` loads)."""
def parse_interval(interval: str | float) -> float:
    """Seconds from 0.1, \"100ms\", \"1s\" or \"2min\"."""
