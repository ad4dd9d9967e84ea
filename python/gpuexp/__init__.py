"""gpuexp: memory experiments for GPU notebooks.

``exp = GPUExperiment("bs=64")`` ... ``del exp`` gives back every byte the experiment took
and shows what it consumed, reclaimed and peaked at: host RSS, NVML (device and this
process) and torch's allocator.
"""

import atexit
import sys

from . import _core, ipython
from ._core import CellRecord, GpuReport, HostReport, Metric, NvmlUnavailable, Report, Snapshot
from .experiment import CPUExperiment, GPUExperiment, _device_indices, find_batch_size
from .monitor import Monitor

__version__ = "0.1.0"

__all__ = [
    "CellRecord",
    "CPUExperiment",
    "GPUExperiment",
    "GpuReport",
    "HostReport",
    "Metric",
    "Monitor",
    "NvmlUnavailable",
    "Report",
    "Snapshot",
    "cells",
    "config",
    "find_batch_size",
    "holders",
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


def holders(device=None, min_bytes=1 << 20):
    """What still holds memory, largest first, each with the path a person would write to reach
    it: ``cache[0]``, ``Out[12]``, ``model.encoder.layers.3.weight``, ``opt.state[...]['exp_avg']``,
    a closure cell, a module global ``mymod.CACHE``, a frame of the stored traceback.

    device: a GPU (``0``, ``'cuda:1'``, a ``torch.device``) or ``'cpu'`` for host memory (CPU
        tensors and numpy arrays). By default, torch's current GPU once CUDA is initialised,
        else the host. Each storage counts once, however many tensors view it.
    min_bytes: the smallest holder worth listing (1 MiB).

    Also shows what no reachable Python object accounts for: tensors only C++ holds, memory
    torch allocated with no Python tensor (saved for backward, CUDA graphs, workspaces) and its
    reserved-but-unallocated cache. Keeps no reference to anything it found.
    """
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
        raise ValueError(f"min_bytes must be a number of bytes, e.g. holders(min_bytes=1 << 20); got {min_bytes!r}")
    adapter = ipython.namespace_for(sys._getframe(1))
    return _core.holders(_holder_memory(device), min_bytes, adapter=adapter)


def _holder_memory(device):
    """A torch index for a GPU, None for the host."""
    if device is None:
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        return cuda.current_device() if cuda is not None and cuda.is_initialized() else None
    if isinstance(device, str) and device.strip().lower() in ("cpu", "host"):
        return None
    indices = _device_indices(device)
    if len(indices) != 1:
        raise ValueError(f"holders(device={device!r}): name one device, e.g. device=0, 'cuda:1' or 'cpu'")
    return indices[0]


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
