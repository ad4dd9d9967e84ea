"""``GPUExperimentCallback`` for Lightning (``lightning.pytorch`` or ``pytorch_lightning``)::

    from gpuexp.integrations.lightning import GPUExperimentCallback
    trainer = L.Trainer(max_epochs=2, callbacks=[GPUExperimentCallback()])

It subclasses the ``Callback`` of the Lightning the process already imported (``lightning``
first when both or neither are): import your Lightning before this name.
"""

import sys

from .run import TrainingRun, checkpointing, settle


class _Hooks:
    """The callback's hooks, over whichever Lightning's ``Callback`` the class is made with.

    name: the experiment's name; by default the module's class and the run's params.
    every_n_steps: also log the peaks every N training batches, not only per epoch.
    experiment: ``GPUExperiment`` keywords (``limit="24GiB"``, ``monitor=True``, ``devices``...).
    """

    def __init__(self, name=None, *, every_n_steps=None, **experiment):
        super().__init__()
        settle(self, name, every_n_steps, experiment)

    def on_train_start(self, trainer, pl_module):
        if self.run is not None and self.run.is_open:  # a run that ended without its hooks
            self.run.end()
        self.run = TrainingRun(self.name, _params(trainer, pl_module), self.experiment)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.run is not None:
            self.run.at(trainer.current_epoch, trainer.global_step)
            self.run.batch(batch)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if self.run is not None and self.run.is_open:
            self.run.batch(batch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.run is not None and self.every_n_steps and (batch_idx + 1) % self.every_n_steps == 0:
            # Straight to the loggers: through `self.log`, Lightning writes a step's value again
            # at later steps, and only at its own `log_every_n_steps`.
            peaks = self.run.peaks("steps")
            for logger in trainer.loggers:
                logger.log_metrics(peaks, step=trainer.global_step)

    def on_train_epoch_end(self, trainer, pl_module):
        if self.run is not None:
            pl_module.log_dict(self.run.peaks(), on_step=False, on_epoch=True, batch_size=1)

    def on_train_end(self, trainer, pl_module):
        if self.run is not None and self.run.is_open:
            self.run.end()

    def on_exception(self, trainer, pl_module, exception):
        if self.run is not None and self.run.is_open:
            self.run.end(exception)


def _params(trainer, pl_module):
    """The run's configuration, as ``gpuexp.compare()`` lines runs up by it."""
    params = {"model": type(pl_module).__name__}
    batch_size = _batch_size(trainer.train_dataloader)
    if batch_size is None:
        hparams = getattr(pl_module, "hparams", {})
        batch_size = hparams.get("batch_size") if hasattr(hparams, "get") else None
    if isinstance(batch_size, int):
        params["batch_size"] = batch_size
    params["grad_accum"] = int(trainer.accumulate_grad_batches)
    params["precision"] = str(trainer.precision)
    params["grad_ckpt"] = checkpointing(pl_module)
    return params


def _batch_size(loaders):
    """The batch size of the (first) training DataLoader, where it says."""
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    if isinstance(loaders, (list, tuple)):
        loaders = loaders[0] if loaders else None
    return getattr(loaders, "batch_size", None)


def _lightning():
    """The Lightning the process uses: the one imported, else the one installed."""
    if "pytorch_lightning" in sys.modules and "lightning.pytorch" not in sys.modules:
        import pytorch_lightning

        return pytorch_lightning
    try:
        import lightning.pytorch

        return lightning.pytorch
    except ImportError:
        try:
            import pytorch_lightning
        except ImportError:
            raise ImportError(
                "gpuexp.integrations.lightning needs Lightning: pip install lightning (or pytorch-lightning)"
            ) from None
        return pytorch_lightning


_classes = {}


def callback_class(lightning):
    """The callback class for one Lightning (``lightning.pytorch`` or ``pytorch_lightning``)."""
    if lightning.__name__ not in _classes:
        _classes[lightning.__name__] = type(
            "GPUExperimentCallback", (_Hooks, lightning.Callback), {"__module__": __name__, "__doc__": _Hooks.__doc__}
        )
    return _classes[lightning.__name__]


def __getattr__(name):
    if name == "GPUExperimentCallback":
        return callback_class(_lightning())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
