"""The scenarios of a GPU notebook, each in a real kernel on an NVIDIA GPU (`pytest -m gpu`).

Every scenario checks that torch allocated is back to the pre-experiment baseline, to the
byte, after `del exp`, and which names exist afterwards.
"""

import pytest

from conftest import GPU_UUIDS

pytestmark = pytest.mark.gpu

GiB = 1 << 30
MiB = 1 << 20

SETUP = """\
import builtins, sys, weakref
import torch
import gpuexp
from gpuexp import GPUExperiment
torch.ones(1, device="cuda");  # the CUDA context exists before any experiment (`;`: no Out entry)
"""


@pytest.fixture
def gpu(kernel):
    kernel.run(SETUP)
    kernel.base = kernel.value("torch.cuda.memory_allocated()")
    return kernel


def allocated_above_base(kernel):
    return kernel.value("torch.cuda.memory_allocated()") - kernel.base


def names_present(kernel, *names):
    return kernel.value(f"sorted(n for n in {names!r} if n in globals())")


def last_gpu_row(kernel):
    return kernel.value("gpuexp.history()[-1].to_dict()['gpus'][0]")


def test_a_1_gib_tensor_is_consumed_and_reclaimed_exactly(gpu):
    gpu.run('exp = GPUExperiment("1 GiB")')
    gpu.run("x = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')")
    shown = gpu.run("del exp")
    assert allocated_above_base(gpu) == 0
    assert names_present(gpu, "x") == []
    row = last_gpu_row(gpu)
    assert row["torch_allocated"]["consumed"] == GiB
    assert row["torch_allocated"]["reclaimed"] == GiB
    assert row["torch_allocated"]["peak"] == row["torch_allocated"]["start"] + GiB
    assert row["process_used"]["consumed"] >= GiB
    assert row["process_used"]["reclaimed"] >= GiB
    allocated_line = next(line for line in shown.text.splitlines() if "torch allocated" in line)
    assert allocated_line.count("+1.00 GiB") == 2, allocated_line  # consumed and reclaimed


def test_a_displayed_tensor_held_by_out_and_underscore(gpu):
    gpu.run('exp = GPUExperiment("displayed")')
    gpu.run("y = torch.ones(256 << 20, device='cuda')")
    gpu.run("y")
    gpu.run("del exp")
    assert allocated_above_base(gpu) == 0
    assert names_present(gpu, "y") == []
    assert gpu.value("len(Out)") == 0


def test_an_oom_inside_a_function_that_held_2_gib(gpu):
    # Without the rescue (tests/test_gpu_oom.py), the traceback keeps the 2 GiB until teardown.
    gpu.run('gpuexp.config(oom_rescue=False)\nexp = GPUExperiment("oom")')
    oom = gpu.run(
        "def step():\n"
        "    held = torch.empty(2 << 30, dtype=torch.uint8, device='cuda')\n"
        "    return torch.empty(1 << 50, dtype=torch.uint8, device='cuda')\n"
        "step()",
        expect_error=True,
    )
    assert "OutOfMemoryError" in oom.error
    assert allocated_above_base(gpu) >= 2 * GiB  # the traceback's frame still holds it
    gpu.run("del exp")
    assert allocated_above_base(gpu) == 0
    assert "last exception" in gpu.value("gpuexp.history()[-1].cleared")


def test_a_preexisting_name_rebound_to_a_1_gib_tensor(gpu):
    gpu.run("z = 1")
    gpu.run('exp = GPUExperiment("rebound")')
    gpu.run("z = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')")
    gpu.run("del exp")
    assert allocated_above_base(gpu) == 0
    assert names_present(gpu, "z") == []
    assert gpu.value("gpuexp.history()[-1].rebound") == ["z"]


def test_a_model_adam_and_one_training_step(gpu):
    gpu.run('exp = GPUExperiment("train")')
    gpu.run(
        "model = torch.nn.Sequential(\n"
        "    torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096)).cuda()\n"
        "opt = torch.optim.Adam(model.parameters())\n"
        "loss = model(torch.randn(64, 4096, device='cuda')).square().mean()\n"
        "loss.backward()\n"
        "opt.step()"
    )
    assert allocated_above_base(gpu) > 256 * MiB
    gpu.run("del exp")
    assert allocated_above_base(gpu) == 0  # cuBLAS workspaces included
    assert names_present(gpu, "model", "opt", "loss") == []


def test_keep_protects_a_tensor(gpu):
    gpu.run('exp = GPUExperiment("keep")')
    gpu.run("kept = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')\n"
            "dropped = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')\n"
            "exp.keep('kept')")
    gpu.run("del exp")
    assert allocated_above_base(gpu) == GiB
    assert names_present(gpu, "kept", "dropped") == ["kept"]
    assert gpu.value("gpuexp.history()[-1].kept") == ["kept"]


