"""gpuexp.explain() on an NVIDIA GPU (`pytest -m gpu`), in real kernels: the parts add up to
NVML's figures exactly, with the residual labelled."""

import pytest

pytestmark = pytest.mark.gpu

MiB = 1 << 20

SETUP = """\
import torch, gpuexp
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.BatchNorm1d(4096), torch.nn.ReLU(),
                            torch.nn.Linear(4096, 4096)).cuda()
opt = torch.optim.Adam(model.parameters())
model(torch.randn(64, 4096, device="cuda")).sum().backward()
opt.step()
cache = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda")]
# autograd keeps these activations in C++: torch allocated them, no Python tensor holds them
loss = (model(torch.randn(2048, 4096, device="cuda")) ** 2).sum()
def storage_bytes(tensors):
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
expected = {
    "parameters": storage_bytes(model.parameters()),
    "gradients": storage_bytes(p.grad for p in model.parameters()),
    "optimizer_state": storage_bytes(
        v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.is_cuda
    ),
    "buffers": storage_bytes(model.buffers()),
}
"""


def test_the_parts_add_up_to_nvml_exactly_and_the_residual_is_labelled(kernel):
    kernel.run(SETUP)
    kernel.run(
        "found = gpuexp.explain().to_dict()\n"
        "allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()"
    )
    found = kernel.value("found")
    categories = found["categories"]
    assert all(value is not None for value in categories.values()), categories
    assert sum(categories.values()) == found["process_used"], found
    others = sum(p["bytes"] or 0 for p in found["other_processes"])
    assert found["process_used"] + others + found["unattributed"] == found["device_used"], found
    assert found["torch_allocated"] == kernel.value("allocated")
    assert found["torch_reserved"] == kernel.value("reserved")
    assert categories["torch_cache"] == found["torch_reserved"] - found["torch_allocated"]
    assert 0 <= found["torch_cache_fragmented"] <= categories["torch_cache"]
    for key, value in kernel.value("expected").items():
        assert categories[key] == value, (key, categories)
    assert categories["other_tensors"] >= 256 * MiB and "cache[0]" in kernel.value(
        "[h['path'] for h in found['holders']]"
    )
    assert categories["no_python_tensor"] >= 2048 * 4096 * 4, categories  # the saved activations
    assert categories["not_torch"] > 0 and not found["notes"], found  # the CUDA context at least
    text = kernel.run("print(gpuexp.explain())").text
    for label in (
        "no Python tensor",
        "= torch allocated",
        "of which fragmented",
        "= torch reserved",
        "not torch",
        "the residual",
        "= NVML this process",
        "= NVML device used",
    ):
        assert label in text, (label, text)


def test_explaining_creates_no_cuda_context(kernel):
    kernel.run("import torch, gpuexp")
    assert kernel.value("gpuexp.explain().device") == "cpu"  # CUDA not initialised: the host
    found = kernel.value("gpuexp.explain(0).to_dict()")
    assert found["torch_allocated"] == 0 and found["categories"]["parameters"] == 0
    assert kernel.value("torch.cuda.is_initialized()") is False
