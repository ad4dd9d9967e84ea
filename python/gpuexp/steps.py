"""Step ends for the OOM diagnosis: while the flight recorder holds its share of torch's
allocation history, torch's global optimizer step hook marks each completed ``optimizer.step()``
in the core (a time, no memory read), and what grew since the latest one is read from the
history after an out-of-memory error. Installed only while gpuexp is active and torch is
already imported (never imported here)."""

import sys

from . import _core

_handle = None


def _step_ended(optimizer, args, kwargs):
    _core.mark_step("optimizer step")


def install():
    """Registers the hook once, where torch's optimizers are imported."""
    global _handle
    optimizer = sys.modules.get("torch.optim.optimizer")
    register = getattr(optimizer, "register_optimizer_step_post_hook", None)
    if _handle is None and register is not None:
        _handle = register(_step_ended)


def uninstall():
    """Removes the hook: none outlives gpuexp's active state."""
    global _handle
    if _handle is not None:
        _handle.remove()
        _handle = None
