"""The per-cell log on an NVIDIA GPU, in real kernels (`pytest -m gpu`)."""

import pytest

from conftest import GPU_UUIDS, SAMPLER_RUNNING

pytestmark = pytest.mark.gpu

GiB = 1 << 30
MiB = 1 << 20

SETUP = """\
import time
import torch
import gpuexp
from gpuexp import GPUExperiment
torch.ones(1, device="cuda");
"""


def last_cell(kernel, gpu=0):
    return kernel.value(f"gpuexp.cells()[-1].to_dict()['gpus'][{gpu}]")


def test_a_2_gib_spike_peaks_at_exactly_2_gib_and_nvml_sees_it(kernel):
    kernel.run(SETUP + "%gpuexp log on")
    shown = kernel.run(
        "t = torch.empty(2 << 30, dtype=torch.uint8, device='cuda')\n"
        "time.sleep(0.02)\n"
        "del t\n"
        "torch.cuda.empty_cache()"
    )
    gpu = last_cell(kernel)
    assert gpu["torch_allocated"]["peak_above_start"] == 2 * GiB
    assert gpu["torch_allocated"]["consumed"] == 0
    assert gpu["process_used"]["peak_above_start"] >= 2 * GiB  # seen by the 1 ms sampler
    assert "+2.00 GiB" in next(line for line in shown.text.splitlines() if "torch allocated" in line)
    assert kernel.value(SAMPLER_RUNNING) is True
    kernel.run("%gpuexp log off")
    kernel.run("pass")
    assert kernel.value(SAMPLER_RUNNING) is False


def test_gpus_a_cell_never_touched_are_not_shown(kernel):
    kernel.run(SETUP + "%gpuexp log on")
    # Each cell moves 8 MiB of host memory, so that the quiet log shows its block.
    host_only = kernel.run("x = bytearray(8 << 20)")
    assert "host RSS" in host_only.text and "cuda:" not in host_only.text
    gpu_cell = kernel.run("y = torch.ones(1 << 20, device='cuda')")
    assert "cuda:0 torch allocated" in gpu_cell.text
    kernel.run("gpuexp.config(cell_log_all_gpus=True)")
    assert "cuda:0 torch allocated" in kernel.run("z = bytearray(8 << 20)").text


def test_nested_experiments_and_cells_keep_their_peaks_on_the_gpu(kernel):
    kernel.run(SETUP)
    kernel.run('outer = GPUExperiment("outer")')
    kernel.run("s = torch.empty(3 << 30, dtype=torch.uint8, device='cuda')\ndel s")
    kernel.run('inner = GPUExperiment("inner")')
    kernel.run("s = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')\ndel s")
    cell = last_cell(kernel)["torch_allocated"]
    kernel.run("del inner")
    kernel.run("del outer")
    inner, outer = kernel.value("[r.to_dict()['gpus'][0]['torch_allocated'] for r in gpuexp.history()]")
    assert cell["peak_above_start"] == GiB
    assert inner["peak"] - inner["start"] == GiB
    assert outer["peak"] - outer["start"] == 3 * GiB


def test_a_users_peak_reset_in_a_cell_loses_no_peak(kernel):
    kernel.run(SETUP)
    kernel.run('exp = GPUExperiment("reset")')
    kernel.run(
        "s = torch.empty(2 << 30, dtype=torch.uint8, device='cuda')\ndel s\n"
        "torch.cuda.reset_peak_memory_stats()\n"
        "print(torch.cuda.max_memory_allocated())"
    )
    cell = kernel.value("gpuexp.cells()[-1].to_dict()")
    assert cell["gpus"][0]["torch_allocated"]["peak_above_start"] == 2 * GiB
    assert any("reset_peak_memory_stats" in note for note in cell["notes"])
    kernel.run("del exp")
    row = kernel.value("gpuexp.history()[-1].to_dict()['gpus'][0]['torch_allocated']")
    assert row["peak"] - row["start"] == 2 * GiB


@pytest.mark.skipif(len(GPU_UUIDS) < 2, reason="needs two GPUs")
def test_only_the_gpu_a_cell_used_is_shown(kernel):
    kernel.run(SETUP + "%gpuexp log on")
    shown = kernel.run("x = torch.ones(1 << 20, device='cuda:1')")
    assert "cuda:1 torch allocated" in shown.text and "cuda:0 torch" not in shown.text


def test_an_evaluation_cell_without_no_grad_run_three_times_gets_the_creep_note_on_the_gpu(kernel):
    kernel.run(
        SETUP + "%gpuexp log on\n"
        "model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024))\n"
        "model = model.cuda()\n"
        "x = torch.randn(256, 1024, device='cuda')\n"
        "outs = []"
    )
    for _ in range(3):
        shown = kernel.run("outs.append(model(x))  # each output keeps its graph: about 5 MiB")
    (note,) = [n for n in kernel.value("gpuexp.cells()[-1].to_dict()['notes']") if n.startswith("memory creeps")]
    assert "on cuda:0" in note and "`outs`" in note and "now 3 items" in note and "torch.no_grad()" in note, note
    assert "memory creeps" in shown.text
    kernel.run("outs.clear()\n%gpuexp log off")
