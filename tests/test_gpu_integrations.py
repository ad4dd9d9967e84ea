"""The Lightning and HF Trainer callbacks on a GPU: torch's and NVML's peaks logged per epoch,
and a real CUDA out-of-memory error named with its epoch, step and batch."""

import pytest

pytest.importorskip("pytorch_lightning")
pytest.importorskip("transformers")

from test_integrations import HOST, LIGHTNING, TRANSFORMERS  # noqa: E402 (after the skips)

pytestmark = pytest.mark.gpu

# One GPU, as a batch-size run has: HF Trainer would spread a batch over every visible GPU.
ONE_GPU = {"CUDA_VISIBLE_DEVICES": "0"}

GPU_FIGURES = ("gpuexp/torch_allocated_peak_mib", "gpuexp/torch_reserved_peak_mib", "gpuexp/nvml_process_peak_mib")

# A step that asks for a terabyte per sample: a real CUDA OOM, from the batch it was given.
TOO_MUCH = "torch.empty(batch[0].shape[0] << 40, dtype=torch.uint8, device='cuda')"


def test_lightning_logs_torch_and_nvml_peaks_on_the_gpu(make_kernel, tmp_path):
    kernel = make_kernel(**ONE_GPU)
    kernel.run(LIGHTNING.replace('accelerator="cpu"', 'accelerator="gpu", devices=1'))
    kernel.run(f"trainer = fit(Tiny(), {str(tmp_path)!r})")
    logged = kernel.value("{k: float(v) for k, v in trainer.logged_metrics.items()}")
    assert all(logged.get(name, 0) > 0 for name in GPU_FIGURES), logged
    # What the model and its batches hold is under what torch reserved, itself under the process's figure.
    assert logged[GPU_FIGURES[0]] <= logged[GPU_FIGURES[1]] <= logged[GPU_FIGURES[2]], logged
    assert logged[HOST] > 50, logged
    report = kernel.value("gpuexp.history()[-1].to_dict()")
    assert report["gpus"] and report["gpus"][0]["torch_allocated"]["peak"] > 0, report


def test_a_real_lightning_oom_is_named_with_its_batch(make_kernel, tmp_path):
    kernel = make_kernel(**ONE_GPU)
    kernel.run(LIGHTNING.replace('accelerator="cpu"', 'accelerator="gpu", devices=1'))
    kernel.run(
        "class Greedy(Tiny):\n"
        "    def training_step(self, batch, batch_idx):\n"
        "        if self.current_epoch == 1 and batch_idx == 1:\n"
        f"            {TOO_MUCH}\n"
        "        return super().training_step(batch, batch_idx)"
    )
    cell = kernel.run(f"trainer = fit(Greedy(), {str(tmp_path)!r})", expect_error=True)
    assert "OutOfMemoryError" in cell.error, cell
    assert "CUDA out of memory on cuda:0 · rescued" in cell.text, cell.text
    assert "raised in training at epoch 1, step 5, batch [0] (16, 8) float32, [1] (16, 1) float32" in cell.text
    explains_itself(cell.text)


def explains_itself(text):
    """The rescue's diagnosis under a trainer: the failed line, what grew since the last step, what was live."""
    diagnosis = text.split("rescued")[1]
    failed_at = next(line for line in diagnosis.splitlines() if "failed at" in line)
    assert TOO_MUCH in failed_at, diagnosis
    since = diagnosis.split("since the last completed")[1].splitlines()[0]
    assert "unknown" not in since, diagnosis
    assert "live then" in diagnosis, diagnosis
    assert "may fit" not in diagnosis, diagnosis


def test_hf_trainer_logs_torch_and_nvml_peaks_and_a_real_oom_names_its_batch(make_kernel, tmp_path):
    kernel = make_kernel(**ONE_GPU)
    kernel.run(TRANSFORMERS.replace("use_cpu=True", "use_cpu=False"))
    kernel.run(f"trainer = trainer_for({str(tmp_path)!r})\ntrainer.train()")
    entries = kernel.value(f"[e for e in trainer.state.log_history if {HOST!r} in e]")
    assert len(entries) == 2 and all(all(e.get(name, 0) > 0 for name in GPU_FIGURES) for e in entries), entries
    kernel.run(
        "calls = []\n"
        "def greedy(module, args, kwargs):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 3:\n"
        "        batch = [kwargs['input_ids']]\n"
        f"        {TOO_MUCH}\n"
        "failing = model.register_forward_pre_hook(greedy, with_kwargs=True)\n"
        f"trainer = trainer_for({str(tmp_path)!r})"
    )
    cell = kernel.run("trainer.train()", expect_error=True)
    assert "CUDA out of memory on cuda:0 · rescued" in cell.text, cell.text
    # The callback's own hook came later than this one: the batch it read is the step before's, of the same shape.
    assert "raised in training at epoch 0, step 2, batch " in cell.text and "input_ids (8, 16) int64" in cell.text
    explains_itself(cell.text)
