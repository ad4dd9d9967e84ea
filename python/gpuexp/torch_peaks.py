"""Torch has one peak counter per device, shared by the cell log and every open experiment:
a user's reset must first hand the peaks seen so far to gpuexp."""

import sys

from . import _core


def watch_torch_peak_resets():
    """Wraps ``torch.cuda.reset_peak_memory_stats`` once torch is imported (never importing it),
    so that a user's reset first folds the peaks seen so far into the open windows."""
    torch = sys.modules.get("torch")
    memory = getattr(getattr(torch, "cuda", None), "memory", None)
    original = getattr(memory, "reset_peak_memory_stats", None)
    if original is None or hasattr(original, "__gpuexp_wrapped__"):
        return

    def reset_peak_memory_stats(device=None):
        _core.before_user_peak_reset()
        return original(device)

    reset_peak_memory_stats.__doc__ = original.__doc__
    reset_peak_memory_stats.__gpuexp_wrapped__ = original
    # torch.cuda re-exports the function, and reset_max_memory_allocated calls it through the module.
    memory.reset_peak_memory_stats = reset_peak_memory_stats
    torch.cuda.reset_peak_memory_stats = reset_peak_memory_stats
