"""A training run measured for a framework's callback: its experiment, which deletes nothing
(the names belong to the caller), and the core's record of where the run stands."""

import inspect

from .. import _core
from ..experiment import GPUExperiment, check_name, count, size
from ..monitor import seconds


class _RunExperiment(GPUExperiment):
    """The run's experiment, which the callback owns: it never replaces the user's experiment of
    the same name (nor finishes one the user opens during the run), and the user's never finish it."""

    _tool = True


class TrainingRun:
    """One ``fit()`` or ``train()``: opened when training starts, finished when it ends."""

    def __init__(self, name, params, experiment_options):
        if name is None:  # the rest of the params show beside it in gpuexp.compare()
            batch = f"bs={params['batch_size']}" if "batch_size" in params else None
            name = " ".join(part for part in (params.get("model"), batch) if part) or None
        self.experiment = _RunExperiment(name, params=params, delete=False, **experiment_options)
        self.id = self.experiment._id
        _core.begin_run(self.id)

    @property
    def is_open(self):
        return _core.is_open(self.id)

    def at(self, epoch, step):
        """The run is at ``step`` (optimizer steps completed) of ``epoch``."""
        _core.run_step(self.id, int(epoch), int(step))

    def batch(self, batch):
        """The batch it is about to take: only its shapes are kept."""
        _core.run_batch(self.id, batch)

    def peaks(self, every="epoch"):
        """The peaks in MiB by metric name of the epoch (``"epoch"``) or of the steps since the
        last step-level log (``"steps"``); the next interval of that kind starts now."""
        return _core.run_peaks(self.id, every)

    def end(self, error=None):
        """Finishes the experiment (its report goes to ``gpuexp.history()``); with ``error``, the
        report says where the run stood when it raised."""
        if error is not None and self.is_open:
            _core.note_run_error(self.id, error)
        return self.experiment.finish()


def checkpointing(model):
    """Whether gradient checkpointing is on anywhere in ``model`` (HF's modules flag it so)."""
    flag = getattr(model, "is_gradient_checkpointing", None)
    if isinstance(flag, bool):
        return flag
    modules = getattr(model, "modules", None)
    return callable(modules) and any(getattr(m, "gradient_checkpointing", False) is True for m in modules())


def settle(callback, name, every_n_steps, experiment):
    """What both callbacks take, checked when the callback is made: the run's name, how often to
    log between epochs, and the ``GPUExperiment`` keywords; no run is open yet."""
    if every_n_steps is not None:
        count(every_n_steps, "every_n_steps", "every_n_steps=50")
    check_name(name)
    callback.name = name
    callback.every_n_steps = every_n_steps
    callback.experiment = experiment_options(experiment)
    callback.run = None


def experiment_options(options):
    """The ``GPUExperiment`` keywords a callback passes through (``limit``, ``monitor``,
    ``devices``, ``cell_log``...), checked when the callback is made rather than when training starts."""
    if "delete" in options or "params" in options:
        raise TypeError("a callback's experiment deletes nothing and takes its params from the run: "
                        "drop delete= and params= (name= sets its name)")
    inspect.signature(GPUExperiment.__init__).bind(None, **options)  # a TypeError names the bad keyword
    # The values the experiment reads without a device, read now as it will read them.
    size(options.get("limit"), "limit")
    if options.get("monitor") not in (None, True, False):
        seconds(options["monitor"])
    return options
