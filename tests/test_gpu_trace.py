"""Where in the code on a real GPU (`pytest -m gpu`): `GPUExperiment(trace=True)` in a real kernel,
checked against torch's own counters and against allocations whose sizes and lines are known."""

import pytest

from conftest import GPU_UUIDS

pytestmark = pytest.mark.gpu

MiB = 1 << 20

# One cell: its line numbers (1-based) are what the sites must name.
SCRIPTED = """\
a = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
b = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
del a
c = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
scope_peak = torch.cuda.max_memory_allocated()
del b, c"""

MODEL = """\
import torch.nn.functional as F
class Attention(torch.nn.Module):
    def __init__(self, d=512, heads=8, layers=4, vocab=8192):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, d)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(d, 3 * d) for _ in range(layers))
        self.out = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab)
    def forward(self, tokens):
        x = self.embed(tokens)
        b, n, d = x.shape
        for qkv, out in zip(self.qkv, self.out):
            q, k, v = qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            scores = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
            weights = scores.softmax(-1)
            x = x + out((weights @ v).transpose(1, 2).reshape(b, n, d))
        return self.head(x)
torch.manual_seed(0)
model = Attention().cuda()
opt = torch.optim.AdamW(model.parameters())
def step(bs, n=512):
    tokens = torch.randint(0, 8192, (bs, n), device="cuda")
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
step(2)
torch.cuda.synchronize()"""


def test_the_peak_by_source_line_equals_torch_s_and_the_known_sizes(kernel):
    kernel.run("import torch, gpuexp\nbefore = torch.empty(4 << 20, dtype=torch.uint8, device='cuda')")
    kernel.run("exp = gpuexp.GPUExperiment('scripted', trace=True)")
    cell = kernel.run(SCRIPTED)
    number = kernel.nb.cells[-1].execution_count
    scope_peak = kernel.value("scope_peak")  # made in the scope: the finish deletes it
    shown = kernel.run("exp.finish()")
    report = kernel.value("exp.data.to_dict()")
    (device,) = report["trace"]
    peak = device["peak"]
    assert peak["peak"]["bytes"] == scope_peak == report["gpus"][0]["torch_allocated"]["peak"]
    sites = {row["label"]: row["bytes"] for row in peak["sites"]}
    assert sites[f"In [{number}], line 2"] == 128 * MiB and sites[f"In [{number}], line 4"] == 256 * MiB, sites
    assert f"In [{number}], line 1" not in sites, "freed before the peak"
    assert sum(sites.values()) + peak["rest"]["bytes"] == peak["peak"]["bytes"], "the blocks from before count too"
    assert "at the peak" in shown.text.lower() or "At the peak" in shown.text, cell
    assert kernel.value("torch._C._cuda_isHistoryEnabled()") is False, "no recording outlives the experiment"


@pytest.mark.skipif(len(GPU_UUIDS) < 2, reason="needs two GPUs")
def test_each_gpu_has_its_own_peak_by_source_line(kernel):
    kernel.run("import torch, gpuexp")
    kernel.run("exp = gpuexp.GPUExperiment('two GPUs', trace=True)")
    kernel.run("a = torch.empty(96 << 20, dtype=torch.uint8, device='cuda:0')\n"
               "b = torch.empty(160 << 20, dtype=torch.uint8, device='cuda:1')\n"
               "scope_peaks = [torch.cuda.max_memory_allocated(i) for i in range(2)]\n"
               "del a, b")
    number = kernel.nb.cells[-1].execution_count
    scope_peaks = kernel.value("scope_peaks")
    shown = kernel.run("exp.finish()")
    traces = {device["torch_index"]: device["peak"] for device in kernel.value("exp.data.to_dict()['trace']")}
    assert sorted(traces) == [0, 1], "a section for each GPU the scope used"
    for index, (line, size) in enumerate(((1, 96 * MiB), (2, 160 * MiB))):
        sites = {row["label"]: row["bytes"] for row in traces[index]["sites"]}
        assert sites[f"In [{number}], line {line}"] == size, (index, sites)
        assert f"In [{number}], line {3 - line}" not in sites, "the other GPU's line"
        assert traces[index]["peak"]["bytes"] == scope_peaks[index]
    for title in ("At the peak on GPU 0: 96.00 MiB", "At the peak on GPU 1: 160.00 MiB"):
        assert title in shown.text, shown.text


