"""Memory that creeps under the Lightning and HF Trainer callbacks (issue 39, section 5), on a
GPU under a 4 GiB cap: a training step that keeps a 4 MiB tensor "for metrics later" runs until
torch raises, and the rescue calls it a creep over the trainer's steps, names the list, and
gives no batch hint. The trainer's step is the iteration (the optimizer step inside it is not
counted again), so the amount per iteration is what one step keeps."""

import pytest

pytest.importorskip("pytorch_lightning")
pytest.importorskip("transformers")

from test_gpu_integrations import ONE_GPU  # noqa: E402 (after the skips)
from test_gpu_oom_creep import LAST_OOM, assert_step_hints_absent  # noqa: E402
from test_integrations import LIGHTNING, TRANSFORMERS  # noqa: E402

pytestmark = pytest.mark.gpu

CAP = """\
import time
torch.ones(1, device="cuda")
torch.cuda.set_per_process_memory_fraction((4 << 30) / torch.cuda.get_device_properties(0).total_memory)
kept = []
"""
EACH = 4 << 20


def assert_a_creep_naming_kept(kernel, cell):
    assert "OutOfMemoryError" in cell.error and "rescued" in cell.text, cell.text
    found = kernel.value(LAST_OOM)
    assert found["cause"] == "creep", cell.text
    creep = found["creep"]
    assert creep["over"] == "steps", creep
    assert abs(creep["per_iteration"] - EACH) <= EACH / 10, creep
    hints = "\n".join(found["hints"])
    assert "kept (a list of" in hints and ".detach()" in hints, hints
    assert_step_hints_absent(found["hints"])
    assert kernel.value("len(kept) > 500"), "the rescue deletes no holder"


def test_a_lightning_step_that_keeps_a_tensor_creeps_and_names_the_list(make_kernel, tmp_path):
    kernel = make_kernel(**ONE_GPU)
    kernel.run(LIGHTNING.replace('accelerator="cpu"', 'accelerator="gpu", devices=1') + CAP)
    kernel.run(
        "class Keeper(Tiny):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.wide = torch.nn.Linear(8, 1 << 16)\n"
        "    def training_step(self, batch, batch_idx):\n"
        "        wide = self.wide(batch[0])  # (16, 65536) float32: 4 MiB\n"
        "        kept.append(wide)  # for metrics later: kept after backward\n"
        "        time.sleep(0.004)\n"
        "        return super().training_step(batch, batch_idx) + wide.mean() * 0\n"
        "data = torch.utils.data.TensorDataset(torch.randn(16 * 4000, 8), torch.randn(16 * 4000, 1))\n"
        "loader = torch.utils.data.DataLoader(data, batch_size=16)"
    )
    cell = kernel.run(f"trainer = fit(Keeper(), {str(tmp_path)!r})", expect_error=True)
    assert_a_creep_naming_kept(kernel, cell)
    assert "raised in training at epoch 0" in cell.text, cell.text


def test_an_hf_trainer_that_keeps_each_steps_logits_creeps_and_names_the_list(make_kernel, tmp_path):
    kernel = make_kernel(**ONE_GPU)
    setup = (TRANSFORMERS.replace("use_cpu=True", "use_cpu=False")
             .replace("vocab_size=100", "vocab_size=8192")  # logits (8, 16, 8192) float32: 4 MiB
             .replace("return 32", "return 8 * 4000")
             .replace("return transformers.Trainer(", "return Keeping("))
    kernel.run(setup + CAP)
    kernel.run(
        "class Keeping(transformers.Trainer):\n"
        "    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):\n"
        "        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, **kwargs)\n"
        "        kept.append(outputs.logits)  # for metrics later\n"
        "        time.sleep(0.004)\n"
        "        return (loss, outputs) if return_outputs else loss"
    )
    cell = kernel.run(f"trainer_for({str(tmp_path)!r}).train()", expect_error=True)
    assert_a_creep_naming_kept(kernel, cell)
