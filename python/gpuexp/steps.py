"""Step ends, for the OOM diagnosis and for a traced experiment's sampled stacks: while the
flight recorder is on and gpuexp active, or a traced experiment is open, torch's global
optimizer step hook marks each completed ``optimizer.step()`` in the core. What grew since the
latest one is read after an out-of-memory error, and the sampler switches the stacks on or off
for the next step. Installed only while one of them needs it and torch is already imported
(never imported here)."""

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
    """Removes the hook: none outlives gpuexp's active state or the last traced experiment."""
    global _handle
    if _handle is not None:
        _handle.remove()
        _handle = None
