"""gpuexp: memory experiments for GPU notebooks.

``exp = GPUExperiment("bs=64")`` ... ``del exp`` gives back every byte the experiment took
and shows what it consumed, reclaimed and peaked at: host RSS, NVML (device and this
process) and torch's allocator.
"""

import atexit
import os
import sys

from . import _core, experiment, extension, files, ipython
from ._core import (
    BatchSizeResult,
    CellRecord,
    Comparison,
    Estimate,
    Explanation,
    FitReport,
    GpuReport,
    Holders,
    HostReport,
    Metric,
    NoEstimate,
    NvmlUnavailable,
    OomDiagnosis,
    Ranks,
    Report,
    SiteDiff,
    Snapshot,
    Timeline,
    Trace,
)
from .devices import device_indices
from .experiment import CPUExperiment, GPUExperiment, find_batch_size
from .fit import fit
from .fit_apply import checkpointed
from .monitor import Monitor
from .ranks import host_ranks_store, ranks

__version__ = "0.1.0"

__all__ = [
    "BatchSizeResult",
    "CellRecord",
    "Comparison",
    "CPUExperiment",
    "Estimate",
    "Explanation",
    "FitReport",
    "GPUExperiment",
    "GpuReport",
    "Holders",
    "HostReport",
    "Metric",
    "Monitor",
    "NoEstimate",
    "NvmlUnavailable",
    "OomDiagnosis",
    "Ranks",
    "Report",
    "SiteDiff",
    "Snapshot",
    "Timeline",
    "Trace",
    "cells",
    "checkpointed",
    "compare",
    "config",
    "load_snapshot",
    "estimate",
    "estimating",
    "explain",
    "find_batch_size",
    "fit",
    "holders",
    "history",
    "host_ranks_store",
    "ranks",
    "save_history",
    "snapshot",
]


def snapshot(gpu=True):
    """The current state: host RSS and memory, and every visible GPU (NVML and torch)."""
    return _core.snapshot(gpu)


def history():
    """The reports of the experiments finished in this kernel, oldest first."""
    return _core.history()


