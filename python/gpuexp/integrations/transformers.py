"""``GPUExperimentCallback`` for HF Trainer::

    from gpuexp.integrations.transformers import GPUExperimentCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[GPUExperimentCallback()])

Importing this module imports ``transformers``.
"""

import sys

from transformers import Trainer, TrainerCallback

from .run import TrainingRun, checkpointing, settle


class GPUExperimentCallback(TrainerCallback):
    """Measures each ``trainer.train()`` in a gpuexp experiment that deletes nothing; logs each
    epoch's memory peaks through ``trainer.log`` (so every logger and ``state.log_history`` get
    them); names the epoch, the step and the batch's shapes when the run runs out of memory.

    name: the experiment's name; by default the model's class and the run's params.
    every_n_steps: also log the peaks every N optimizer steps, not only per epoch.
    experiment: ``GPUExperiment`` keywords (``limit="24GiB"``, ``monitor=True``, ``devices``...).
    """

    def __init__(self, name=None, *, every_n_steps=None, **experiment):
        settle(self, name, every_n_steps, experiment)
        self._trainer = None
        self._hook = None
        self._pending = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._release()
        if self.run is not None and self.run.is_open:  # a run that ended without its hooks
            self.run.end()
        self._trainer = _calling_trainer()
        self.run = TrainingRun(self.name, _params(args, model), self.experiment)
        if model is not None:
            # The Trainer's callbacks never see a batch: the model's inputs are read as it takes them.
            self._hook = model.register_forward_pre_hook(self._take_batch, with_kwargs=True)

    def on_epoch_begin(self, args, state, control, **kwargs):
        if self.run is not None:
            self.run.at(state.epoch or 0, state.global_step)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.run is not None:
            self.run.at(state.epoch or 0, state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if self.run is not None and self.every_n_steps and state.global_step % self.every_n_steps == 0:
            self._log(self.run.peaks("steps"))

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.run is not None:
            self._log(self.run.peaks())

    def on_log(self, args, state, control, logs=None, **kwargs):
        # Without the trainer, the peaks ride on the trainer's next log.
        if self._pending and logs is not None:
            logs.update(self._pending)
            self._pending = {}

    def on_train_end(self, args, state, control, **kwargs):
        self._release()
        if self.run is not None and self.run.is_open:
            self.run.end()

    def _log(self, peaks):
        if self._trainer is not None:
            self._trainer.log(dict(peaks))
        else:
            self._pending.update(peaks)

    def _take_batch(self, module, inputs, kwargs):
        run = self.run
        if run is None or not run.is_open:  # the run ended by an error: nothing more to read
            self._release()
            return
        run.batch(kwargs if not inputs else (inputs if not kwargs else (inputs, kwargs)))

    def _release(self):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _params(args, model):
    """The run's configuration, as ``gpuexp.compare()`` lines runs up by it."""
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    params = {"model": type(model).__name__} if model is not None else {}
    params.update(
        batch_size=int(args.per_device_train_batch_size),
        grad_accum=int(args.gradient_accumulation_steps),
        precision=precision,
        grad_ckpt=bool(args.gradient_checkpointing) or (model is not None and checkpointing(model)),
    )
    return params


def _calling_trainer():
    """The Trainer whose callback handler called this hook (a few frames up), so that the peaks
    go through ``trainer.log``; the callback API passes no trainer."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None