def test_a_user_s_own_recording_is_shared_and_left_running(kernel):
    kernel.run("import torch, gpuexp\ntorch.cuda.init()\n"
               "torch.cuda.memory._record_memory_history(max_entries=1000)")
    kernel.run("with gpuexp.GPUExperiment('inside', trace=True) as exp:\n"
               "    x = torch.empty(32 << 20, dtype=torch.uint8, device='cuda')\n"
               "    del x")
    assert any("shares the allocation history" in n for n in kernel.value("exp.data.notes"))
    assert kernel.value("torch._C._cuda_isHistoryEnabled()") is True
    assert kernel.value("exp.data.to_dict()['trace'][0]['peak']['peak']['bytes']") >= 32 * MiB


def test_the_diff_of_two_batch_sizes_goes_to_the_lines_that_grew(kernel, tmp_path):
    kernel.run("import torch, gpuexp")
    kernel.run(MODEL)
    for bs in (8, 16):
        kernel.run(f"with gpuexp.GPUExperiment('bs={bs}', trace=True, cell_log=False) as e{bs}:\n    step({bs})")
    diff = kernel.value("e16.data.diff(e8.data).to_dict()")
    peaks = [kernel.value(f"e{bs}.data.to_dict()['trace'][0]['peak']['peak']['bytes']") for bs in (8, 16)]
    growth = peaks[1] - peaks[0]
    assert growth > 0
    grew = sum(r["bytes_b"] - r["bytes_a"] for r in diff["rows"] if r["bytes_b"] > r["bytes_a"])
    shrank = sum(r["bytes_a"] - r["bytes_b"] for r in diff["rows"] if r["bytes_b"] < r["bytes_a"])
    assert grew - shrank == growth, "the rows add up to the growth in peak"
    assert shrank <= 0.1 * growth, f"at least 90% of the growth is on lines that grew: {diff['rows'][:5]}"
    stable = [r for r in diff["rows"] if "Linear" in (r.get("source") or "") or "AdamW" in (r.get("source") or "")]
    assert all(r["bytes_b"] == r["bytes_a"] for r in stable), stable
    print(kernel.run("print(e16.data.trace)\nprint(e16.data.diff(e8.data))").text)
    assert kernel.value("gpuexp.compare([e8.data, e16.data]).sites().to_dict()") == diff, "the comparison's ends"
    out = tmp_path / "bs16.pickle"
    kernel.run(f"e16.data.save_snapshot({str(out)!r})\nloaded = gpuexp.load_snapshot({str(out)!r})")
    assert kernel.value("loaded.to_dict()[0]['peak']['peak']['bytes']") >= peaks[1]


def test_an_oom_names_its_line_with_the_trace_on(kernel):
    kernel.run("import torch, gpuexp")
    kernel.run("exp = gpuexp.GPUExperiment('oom', trace=True)")
    failed = kernel.run("held = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')\n"
                        "huge = torch.empty(1 << 50, dtype=torch.uint8, device='cuda')", expect_error=True)
    number = kernel.nb.cells[-1].execution_count
    # The rescue's diagnosis, right under the traceback, names the line and what was live.
    assert f"failed at In [{number}], line 2 `huge = torch.empty(1 << 50" in failed.text, failed.text
    assert f"live then: In [{number}], line 1 (1.00 GiB" in failed.text, failed.text
    shown = kernel.run("exp.finish()")
    (device,) = kernel.value("exp.data.to_dict()['trace']")
    (oom,) = device["ooms"]
    assert oom["site"]["label"] == f"In [{number}], line 2", oom["site"]
    assert f"out of memory on cuda:0 at In [{number}], line 2" in shown.text


