"""Everything a real training step changes, copied to host memory and put back bit for bit.

``verify`` runs the user's step for real, which moves the parameters, the gradients, the
optimizer's state and step counters, a GradScaler's scale and the RNG. ``capture`` copies all of
it first; ``SavedState.restore`` puts the values back into the very objects that held them
(identity, storage and autograd's version counters as before), so that the notebook goes on as
if the step had never run. What could not be put back is named, and its saved value kept.

The saving is the core's one state saving (rust/src/step_state.rs, ``save_by_value``), the same
walk ``estimate`` and ``fit`` use, by value here: it walks the containers and puts them back;
``tensor_values`` copies each tensor it reaches.
"""

import sys

from . import _core


class RestoreFailed(RuntimeError):
    """Some state could not be put back. ``failed`` names each piece and why; ``saved`` maps the
    name of each piece not put back to its value before (a tensor on the host, or a container's
    items), so nothing is lost."""

    def __init__(self, failed, saved):
        self.failed = failed
        """Each piece not put back, with the error that stopped it."""
        self.saved = saved
        """The value before of each piece not put back, by name."""
        listed = "; ".join(failed)
        super().__init__(
            f"verify could not put back {len(failed)} piece(s) of state as it was before the step: {listed}. "
            "Everything else was restored. The values before are in this error's .saved (host copies, by name): "
            "copy them back (tensor.data.copy_(error.saved[name])) before training on."
        )


class SavedState:
    """What ``capture`` copied; ``restore()`` puts it back (once)."""

    def __init__(self, saved):
        self._saved = saved  # the core's `SavedStep`
        self._restored = False

    def restore(self):
        """Puts every value back into the object that held it. Raises ``RestoreFailed`` naming
        what could not be put back; everything else is restored all the same."""
        if self._restored:
            return
        self._restored = True
        failed, kept = self._saved.restore()
        if failed:
            raise RestoreFailed(failed, kept)


def capture(modules=(), optimizers=(), scalers=(), objects=()):
    """Copies to host memory all a step can change in these objects, for ``restore()``.

    modules: ``nn.Module`` s: their parameters, gradients, buffers and every submodule's
        ``training`` flag. optimizers: their state (step counters too), ``param_groups`` and
        attributes. scalers: GradScalers (their scale, growth tracker and per-optimizer state).
        objects: anything else the step changes through its attributes (an LR scheduler, an EMA).
    Each is a dict of name to object (the names appear in messages) or a list. Every container
    reachable from them is saved (by the identity of what it holds) and every tensor in them (by
    value). The CPU RNG, every initialised CUDA device's RNG, Python's ``random`` and NumPy's
    global RNG are saved too.

    A leaf tensor's gradient is handed to a stand-in tensor (the same storage) until ``restore``:
    the step sees the same values, and frees them if it drops them, as it would without this.
    """
    imported_torch("capture")
    return SavedState(_core.save_step(modules, optimizers, scalers, objects))


def imported_torch(what):
    """The torch the user imported: gpuexp never imports it (nor creates a CUDA context) itself."""
    torch = sys.modules.get("torch")
    if torch is None:
        raise RuntimeError(f"{what} works on the user's torch objects: import torch and build the model first")
    return torch
