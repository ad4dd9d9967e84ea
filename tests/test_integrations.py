"""The Lightning and HF Trainer callbacks in real kernels, on the CPU with tiny models: peaks
logged through the trainer's logger, params from the run's configuration, the report in
history, nothing deleted, and an OOM named with its epoch, step and batch."""

import pytest

pytest.importorskip("pytorch_lightning")  # `lightning` too where it is installed: the tests use it first
pytest.importorskip("transformers")

OOM = 'torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")'

LIGHTNING = f"""
import gpuexp, torch
try:
    import lightning.pytorch as L
except ImportError:  # the GPU machine has only pytorch_lightning
    import pytorch_lightning as L
from gpuexp.integrations.lightning import GPUExperimentCallback

class Tiny(L.LightningModule):
    def __init__(self, fail_at=None):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.fail_at = fail_at

    def training_step(self, batch, batch_idx):
        if self.fail_at == (self.current_epoch, batch_idx):
            raise {OOM}
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
loader = torch.utils.data.DataLoader(data, batch_size=16)

def fit(module, tmp, **callback):
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=L.loggers.CSVLogger(tmp),
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.callbacks.append(GPUExperimentCallback(**callback))
    trainer.fit(module, loader)
    return trainer
"""

TRANSFORMERS = """
import gpuexp, torch, transformers
from gpuexp.integrations.transformers import GPUExperimentCallback

config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
model = transformers.GPT2LMHeadModel(config)

class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        ids = torch.randint(0, 100, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}

def trainer_for(tmp, **callback):
    args = transformers.TrainingArguments(output_dir=tmp, per_device_train_batch_size=8, num_train_epochs=2,
                                          report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                                          logging_strategy="no")
    return transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                callbacks=[GPUExperimentCallback(**callback)])
"""

HOST = "gpuexp/host_rss_peak_mib"


def test_importing_gpuexp_imports_no_framework(kernel):
    kernel.run("import sys, gpuexp, gpuexp.integrations")
    assert kernel.value('[m for m in ("lightning", "pytorch_lightning", "transformers") if m in sys.modules]') == []


def test_lightning_logs_peaks_per_epoch_and_step_and_reports_its_run(kernel, tmp_path):
    kernel.run(LIGHTNING)
    kernel.run(f"trainer = fit(Tiny(), {str(tmp_path)!r}, every_n_steps=2)")
    logged = kernel.value("{k: float(v) for k, v in trainer.logged_metrics.items()}")
    # Torch, numpy and Lightning alone take far more than 50 MiB of RSS; a machine less than 1 TiB.
    assert 50 < logged[HOST] < (1 << 20), logged
    assert not any("torch_allocated" in k for k in logged), "no GPU: no GPU figures"
    rows = kernel.value("open(trainer.logger.log_dir + '/metrics.csv').read().splitlines()")
    header = rows[0].split(",")
    values = [dict(zip(header, row.split(","))) for row in rows[1:]]
    logged_rows = [row for row in values if row.get(HOST)]
    # 4 batches an epoch: every 2 batches (4 rows) and each epoch's end (2 rows).
    assert len(logged_rows) == 6, rows
    assert all(50 < float(row[HOST]) < (1 << 20) for row in logged_rows), rows
    report = kernel.value("gpuexp.history()[-1].to_dict()")
    assert report["params"] == {"model": "Tiny", "batch_size": 16, "grad_accum": 1, "precision": "32-true",
                                "grad_ckpt": False}, report["params"]
    assert report["finished"] and report["deleted"] == [] and report["rebound"] == [], report
    assert kernel.value("[n for n in ('trainer', 'loader', 'data', 'Tiny', 'fit') if n not in globals()]") == []
    compared = kernel.value("gpuexp.compare().to_dict()['rows'][-1]['params']")
    assert compared["batch_size"] == 16 and compared["precision"] == "32-true", compared


def test_a_lightning_oom_is_named_with_its_epoch_step_and_batch(kernel, tmp_path):
    kernel.run(LIGHTNING)
    kernel.run("module = Tiny(fail_at=(1, 2))")
    cell = kernel.run(f"trainer = fit(module, {str(tmp_path)!r})", expect_error=True)
    assert "OutOfMemoryError" in cell.error, cell
    # Epoch 1, its third batch: 4 optimizer steps in epoch 0 and 2 in epoch 1 came before.
    where = "epoch 1, step 6, batch [0] (16, 8) float32, [1] (16, 1) float32"
    assert f"raised in training at {where}" in cell.text, cell.text
    notes = kernel.value("gpuexp.history()[-1].notes")
    assert any("the run raised OutOfMemoryError" in n and where in n for n in notes), notes
    assert kernel.value("'module' in globals() and 'loader' in globals()")
    # An OOM outside any run is diagnosed without a training position: the run's went with its error.
    cell = kernel.run(f"raise {OOM}", expect_error=True)
    assert "· rescued" in cell.text and "raised in training" not in cell.text, cell.text