def test_allocations_carry_their_module_path_in_forward_and_backward(kernel):
    kernel.run("import torch, gpuexp")
    kernel.run(MODEL)
    kernel.run("with gpuexp.GPUExperiment('paths', trace=True, cell_log=False) as e:\n    step(8)")
    assert not [n for n in kernel.value("e.data.notes") if "module paths" in n]
    labels = [row["label"] for row in kernel.value("e.data.to_dict()['trace'][0]['peak']['sites']")]
    assert any(label.endswith(" in model") for label in labels), labels
    # The gradients of four big blocks, made in autograd's thread while each block's backward runs.
    kernel.run("class Layer(torch.nn.Module):\n"
               "    def __init__(self):\n"
               "        super().__init__()\n"
               "        self.fc, self.act = torch.nn.Linear(4096, 4096), torch.nn.GELU()\n"
               "    def forward(self, x):\n"
               "        return self.act(self.fc(x))\n"
               "mlp = torch.nn.Sequential(*[Layer() for _ in range(4)]).cuda()")
    kernel.run("with gpuexp.GPUExperiment('grads', trace=True, cell_log=False) as g:\n"
               "    mlp(torch.randn(8, 4096, device='cuda')).sum().backward()")
    number = kernel.nb.cells[-1].execution_count
    peak = kernel.value("g.data.to_dict()['trace'][0]['peak']")
    print(kernel.run("print(g.data.trace)").text)
    sites = {row["label"]: row["bytes"] for row in peak["sites"]}
    grads = [b for label, b in sites.items() if label.startswith("backward of mlp.* (4 modules)")
             and label.endswith(f"at In [{number}], line 2")]
    assert grads and grads[0] >= 4 * 64 * MiB, sites
    assert kernel.value("len(torch.nn.modules.module._global_forward_pre_hooks)") == 0, "no hook outlives the trace"
    assert kernel.value("sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in mlp.modules())") == 0
    assert kernel.value("torch.cuda.memory._get_memory_metadata()") == ""
def test_the_cell_log_names_the_line_behind_a_cell_s_peak_with_the_trace_on(kernel):
    # CUDA first: the cell log joins the recording only where CUDA is initialised already.
    kernel.run("import torch, gpuexp\ntorch.zeros(1, device='cuda')\ngpuexp.config(trace=True)")
    kernel.run("%gpuexp log on")
    shown = kernel.run("small = torch.empty(8 << 20, dtype=torch.uint8, device='cuda')\n"
                       "big = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')\n"
                       "del big")
    number = kernel.nb.cells[-1].execution_count
    (site,) = kernel.value("gpuexp.cells()[-1].to_dict()['peak_sites']")
    assert site["label"] == f"In [{number}], line 2", site
    assert site["bytes"] == 1 << 30 and site["peak_above_start"] == (1 << 30) + 8 * MiB, site
    assert abs(site["share"] - (1 << 30) / ((1 << 30) + 8 * MiB)) < 1e-3, "of what the cell had live at its peak"
    assert f"99% at In [{number}], line 2: big = torch.empty" in shown.text, shown.text
    # One recording across cells: the next cell is named from the same one.
    assert kernel.value("torch._C._cuda_isHistoryEnabled()") is True
    again = kernel.run("more = torch.empty(256 << 20, dtype=torch.uint8, device='cuda')")
    number = kernel.nb.cells[-1].execution_count
    assert f"100% at In [{number}], line 1" in again.text, again.text
    kernel.run("%gpuexp log off")
    assert kernel.value("torch._C._cuda_isHistoryEnabled()") is False, "the log's recording ends with it"


def test_the_cell_log_s_recording_ends_with_the_experiment_that_kept_the_log_on(kernel):
    kernel.run("import torch, gpuexp\ntorch.zeros(1, device='cuda')\ngpuexp.config(trace=True)")
    kernel.run("exp = gpuexp.GPUExperiment('cells')")
    shown = kernel.run("t = torch.empty(64 << 20, dtype=torch.uint8, device='cuda')")
    number = kernel.nb.cells[-1].execution_count
    assert f"at In [{number}], line 1" in shown.text, shown.text
    kernel.run("del exp")
    kernel.run("pass")
    assert kernel.value("torch._C._cuda_isHistoryEnabled()") is False, "no recording outlives the log"


def test_memory_still_held_is_named_with_its_holder_and_its_allocation_line(kernel):
    kernel.run("import torch, gpuexp\nkept = []")
    kernel.run("exp = gpuexp.GPUExperiment('leaky', trace=True)")
    cell = kernel.run("n = 256 << 20\nkept.append(torch.empty(n, dtype=torch.uint8, device='cuda'))")
    number = kernel.nb.cells[-1].execution_count
    assert f"100% at In [{number}], line 2" in cell.text, "a traced experiment's cells name their peak's line"
    shown = kernel.run("exp.finish()")
    assert kernel.value("torch._C._cuda_isHistoryEnabled()") is False, "neither the log's nor the experiment's is left"
    assert f"kept[0] (256.00 MiB, allocated at In [{number}], line 2)" in shown.text, shown.text
    assert f"allocated at: In [{number}], line 2" not in shown.text, "told next to its holder, not apart"
    (device,) = kernel.value("exp.data.to_dict()['trace']")
    (block,) = [b for b in device["still_held"] if b["label"] == f"In [{number}], line 2"]
    assert block["holders"] == ["kept[0]"] and block["bytes"] == 256 * MiB, block
