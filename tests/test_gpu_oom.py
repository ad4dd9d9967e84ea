"""OOM rescue on an NVIDIA GPU (`pytest -m gpu`): real torch.OutOfMemoryError, real memory."""

import pytest

pytestmark = pytest.mark.gpu

GiB = 1 << 30

SETUP = """\
import torch
import gpuexp
torch.ones(1, device="cuda");
"""


def allocated(kernel):
    return kernel.value("torch.cuda.memory_allocated()")


def test_an_oom_in_a_function_holding_2_gib_with_no_experiment_open(kernel):
    kernel.run(SETUP)
    before = allocated(kernel)
    failed = kernel.run(
        "def step():\n"
        "    held = torch.empty(2 << 30, dtype=torch.uint8, device='cuda')\n"
        "    return torch.empty(1 << 50, dtype=torch.uint8, device='cuda')\n"
        "step()",
        expect_error=True,
    )
    assert "OutOfMemoryError" in failed.error
    assert allocated(kernel) == before
    diagnosis = failed.text.split("rescued")[1]
    assert "1.00 PiB" in diagnosis.split("requested")[1].splitlines()[0]  # 1 << 50 bytes
    free = kernel.value("__import__('gpuexp').snapshot().to_dict()['gpus'][0]['free']")
    total = kernel.value("torch.cuda.get_device_properties(0).total_memory")
    assert free > total * 0.5  # the 2 GiB came back to the device


def test_an_oom_inside_a_models_forward(kernel):
    kernel.run(SETUP + "exp = gpuexp.GPUExperiment('forward')")
    kernel.run(
        "class Big(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.layer = torch.nn.Linear(4096, 4096)\n"
        "    def forward(self, x):\n"
        "        h = self.layer(x)\n"
        "        wide = h.repeat(1, 1 << 40)\n"
        "        return wide\n"
        "model = Big().cuda()\n"
        "x = torch.randn(256, 4096, device='cuda')"
    )
    before = allocated(kernel)
    failed = kernel.run("model(x)", expect_error=True)
    assert "OutOfMemoryError" in failed.error and "rescued" in failed.text
    assert allocated(kernel) == before
    cell = kernel.value("gpuexp.cells()[-1].to_dict()['gpus'][0]['torch_allocated']")
    assert cell["consumed"] == 0


def test_the_diagnosis_reports_the_request_and_free_memory(kernel):
    kernel.run(SETUP)
    free = kernel.value("__import__('gpuexp').snapshot().to_dict()['gpus'][0]['free']")
    request = free + (8 << 30)  # just over what is free: a realistic OOM
    failed = kernel.run(f"t = torch.empty({request}, dtype=torch.uint8, device='cuda')", expect_error=True)
    text = failed.text.split("rescued")[1]
    requested_line = text.split("requested")[1].splitlines()[0]
    # torch's message gives the size to 2 decimals, after rounding the request up to its blocks.
    shown = float(requested_line.split("GiB")[0].split()[-1])
    assert abs(shown - request / GiB) <= 0.011, (request / GiB, requested_line)
    assert "device free" in text and "hint:" in text
