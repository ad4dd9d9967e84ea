"""gpuexp: memory experiments for GPU notebooks.

``exp = GPUExperiment("bs=64")`` ... ``del exp`` gives back every byte the experiment took
and shows what it consumed, reclaimed and peaked at: host RSS, NVML (device and this
process) and torch's allocator.
"""

import atexit

from . import _core, ipython
from ._core import CellRecord, GpuReport, HostReport, Metric, Report, Snapshot
from .experiment import CPUExperiment, GPUExperiment

__version__ = "0.1.0"

__all__ = [
    "CellRecord",
    "CPUExperiment",
    "GPUExperiment",
    "GpuReport",
    "HostReport",
    "Metric",
    "Report",
    "Snapshot",
    "cells",
    "config",
    "history",
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
    """Writes this kernel's finished reports to ``path`` as a JSON list; returns the path."""
    with open(path, "w", encoding="utf-8") as out:
        out.write(_core.history_json())
        out.write("\n")
    return path


def cells():
    """Every cell record of this kernel's cell log, oldest first (``CellRecord`` list)."""
    return _core.cells()


def config(*, sample_interval_ms=None, cell_log_all_gpus=None, oom_rescue=None):
    """Changes settings and returns them all as a dict.

    sample_interval_ms: how often the native sampler reads NVML (and host RSS where the
        kernel's peak can't be reset), default 1 ms, between 0.1 ms and 60 s.
    cell_log_all_gpus: show every GPU in the cell log, not only those a cell touched.
    oom_rescue: after a CUDA out-of-memory error, clear the failed cell's frames and free its
        memory (default True). Turn it off to inspect the frames with %debug.
    """
    if sample_interval_ms is not None and (isinstance(sample_interval_ms, bool) or not isinstance(sample_interval_ms, (int, float))):
        raise TypeError(f"sample_interval_ms must be a number of milliseconds, e.g. gpuexp.config(sample_interval_ms=1); got {sample_interval_ms!r}")
    return _core.config(sample_interval_ms=sample_interval_ms, cell_log_all_gpus=cell_log_all_gpus, oom_rescue=oom_rescue)


def load_ipython_extension(ip):
    """``%load_ext gpuexp``: the cell events (``del exp``, the cell log) and the ``%gpuexp`` magics."""
    ipython.register(ip)


# The sampler thread is joined before the interpreter goes (a kernel shutting down or restarting).
atexit.register(_core.shutdown)
# In a notebook, importing gpuexp is enough for `%gpuexp` and for noticing `del exp`.
ipython.register(ipython.shell())