def test_an_alias_of_a_preexisting_tensor_leaves_the_tensor(gpu):
    gpu.run("pre = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')")
    base_with_pre = gpu.value("torch.cuda.memory_allocated()")
    gpu.run('exp = GPUExperiment("alias")')
    gpu.run("alias = pre")
    gpu.run("del exp")
    assert gpu.value("torch.cuda.memory_allocated()") == base_with_pre
    assert names_present(gpu, "pre", "alias") == ["pre"]


def test_nested_scopes_and_their_peaks(gpu):
    gpu.run('outer = GPUExperiment("outer")')
    gpu.run("a = torch.empty(512 << 20, dtype=torch.uint8, device='cuda')\n"
            "spike = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')\n"
            "del spike")
    gpu.run('inner = GPUExperiment("inner")')
    gpu.run("b = torch.empty(256 << 20, dtype=torch.uint8, device='cuda')")
    gpu.run("del inner")
    assert names_present(gpu, "a", "b") == ["a"]
    assert allocated_above_base(gpu) == 512 * MiB
    inner = last_gpu_row(gpu)["torch_allocated"]
    gpu.run("del outer")
    assert allocated_above_base(gpu) == 0
    outer = last_gpu_row(gpu)["torch_allocated"]
    assert inner["consumed"] == 256 * MiB and inner["peak"] == inner["start"] + 256 * MiB
    assert outer["consumed"] == 512 * MiB and outer["peak"] == outer["start"] + 512 * MiB + GiB


def test_rerunning_the_constructor_cell(gpu):
    constructor = 'exp = GPUExperiment("rerun")'
    gpu.run(constructor)
    gpu.run("t = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')")
    gpu.run(constructor)
    assert allocated_above_base(gpu) == 0
    gpu.run("del exp")
    first, second = gpu.value("[r.to_dict()['gpus'][0]['torch_allocated'] for r in gpuexp.history()]")
    assert first["consumed"] == GiB and first["reclaimed"] == GiB
    assert second["start"] == gpu.base and second["consumed"] == 0


def test_looking_creates_no_cuda_context(make_kernel):
    kernel = make_kernel()
    kernel.run("import torch, gpuexp\nsnap = gpuexp.snapshot().to_dict()")
    kernel.run("exp = gpuexp.GPUExperiment('look')")
    kernel.run("del exp")
    assert kernel.value("torch.cuda.is_initialized()") is False
    gpus = kernel.value("snap['gpus']")
    assert gpus and all(g["process_used"] == 0 for g in gpus)
    untouched = {"allocated": 0, "reserved": 0, "peak_allocated": 0, "peak_reserved": 0, "num_ooms": 0}
    assert all(g["torch"] == untouched for g in gpus)


def test_cuda_visible_devices_as_a_uuid_maps_by_uuid(make_kernel):
    uuid = GPU_UUIDS[-1]
    kernel = make_kernel(CUDA_VISIBLE_DEVICES=uuid)
    kernel.run("import torch, gpuexp\nbefore = gpuexp.snapshot().to_dict()['gpus']")
    assert [(g["torch_index"], g["uuid"]) for g in kernel.value("before")] == [(0, uuid)]
    kernel.run("x = torch.ones(1, device='cuda')\nafter = gpuexp.snapshot().to_dict()['gpus']")
    after = kernel.value("after")
    assert [(g["torch_index"], g["uuid"], g["nvml_index"]) for g in after] == [(0, uuid, len(GPU_UUIDS) - 1)]
    assert after[0]["process_used"] > 0 and after[0]["torch"]["allocated"] > 0


@pytest.mark.skipif(len(GPU_UUIDS) < 2, reason="needs two GPUs")
def test_reordered_cuda_visible_devices(make_kernel):
    kernel = make_kernel(CUDA_VISIBLE_DEVICES="1,0", CUDA_DEVICE_ORDER="PCI_BUS_ID")
    kernel.run("import torch, gpuexp\nbefore = gpuexp.snapshot().to_dict()['gpus']")
    expected = [(0, GPU_UUIDS[1]), (1, GPU_UUIDS[0])]
    assert [(g["torch_index"], g["uuid"]) for g in kernel.value("before")] == expected
    kernel.run("x = torch.ones(1 << 20, device='cuda:1')\nafter = gpuexp.snapshot().to_dict()['gpus']")
    after = kernel.value("after")
    assert [(g["torch_index"], g["uuid"]) for g in after] == expected
    assert after[1]["torch"]["allocated"] >= 4 << 20 and after[0]["torch"]["allocated"] == 0
