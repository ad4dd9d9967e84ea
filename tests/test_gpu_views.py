"""The live view, the finder's progress and gpuexp.compare() on an NVIDIA GPU (`pytest -m gpu`),
in real kernels: the live view's GPU bars carry torch's and NVML's figures, the finder's
progress is one output updated in place, and the comparison's plot has the device's total."""

import re

import pytest

from test_live_view import LIVE_TITLE, live_views, messages

pytestmark = pytest.mark.gpu

GiB = 1 << 30
MiB = 1 << 20

SETUP = """\
import time
import torch
import gpuexp
torch.ones(1, device="cuda");
"""
SIZE = r"\d+\.\d\d [KMGT]iB"


def test_the_live_view_has_torch_and_nvml_bars_for_the_gpu_in_use(kernel):
    kernel.run(SETUP + "exp = gpuexp.GPUExperiment('live', limit='8GiB')\ngpuexp.config(live_view_after_s=0.5);")
    found = messages(kernel, "t = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')\ntime.sleep(1.6)")
    views = live_views(found)
    live = [m for m in views if LIVE_TITLE.match(m.text)]
    assert len(live) >= 2, views
    text, html = live[-1].text, live[-1].content["data"]["text/html"]
    rows = {line.split("  ")[0].strip(): line for line in text.splitlines()[2:]}
    for label in ("cuda:0 torch allocated", "cuda:0 torch reserved", "cuda:0 NVML process", "host RSS"):
        assert label in rows, text
    allocated = re.findall(SIZE, rows["cuda:0 torch allocated"])
    assert allocated[:2] == ["1.00 GiB", "1.00 GiB"] and "8.00 GiB limit" in rows["cuda:0 torch allocated"], text
    assert re.search(rf"{SIZE} total", rows["cuda:0 NVML process"]), "NVML is measured against the device"
    assert html.count("var(--jp-brand-color1)") == 4, "a bar per figure"
    assert "limit 8.00 GiB" in text.splitlines()[1], text
    assert views[-1].text.startswith("gpuexp · cell ["), "the block replaced the view"


def test_an_unused_gpu_gets_no_bars(kernel):
    kernel.run("import time, gpuexp\nexp = gpuexp.GPUExperiment('no torch')\ngpuexp.config(live_view_after_s=0.3);")
    found = messages(kernel, "time.sleep(1)")
    first = live_views(found)[0]
    assert "cuda:" not in first.text and "host RSS" in first.text, first.text


def test_the_finders_progress_is_one_output_updated_after_each_trial(kernel):
    kernel.run(SETUP + """\
model = torch.nn.Linear(1024, 1024).cuda()
def step(bs):
    model(torch.randn(bs, 1024, device="cuda")).sum().backward()
""")
    # Without the estimate's seed, so that the search takes several trials to draw.
    found = messages(kernel, "result = gpuexp.find_batch_size(step, start=64, max=2048, estimate=False)")
    progress = [m for m in found if (m.display_id or "").startswith("gpuexp-finder-")]
    assert progress[0].kind == "display_data" and progress[0].text.startswith("gpuexp: trial 1 ("), progress
    assert all(m.kind == "update_display_data" for m in progress[1:]) and len(progress) >= 3
    assert "<table>" in progress[1].content["data"]["text/html"]
    assert re.fullmatch(r"gpuexp · batch size \d+ · \d+ trials", progress[-1].text), progress[-1]
    assert kernel.value("result.trials") == len(progress) - 1, "one drawing per trial, then the result"
    assert not [m for m in found if m.kind == "stream" and "trial" in m.text], "no line per trial in Jupyter"


def test_compare_plots_the_peaks_with_the_device_total_and_a_fit(kernel):
    kernel.run(SETUP + """\
for bs in (64, 128, 256):
    with gpuexp.GPUExperiment(f"bs={bs}"):
        batch = torch.empty(bs * (4 << 20), dtype=torch.uint8, device="cuda")   # 4 MiB a sample
comparison = gpuexp.compare()
figure = comparison.plot()
""")
    rows = kernel.value("comparison.to_dict()['rows']")
    peaks = [r["gpus"][0]["torch_allocated"]["peak"] - r["gpus"][0]["torch_allocated"]["start"] for r in rows]
    assert peaks == [bs * 4 * MiB for bs in (64, 128, 256)]
    labels = kernel.value("[line.get_label() for line in figure.axes[0].get_lines()]")
    total = next(label for label in labels if label.startswith("device total ("))
    assert re.fullmatch(rf"device total \({SIZE}\)", total), labels
    for layer in ("cuda:0 torch allocated", "cuda:0 torch reserved", "cuda:0 NVML process"):
        assert layer in labels, labels
    fit = next(label for label in labels if label.startswith("fit of cuda:0 NVML process"))
    largest = int(re.search(r"fits up to bs = (\d+)", fit).group(1))
    total_bytes = kernel.value("comparison.to_dict()['rows'][0]['gpus'][0]['total']")
    # 4 MiB a sample: the device holds about total / 4 MiB samples, less the context.
    assert 0.8 * total_bytes / (4 * MiB) < largest < total_bytes / (4 * MiB), (largest, total_bytes)
    table = kernel.run("comparison").text
    assert "cuda:0 allocated peak" in table and "note: consumed and reclaimed: torch allocated" in table
