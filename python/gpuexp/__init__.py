"""gpuexp: memory experiments for GPU notebooks.

``exp = GPUExperiment("bs=64")`` ... ``del exp`` gives back every byte the experiment took
and shows what it consumed, reclaimed and peaked at: host RSS, NVML (device and this
process) and torch's allocator.
"""

from . import _core, ipython
from ._core import GpuReport, HostReport, Metric, Report, Snapshot
from .experiment import CPUExperiment, GPUExperiment

__version__ = "0.1.0"

__all__ = [
    "CPUExperiment",
    "GPUExperiment",
    "GpuReport",
    "HostReport",
    "Metric",
    "Report",
    "Snapshot",
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


def load_ipython_extension(ip):
    """``%load_ext gpuexp``: listens to cell events so that ``del exp`` is noticed."""
    ipython.register(ip)
