"""gpuexp.explain('cpu'): the host's RSS split into parameters, gradients, optimizer state,
buffers, other tensors and the rest, in real kernels."""

import pytest

from conftest import GPU

KEYS = {"parameters", "gradients", "optimizer_state", "buffers", "other_tensors", "no_python_tensor",
        "torch_cache", "not_torch"}

SETUP = """\
import numpy as np
import torch
import gpuexp
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1000, 300), torch.nn.BatchNorm1d(300), torch.nn.ReLU(),
                            torch.nn.Linear(300, 7))
opt = torch.optim.Adam(model.parameters())
torch.nn.functional.cross_entropy(model(torch.randn(16, 1000)), torch.randint(0, 7, (16,))).backward()
opt.step()
def storage_bytes(tensors):
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())
expected = {
    "parameters": storage_bytes(model.parameters()),
    "gradients": storage_bytes(p.grad for p in model.parameters()),
    "optimizer_state": storage_bytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)),
    "buffers": storage_bytes(model.buffers()),
}
"""


def test_parameters_optimizer_state_gradients_and_buffers_are_exact_to_the_byte(kernel):
    kernel.run(SETUP)
    expected = kernel.value("expected")
    assert expected["optimizer_state"] > 2 * expected["parameters"] - 1, expected  # exp_avg, exp_avg_sq and steps
    found = kernel.value("gpuexp.explain('cpu').to_dict()")
    categories = found["categories"]
    assert set(categories) == KEYS
    for key, value in expected.items():
        assert categories[key] == value, (key, categories, expected)
    assert categories["no_python_tensor"] is None and categories["torch_cache"] is None
    assert found["device"] == "cpu" and found["torch_allocated"] is None


def test_the_parts_add_up_to_the_rss_and_other_tensors_are_named(kernel):
    kernel.run(SETUP + "cache = [torch.ones(3 << 20)]\narray = np.ones(5 << 20, dtype=np.uint8)")
    found = kernel.value("gpuexp.explain('cpu').to_dict()")
    categories = found["categories"]
    assert sum(categories[k] for k in KEYS if categories[k] is not None) == found["process_used"]
    held = {h["path"]: h["bytes"] for h in found["holders"]}
    assert held["cache[0]"] == 12 << 20 and held["array"] == 5 << 20, held
    assert categories["other_tensors"] >= (12 << 20) + (5 << 20)
    assert not any(path.startswith("model") or path.startswith("opt") for path in held), held
    sizes = [h["bytes"] for h in found["holders"]]
    assert sizes == sorted(sizes, reverse=True)


def test_the_table_shows_each_part_and_what_they_add_up_to(kernel):
    kernel.run(SETUP + "cache = [torch.ones(3 << 20)]")
    shown = kernel.run("print(gpuexp.explain('cpu'))").text
    for label in ("parameters", "gradients", "optimizer state", "buffers", "other tensors", "  cache[0]",
                  "not tensors", "= host RSS"):
        assert f"│ {label}" in shown, (label, shown)
    html = kernel.run("gpuexp.explain('cpu')").html
    assert "<table>" in html and "= host RSS" in html
    assert kernel.value("gpuexp.explain().device") == "cpu"  # no CUDA initialised: the host


def test_without_torch_everything_is_not_tensors(kernel):
    kernel.run("import gpuexp")
    found = kernel.value("gpuexp.explain('cpu').to_dict()")
    categories = found["categories"]
    assert categories["parameters"] == categories["other_tensors"] == 0
    assert categories["not_torch"] == found["process_used"] > 0
    assert kernel.value("'torch' in __import__('sys').modules") is False


def test_a_finished_experiment_says_what_the_memory_it_still_holds_is(kernel):
    kernel.run("import torch, gpuexp\nkept = []")
    kernel.run('exp = gpuexp.CPUExperiment("leaky")')
    kernel.run(
        "model = torch.nn.Linear(4096, 4096)\n"
        "opt = torch.optim.Adam(model.parameters())\n"
        "model(torch.randn(8, 4096)).sum().backward()\n"
        "opt.step()\n"
        "kept.append((model, opt))"
    )
    shown = kernel.run("del exp").text
    weights = (4096 * 4096 + 4096) * 4
    assert "still held on host: kept[0][0].weight" in shown, shown
    assert "that is parameters 64.02 MiB, gradients 64.02 MiB, optimizer state 128.03 MiB" in shown, shown
    roles = kernel.value("gpuexp.history()[-1].to_dict()['holders'][0]['roles']")
    assert roles["parameters"] == roles["gradients"] == weights
    assert roles["optimizer_state"] == 2 * weights + 2 * 4  # exp_avg, exp_avg_sq, two float32 steps


@pytest.mark.skipif(GPU, reason="checks the machine without an NVIDIA driver")
def test_explaining_a_gpu_without_a_driver_says_what_to_explain_instead(kernel):
    kernel.run("import gpuexp")
    error = kernel.run("gpuexp.explain(0)", expect_error=True).error
    assert error.startswith("NvmlUnavailable: explain(0): no NVIDIA driver"), error
    assert "explain('cpu') explains host memory" in error, error