def test_the_callback_subclasses_the_lightning_already_imported(kernel, tmp_path):
    kernel.run("import sys, torch, pytorch_lightning as pl, gpuexp")
    kernel.run("from gpuexp.integrations.lightning import GPUExperimentCallback")
    assert kernel.value("issubclass(GPUExperimentCallback, pl.Callback) and 'lightning.pytorch' not in sys.modules")
    kernel.run(
        "class Tiny(pl.LightningModule):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.net = torch.nn.Linear(4, 1)\n"
        "    def training_step(self, batch, batch_idx):\n"
        "        return self.net(batch[0]).sum()\n"
        "    def configure_optimizers(self):\n"
        "        return torch.optim.SGD(self.parameters(), lr=0.1)\n"
        "loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)\n"
        "trainer = pl.Trainer(max_epochs=1, accelerator='cpu', logger=False, enable_progress_bar=False,\n"
        "                     enable_checkpointing=False, enable_model_summary=False,\n"
        "                     callbacks=[GPUExperimentCallback()])\n"
        "trainer.fit(Tiny(), loader)"
    )
    assert kernel.value("gpuexp.history()[-1].to_dict()['params']['batch_size']") == 4
    assert kernel.value(f"float(trainer.callback_metrics[{HOST!r}])") > 50


def test_hf_trainer_logs_peaks_through_its_log_and_reports_its_run(kernel, tmp_path):
    kernel.run(TRANSFORMERS)
    kernel.run(f"trainer = trainer_for({str(tmp_path)!r}, every_n_steps=2)\ntrainer.train()")
    entries = kernel.value(f"[e for e in trainer.state.log_history if {HOST!r} in e]")
    # 4 optimizer steps an epoch: every 2 steps (4 entries) and each epoch's end (2 entries).
    assert len(entries) == 6, entries
    assert all(50 < e[HOST] < (1 << 20) and "epoch" in e for e in entries), entries
    report = kernel.value("gpuexp.history()[-1].to_dict()")
    assert report["params"] == {"model": "GPT2LMHeadModel", "batch_size": 8, "grad_accum": 1, "precision": "fp32",
                                "grad_ckpt": False}, report["params"]
    assert report["finished"] and report["deleted"] == [] and report["rebound"] == [], report
    assert kernel.value("[n for n in ('trainer', 'model', 'config', 'Tokens') if n not in globals()]") == []
    assert kernel.value("len(model._forward_pre_hooks)") == 0, "the callback's hook went with the run"


def test_an_hf_oom_is_named_with_its_epoch_step_and_batch(kernel, tmp_path):
    kernel.run(TRANSFORMERS)
    kernel.run(
        "calls = []\n"
        "def fail_on_third(module, args, output):\n"
        "    calls.append(1)\n"
        f"    if len(calls) == 3:\n        raise {OOM}\n"
        "failing = model.register_forward_hook(fail_on_third)\n"
        f"trainer = trainer_for({str(tmp_path)!r})"
    )
    cell = kernel.run("trainer.train()", expect_error=True)
    assert "OutOfMemoryError" in cell.error, cell
    assert "raised in training at epoch 0, step 2, batch " in cell.text, cell.text
    assert "input_ids (8, 16) int64" in cell.text and "labels (8, 16) int64" in cell.text, cell.text
    report = kernel.value("gpuexp.history()[-1].to_dict()")
    assert any("the run raised OutOfMemoryError" in n and "input_ids (8, 16)" in n for n in report["notes"]), report
    assert report["finished"] and report["deleted"] == [], report
    # The next run starts afresh, the failed one's hook gone.
    kernel.run("failing.remove()\ntrainer.train()")
    assert kernel.value("len(model._forward_pre_hooks)") == 0
    assert kernel.value("[r.name for r in gpuexp.history()][-2:]") == [report["name"]] * 2


def test_bad_callback_arguments_name_the_fix(kernel):
    kernel.run("from gpuexp.integrations.transformers import GPUExperimentCallback")
    cell = kernel.run("GPUExperimentCallback(every_n_steps=0)", expect_error=True)
    assert "every_n_steps must be a positive int" in cell.error
    cell = kernel.run("GPUExperimentCallback(delete=True)", expect_error=True)
    assert "drop delete= and params=" in cell.error
    cell = kernel.run("GPUExperimentCallback(limt='1GiB')", expect_error=True)
    assert "limt" in cell.error


def test_a_callbacks_bad_values_are_refused_when_it_is_made_not_when_fit_starts(kernel):
    kernel.run("from gpuexp.integrations.transformers import GPUExperimentCallback")
    cell = kernel.run("GPUExperimentCallback(limit='abc')", expect_error=True)
    assert cell.error.startswith("ValueError: limit='abc'") and '"24GiB"' in cell.error, cell.error
    cell = kernel.run("GPUExperimentCallback(name=5)", expect_error=True)
    assert cell.error == "TypeError: name must be a string such as 'bs=64', got int", cell.error
    cell = kernel.run("GPUExperimentCallback(monitor='often')", expect_error=True)
    assert cell.error.startswith("ValueError") and "often" in cell.error, cell.error
    kernel.run("GPUExperimentCallback(name='ok', limit='1GiB', monitor='50ms')")
