"""The batch-size finder and `limit=` on an NVIDIA GPU (`pytest -m gpu`), in real kernels."""

from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

GiB = 1 << 30

BENCH = Path(__file__).resolve().parent.parent / "bench"

MODELS = {
    # A small conv net whose few activations are large next to a 4 GiB cap: they fragment it, so
    # the line of allocated peaks overshoots the edge (by about 25% on an H200) and the search
    # has to bisect.
    "small-conv": """\
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
    torch.nn.Conv2d(64, 128, 3, padding=1), torch.nn.BatchNorm2d(128), torch.nn.ReLU(),
    torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(128, 10)).cuda()
def make_inputs(bs):
    return torch.randn(bs, 3, 64, 64, device="cuda"), torch.randint(0, 10, (bs,), device="cuda")
""",
    "transformer": """\
layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True)
model = torch.nn.Sequential(torch.nn.Embedding(4096, 256), torch.nn.TransformerEncoder(layer, 2),
                            torch.nn.Flatten(), torch.nn.LazyLinear(10)).cuda()
SEQ = 128
def make_inputs(bs, seq_len=SEQ):
    return torch.randint(0, 4096, (bs, seq_len), device="cuda"), torch.randint(0, 10, (bs,), device="cuda")
model(make_inputs(2)[0])
""",
}

PLAIN_STEP = """\
opt = torch.optim.AdamW(model.parameters())
def step(bs):
    x, y = make_inputs(bs)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
"""

# The bench's models (a ResNet-ish conv net on 3x128x128 images, a transformer LM), the ones its
# results and the targets are about.
BENCH_MODEL = f"""\
import sys
sys.path.insert(0, {str(BENCH)!r})
import batch_size as bench
workload = bench.make_workloads(torch, False)[{{name!r}}]
model, opt = bench.fresh(torch, workload, torch.device("cuda"))
step = bench.make_step(torch, model, opt, workload, torch.device("cuda"))
"""

HELPERS = """\
def fits(bs):
    try:
        step(bs); step(bs); torch.cuda.synchronize()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        gc.collect(); torch.cuda.empty_cache()
def true_max(limit, high):
    frac = limit / torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(frac)
    low = 0
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    torch.cuda.set_per_process_memory_fraction(1.0)
    return low
"""


def setup(kernel, model):
    bench_name = model.removeprefix("bench-")
    body = BENCH_MODEL.format(name=bench_name) if bench_name != model else MODELS[model] + PLAIN_STEP
    kernel.run("import gc, torch, gpuexp\ntorch.manual_seed(0)\n" + body + HELPERS)


LIMIT = 4 * GiB


@pytest.mark.parametrize("model, limit, most_trials", [
    ("bench-conv", 24 * GiB, 5),
    ("bench-transformer", 24 * GiB, 5),
    # At 4 GiB this small transformer's edge lies within the line's error of the prediction,
    # and its memory is not monotonic there: on an H100, 678, 689 and 694 ran, 680 (694 less
    # the margin) did not, so the held-back size had to run too. 7 trials there.
    ("transformer", 4 * GiB, 7),
    ("small-conv", 4 * GiB, 12),
])
def test_the_answer_is_near_the_true_maximum_and_never_ooms(kernel, model, limit, most_trials):
    setup(kernel, model)
    kernel.run(f"result = gpuexp.find_batch_size(step, start=8, max=8192, limit={limit}, progress=False)")
    found, trials = kernel.value("[result.batch_size, result.trials]")
    shown = kernel.run("print(result)").text
    truth = kernel.value(f"true_max({limit}, 8192)")
    # The bisected maximum depends on what the allocator cached before, so it is no hard ceiling:
    # what counts is being near it and never running out of memory at the answer.
    assert found >= 0.95 * truth, (found, truth, shown)
    assert trials <= most_trials, shown
    frac = limit / kernel.value("torch.cuda.get_device_properties(0).total_memory")
    kernel.run(f"torch.cuda.set_per_process_memory_fraction({frac})")
    assert kernel.value(f"[fits({found}) for _ in range(3)]") == [True, True, True], shown


def test_a_step_with_a_sequence_length_varies_only_the_batch(kernel):
    setup(kernel, "transformer")
    kernel.run("def long_step(bs):\n"
               "    x, y = make_inputs(bs, SEQ)\n"
               "    torch.nn.functional.cross_entropy(model(x), y).backward()")
    kernel.run(f"result = gpuexp.find_batch_size(long_step, limit={LIMIT}, multiple_of=8, progress=False)")
    assert kernel.value("result.batch_size") % 8 == 0
    assert kernel.value("result.batch_size") >= 8


def test_an_error_other_than_oom_stops_the_search(kernel):
    kernel.run("import torch, gpuexp\n"
               "def step(bs):\n"
               "    if bs > 8:\n"
               "        raise ValueError('shape mismatch')\n"
               "    torch.ones(bs, device='cuda')")
    failed = kernel.run("gpuexp.find_batch_size(step, progress=False)", expect_error=True)
    assert failed.error == "ValueError: shape mismatch"


def test_a_limit_rehearses_a_smaller_card_and_is_restored(kernel):
    kernel.run("import torch, gpuexp\ntorch.ones(1, device='cuda');")
    kernel.run("exp = gpuexp.GPUExperiment('small card', limit='2GiB')")
    failed = kernel.run("t = torch.empty(3 << 30, dtype=torch.uint8, device='cuda')", expect_error=True)
    assert "OutOfMemoryError" in failed.error
    shown = kernel.run("del exp")
    assert "limit: torch could allocate 2.00 GiB per GPU" in shown.text
    assert kernel.value("gpuexp.history()[-1].to_dict()['limit']") == 2 * GiB
    kernel.run("t = torch.empty(3 << 30, dtype=torch.uint8, device='cuda')")  # the cap is gone
    assert kernel.value("t.numel()") == 3 * GiB