def save_history(path):
    """Writes this kernel's finished reports to ``path`` (a str or os.PathLike) as a JSON list;
    returns the path. The file is replaced atomically: a failure (a full disk, say) leaves the
    previous file as it was, and the error names the path."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"save_history() takes a file path, e.g. save_history('runs.json'); got {path!r}")
    text = _core.history_json() + "\n"
    files.write_atomically(path, lambda out: out.write(text.encode("utf-8")))
    return path


def holders(device=None, min_bytes=1 << 20):
    """What still holds memory, largest first, each with the path a person would write to reach
    it: ``cache[0]``, ``Out[12]``, ``model.encoder.layers.3.weight``, ``opt.state[...]['exp_avg']``,
    a closure cell, a module global ``mymod.CACHE``, a frame of the stored traceback, an
    ``lru_cache`` entry ``table (lru_cache entry for (1024,))``, a running thread's local
    ``thread "loader": worker(), line 4: buf``, a suspended generator or a pending asyncio task.
    What a tensor's autograd graph saved is charged to it: ``preds[0] (8.00 MiB, and 144.00 MiB
    saved for its backward)``. See docs/leak-hunter.md.

    device: a GPU (``0``, ``'cuda:1'``, ``'cuda'`` for torch's current one, a ``torch.device``)
        or ``'cpu'`` for host memory (CPU tensors and numpy arrays). By default, torch's current
        GPU once CUDA is initialised, else the host. Each storage counts once, however many tensors view it.
    min_bytes: the smallest holder worth listing, in bytes or as ``"1MiB"`` (the default).

    Also shows what no reachable Python object accounts for: tensors only C++ holds, memory
    torch allocated with no Python tensor (saved for backward, CUDA graphs, workspaces) and its
    reserved-but-unallocated cache. Keeps no reference to anything it found.
    """
    min_bytes = experiment.size(min_bytes, "min_bytes", zero=True)
    adapter = ipython.namespace_for(sys._getframe(1))
    return _core.holders(_holder_memory(device), min_bytes, adapter=adapter)


def explain(device=None):
    """How one device's memory adds up, in bytes by category: parameters, gradients,
    optimizer_state and buffers of the modules and optimizers reachable from your names;
    other_tensors, with the paths that hold them; no_python_tensor (saved for backward,
    workspaces); torch_cache (reserved, unallocated; the fragmented part shown apart); and
    not_torch, the rest of NVML's figure for this process (the CUDA context, kernels, cuBLAS,
    cuDNN, NCCL, other libraries), labelled as a residual. Other processes on the GPU follow, so
    that NVML's device figure adds up too. For ``'cpu'``: the host's RSS, split the same way for
    CPU tensors and NumPy arrays; the rest is "not tensors".

    device: as for ``holders()``. Returns an ``Explanation``: a table (text and HTML), ``to_dict()``.
    """
    return _core.explain(_holder_memory(device), adapter=ipython.namespace_for(sys._getframe(1)))


def estimate(step, batch_size, *, device=None, limit=None, steps=1):
    """The peak of torch allocated that ``step(batch_size)`` will reach above what is allocated
    now, predicted by running it once under torch's fake tensors: nothing is allocated on the
    device, and the model's parameters, gradients and optimizer state are left exactly as they
    were. ``step`` is what ``find_batch_size`` takes, with the model and optimizer built.

    device: as for ``holders()`` (the current GPU once torch has initialised CUDA, else ``'cpu'``).
    limit: also answer whether it fits when torch may allocate only this much ("24GiB").
    steps: calls of the step, when a second one is wanted because the first creates the
        optimizer's state.
    Returns an ``Estimate``: ``.peak`` in bytes, ``.categories`` (what was live at the peak),
    whether it fits, a table, ``to_dict()``. Raises ``NoEstimate``, naming the operator, when
    the step can't run under fake tensors: no estimate is made then.
    """
    experiment.count(batch_size, "batch_size", "estimate(train_step, 64)")
    experiment.count(steps, "steps", "estimate(train_step, 64, steps=2)")
    limit = experiment.size(limit, "limit")
    return _core.estimate(step, batch_size, memory=_holder_memory(device), limit=limit, steps=steps)


def estimating():
    """True while gpuexp runs a step on fake tensors on this thread (``estimate``, ``fit``'s
    options, ``find_batch_size``'s first guesses), else False. A step's tensors have no values
    then: a step that branches on one (``if loss.item() > 10:``) can skip that part, e.g.
    ``if not gpuexp.estimating(): ...``. Reading one only to return it, keep it or print it needs
    no such care (docs/estimate.md)."""
    return _core.estimating()


def _holder_memory(device):
    """A torch index for a GPU, None for the host."""
    if device is None:
        return _core.default_device()
    if isinstance(device, str) and device.strip().lower() in ("cpu", "host"):
        return None
    indices = device_indices(device, argument="device")
    if len(indices) != 1:
        raise ValueError(f"holders(device={device!r}): name one device, e.g. device=0, 'cuda:1' or 'cpu'")
    return indices[0]


def cells():
    """Every cell record of this kernel's cell log, oldest first (``CellRecord`` list)."""
    return _core.cells()


def compare(experiments=None):
    """Finished experiments side by side: name, params, duration, the peak of each layer, what
    was consumed, the share reclaimed and out-of-memory errors.

    experiments: reports or experiments (an open one shows its figures so far); by default this
        kernel's history. Params come from ``GPUExperiment(..., params={"bs": 64})`` or from
        names such as ``"bs=64,lr=3e-4"``.

    The result shows as a table (text and HTML); ``to_dict()`` is ``{"rows": [...]}`` with each
    report's figures in its own JSON shape; ``to_pandas()`` gives one row per experiment;
    ``plot(x=None)`` draws each layer's peak against a numeric param, with the device's total,
    the limit and a fit that extrapolates the largest value that fits.
    """
    if experiments is None:
        return _core.compare(None)
    if isinstance(experiments, (Report, GPUExperiment)):
        experiments = [experiments]
    if isinstance(experiments, dict):
        raise TypeError(
            "compare() takes a list of reports or experiments, not a dict: "
            "gpuexp.compare(list(runs.values())) compares the dict's values"
        )
    if isinstance(experiments, (str, bytes)) or not hasattr(experiments, "__iter__"):
        raise TypeError(
            "compare() takes a list of reports (gpuexp.history(), exp.finish()) or experiments, "
            f"e.g. gpuexp.compare([exp1, exp2]); got {experiments!r}"
        )
    reports = []
    for item in experiments:
        if isinstance(item, GPUExperiment):
            item = item.data
        if not isinstance(item, Report):
            raise TypeError(
                "compare() takes reports (gpuexp.history(), exp.finish()) or experiments, "
                f"e.g. gpuexp.compare([exp1, exp2]); got {type(item).__name__}"
            )
        reports.append(item)
    return _core.compare(reports)


def config(*, sample_interval_ms=None, cell_log_all_gpus=None, oom_rescue=None, cell_log_min_change=None,
           live_view_after_s="unchanged", trace=None, flight_recorder=None, trace_sampling=None):
    """Changes settings and returns them all as a dict.

    sample_interval_ms: how often the native sampler reads NVML (and host RSS where the
        kernel's peak can't be reset), default 1 ms, between 0.1 ms and 60 s.
    cell_log_all_gpus: show every GPU in the cell log, not only those a cell touched.
    oom_rescue: after a CUDA out-of-memory error, clear the failed cell's frames and free its
        memory (default True). Turn it off to inspect the frames with %debug.
    cell_log_min_change: a cell's memory block shows only when a figure's Δ or its peak above
        start reaches this ("1MiB" by default; a size string or bytes). ``%gpuexp log all``
        shows every cell's.
    live_view_after_s: a cell running longer than this shows its memory live (2.0 by default);
        None or False: no live view. Its default, "unchanged", leaves it as it is (None would
        turn the view off, so None can't be the default as for the other settings).
    trace: every experiment records where in the code it allocates, as
        ``GPUExperiment(..., trace=...)`` does: True or "cuda" (torch's CUDA allocations), "host"
        (Python's, through tracemalloc; CPU experiments too), "all" (both), False (default).
        With the CUDA part on, the cell log names the line behind a cell's torch peak
        ("cuda:0 peak +2.10 GiB, 71% at In [9], line 14").
    flight_recorder: while gpuexp is active (an experiment open, or the cell log on) and torch
        has CUDA initialised, keep torch's allocation history on without stacks, so that an
        out-of-memory error shows what grew since the last completed step and what was live
        (default True; see docs/oom-rescue.md). False stops it now.
    trace_sampling: with the CUDA trace on, record Python stacks and module paths on sampled
        training steps only (the first after an experiment's opening, then one step in N, N
        chosen so that they cost about 1% of the run) and map the other steps' blocks to a
        sampled step's sites (default True; the peak stays exact to the byte, the report says
        how much was mapped). False: stacks on every step, from the next traced experiment on.
    The dict also has ``host_peak``, read-only: ``"exact"`` where the kernel's peak RSS can be
    reset (Linux's ``/proc/self/clear_refs``), ``"sampled"`` where the sampler thread stands in.
    """
    for name, flag in (("cell_log_all_gpus", cell_log_all_gpus), ("oom_rescue", oom_rescue),
                       ("flight_recorder", flight_recorder), ("trace_sampling", trace_sampling)):
        if flag is not None and not isinstance(flag, bool):
            raise TypeError(f"{name} is True or False, e.g. gpuexp.config({name}=True); got {flag!r}")
    if sample_interval_ms is not None and (
        isinstance(sample_interval_ms, bool) or not isinstance(sample_interval_ms, (int, float))
    ):
        raise TypeError(
            "sample_interval_ms must be a number of milliseconds, e.g. gpuexp.config(sample_interval_ms=1); "
            f"got {sample_interval_ms!r}"
        )
    if cell_log_min_change is not None:
        cell_log_min_change = experiment.size(cell_log_min_change, "cell_log_min_change", zero=True)
    if isinstance(live_view_after_s, str) and live_view_after_s == "unchanged":
        live_view_after_s = None
    elif live_view_after_s is None or live_view_after_s is False:
        live_view_after_s = False  # the core reads False as off, None as unchanged
    elif isinstance(live_view_after_s, bool) or not isinstance(live_view_after_s, (int, float)):
        raise TypeError(
            "live_view_after_s must be a number of seconds, e.g. gpuexp.config(live_view_after_s=2), "
            f"or None to turn the live view off; got {live_view_after_s!r}"
        )
    return _core.config(
        sample_interval_ms=sample_interval_ms, cell_log_all_gpus=cell_log_all_gpus, oom_rescue=oom_rescue,
        cell_log_min_change=cell_log_min_change, live_view_after_s=live_view_after_s, trace=trace,
        flight_recorder=flight_recorder, trace_sampling=trace_sampling,
    )


def load_snapshot(path):
    """Reads any torch memory snapshot (``torch.cuda.memory._dump_snapshot``, a cluster job's OOM
    dump, memory_viz's and Mosaic's files) and replays it: the same peak by source line, diff and
    timeline as ``GPUExperiment(..., trace=True)`` gives. The pickle is read without running any
    code from it. Returns a ``Trace``."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"load_snapshot takes a file's path, e.g. load_snapshot('snapshot.pickle'); got {path!r}")
    return _core.load_snapshot(path)


def load_ipython_extension(ip):
    """``%load_ext gpuexp``: the cell events (``del exp``, the cell log) and the ``%gpuexp`` magics."""
    extension.register(ip)


def unload_ipython_extension(ip):
    """``%unload_ext gpuexp``: no more cell events or ``%gpuexp`` magics, and the cell log off.
    Open experiments stay open: finish them with ``exp.finish()``."""
    extension.unregister(ip)


# The sampler thread is joined before the interpreter goes (a kernel shutting down or restarting).
atexit.register(_core.shutdown)
# In a notebook, importing gpuexp is enough for `%gpuexp` and for noticing `del exp`.
extension.register(ipython.shell())
