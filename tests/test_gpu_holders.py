"""The leak hunter on an NVIDIA GPU (`pytest -m gpu`)."""

import pytest

pytestmark = pytest.mark.gpu

GiB = 1 << 30

SETUP = """\
import weakref
import torch
import gpuexp
torch.ones(1, device="cuda");
"""


def test_a_tensor_appended_to_a_preexisting_list_survives_and_is_named(kernel):
    kernel.run(SETUP + "cache = []")
    base = kernel.value("torch.cuda.memory_allocated()")
    kernel.run('exp = gpuexp.GPUExperiment("leak")')
    kernel.run("t = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')\ncache.append(t)")
    shown = kernel.run("del exp")
    assert kernel.value("torch.cuda.memory_allocated()") - base == GiB  # user data outside the scope survives
    assert "still held on cuda:0: cache[0] (1.00 GiB)" in shown.text
    held = kernel.value("gpuexp.history()[-1].to_dict()['holders'][0]")
    assert held["device"] == "cuda:0" and held["holders"][0]["path"] == "cache[0]"


def test_optimizer_state_parameters_and_a_displayed_result(kernel):
    kernel.run(SETUP)
    kernel.run(
        "model = torch.nn.Sequential(\n"
        "    torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096)).cuda()\n"
        "opt = torch.optim.Adam(model.parameters())\n"
        "model(torch.randn(8, 4096, device='cuda')).sum().backward()\n"
        "opt.step()"
    )
    kernel.run("torch.ones(64 << 20, device='cuda')")  # displayed: Out holds it
    paths = kernel.value("gpuexp.holders().paths")
    for expected in ("model.0.weight", "model.2.weight.grad", "opt.state[model.0.weight]['exp_avg']",
                     "opt.state[model.2.weight]['exp_avg_sq']", "Out[3]"):
        assert expected in paths, (expected, paths)


def test_memory_an_autograd_graph_saved_is_charged_to_the_tensor_that_holds_the_graph(kernel):
    kernel.run(SETUP)
    kernel.run(
        "w = torch.randn(4096, 4096, device='cuda', requires_grad=True)\n"
        "x = torch.randn(4096, 4096, device='cuda')\n"
        "loss = (torch.relu(x @ w) @ w).sum()"  # autograd keeps relu's result (64 MiB), in C++
    )
    found = kernel.value("gpuexp.holders(0).to_dict()")
    # No name holds the saved activation; `loss` does, through its graph. x and w are named
    # by their own names, never charged to the graph.
    by_path = {h["path"]: h for h in found["holders"]}
    assert by_path["loss"]["saved_for_backward"] >= 64 << 20, found
    assert by_path["w"]["saved_for_backward"] == by_path["x"]["saved_for_backward"] == 0, found
    assert found["unreachable"] < 64 << 20, found
    text = kernel.run("print(gpuexp.holders(0))").text
    assert "saved for its backward" in text, text


def test_the_hunter_leaves_no_reference_behind(kernel):
    kernel.run(SETUP)
    base = kernel.value("torch.cuda.memory_allocated()")
    kernel.run("t = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')\nwt = weakref.ref(t)")
    assert "t" in kernel.value("gpuexp.holders().paths")
    kernel.run("del t")
    assert kernel.value("wt() is None")
    assert kernel.value("torch.cuda.memory_allocated()") == base
