"""gpuexp.estimate and the finder that starts from it, on an NVIDIA GPU (`pytest -m gpu`), in real
kernels: the bench's models within 5% of the measured peak, nothing allocated, the model untouched;
the finder in at most 2 real trials."""

from pathlib import Path

import pytest

from test_gpu_finder import setup

pytestmark = pytest.mark.gpu

GiB = 1 << 30

BENCH = Path(__file__).resolve().parent.parent / "bench"

MODELS = f"""\
import sys, gc, torch, gpuexp
sys.path.insert(0, {str(BENCH)!r})
import estimate as bench
device = torch.device("cuda")
workloads = bench.make_workloads(torch)
"""


@pytest.mark.parametrize("name", ["conv", "transformer", "attention", "mlp"])
def test_the_estimate_is_within_5_percent_of_the_real_peak_and_allocates_nothing(kernel, name):
    kernel.run(MODELS + f"model, opt = bench.workloads_of.fresh(torch, workloads[{name!r}], device)\n"
               f"step = bench.workloads_of.make_step(torch, model, opt, workloads[{name!r}], device)\nstep(2)")
    for batch_size in kernel.value(f"bench.SIZES[{name!r}]"):
        kernel.run(f"result, seconds, allocated = bench.estimated(torch, gpuexp, step, {batch_size}, device)\n"
                   f"real = bench.measured_peak(torch, step, {batch_size}, device)")
        estimate, real, seconds, allocated = kernel.value("[result.peak, real, seconds, allocated]")
        assert abs(estimate - real) <= 0.05 * real, (name, batch_size, estimate, real)
        assert seconds <= 2.0 and allocated == 0, (name, batch_size, seconds, allocated)


def test_the_model_on_the_gpu_is_untouched_to_the_bit(kernel):
    kernel.run(MODELS + "model, opt = bench.workloads_of.fresh(torch, workloads['transformer'], device)\n"
               "step = bench.workloads_of.make_step(torch, model, opt, workloads['transformer'], device)\nstep(2)\n"
               "model(torch.randint(0, 8192, (2, 256), device='cuda')).sum().backward()  # gradients exist too\n"
               "def fingerprint():\n"
               "    tensors = [*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers(),\n"
               "               *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))]\n"
               "    return [(id(t), t._version, t.detach().cpu().reshape(-1).view(torch.int32).tolist()\n"
               "             if t.element_size() == 4 else t.tolist()) for t in tensors]\n"
               "before = fingerprint()")
    kernel.run("gpuexp.estimate(step, 64)")
    assert kernel.value("fingerprint() == before") is True


@pytest.mark.parametrize("model", ["bench-conv", "bench-transformer"])
def test_the_finder_starts_from_the_estimate_and_verifies_in_two_trials(kernel, model):
    limit = 24 * GiB
    setup(kernel, model)
    kernel.run(f"result = gpuexp.find_batch_size(step, start=8, max=8192, limit={limit}, progress=False)")
    found, trials = kernel.value("[result.batch_size, result.trials]")
    shown = kernel.run("print(result)").text
    assert "estimate under fake tensors at 8, 32" in shown, shown
    truth = kernel.value(f"true_max({limit}, 8192)")
    assert found >= 0.97 * truth and trials <= 2, (found, truth, shown)
    frac = limit / kernel.value("torch.cuda.get_device_properties(0).total_memory")
    kernel.run(f"torch.cuda.set_per_process_memory_fraction({frac})")
    assert kernel.value(f"[fits({found}) for _ in range(3)]") == [True, True, True], shown


def test_estimate_false_searches_by_trials_as_before(kernel):
    setup(kernel, "small-conv")
    kernel.run("result = gpuexp.find_batch_size(step, limit=4 << 30, progress=False, estimate=False)")
    shown = kernel.run("print(result)").text
    assert "estimate" not in shown.split("┌")[0] and "probe" in shown, shown


RNN = """\
import gc, torch, gpuexp
from torch._subclasses.fake_tensor import FakeTensor
torch.manual_seed(0)
def rnn_step(kind, batch_size):
    layer = getattr(torch.nn, kind)(256, 512, num_layers=2).cuda()
    opt = torch.optim.Adam(layer.parameters())
    def step(bs):
        out, _ = layer(torch.randn(64, bs, 256, device="cuda"))
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
    step(2)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    try:
        gpuexp.estimate(step, batch_size)
        error = None
    except gpuexp.NoEstimate as e:
        error = str(e)
    moved = torch.cuda.max_memory_allocated() - before
    fakes = sum(isinstance(w, FakeTensor) for w in layer._flat_weights)
    step(batch_size)  # the real step runs right after
    return error, moved, fakes
"""


@pytest.mark.parametrize("kind, batch_size", [("LSTM", 32), ("LSTM", 128), ("GRU", 32), ("RNN", 32)])
def test_a_cudnn_rnn_is_refused_by_name_and_allocates_nothing(kernel, kind, batch_size):
    kernel.run(RNN)
    error, moved, fakes = kernel.value(f"rnn_step({kind!r}, {batch_size})")
    assert error is not None and f"nn.{kind} runs on cuDNN (aten._cudnn_rnn)" in error, error
    assert moved == 0, (kind, batch_size, moved)  # torch's peak did not move by a byte
    assert fakes == 0


SCALED = """\
import gc, sys, torch, gpuexp
from torch._subclasses.fake_tensor import FakeTensor
sys.path.insert(0, {bench!r})
import estimate as bench
torch.manual_seed(0)
device = torch.device("cuda")
def block(c_in, c_out, stride):
    return torch.nn.Sequential(torch.nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), torch.nn.BatchNorm2d(c_out),
                               torch.nn.ReLU(inplace=True))
model = torch.nn.Sequential(block(3, 64, 1), block(64, 64, 1), block(64, 128, 2), block(128, 128, 1),
                            block(128, 256, 2), block(256, 256, 1), torch.nn.AdaptiveAvgPool2d(1),
                            torch.nn.Flatten(), torch.nn.Linear(256, 100)).to(device, memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
scaler = torch.amp.GradScaler("cuda")
def step(bs):
    x = torch.randn(bs, 3, 64, 64, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, 100, (bs,), device=device)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
step(2)
def scaler_state():
    return [id(scaler._scale), scaler._scale.item(), id(scaler._growth_tracker), scaler._growth_tracker.item(),
            len(scaler._per_optimizer_states), isinstance(scaler._scale, FakeTensor)]
"""


def test_a_grad_scaler_step_is_estimated_within_5_percent_and_the_next_real_step_runs(kernel):
    kernel.run(SCALED.format(bench=str(BENCH)))
    for batch_size in (32, 128):
        kernel.run(f"before = scaler_state()\n"
                   f"result, seconds, allocated = bench.estimated(torch, gpuexp, step, {batch_size}, device)\n"
                   f"after = scaler_state()\n"
                   f"real = bench.measured_peak(torch, step, {batch_size}, device)")
        estimate, real, allocated = kernel.value("[result.peak, real, allocated]")
        assert abs(estimate - real) <= 0.05 * real, (batch_size, estimate, real)
        assert allocated == 0, (batch_size, allocated)
        assert kernel.value("after == before") is True, kernel.value("[before, after]")


# The bench's models, trained by a step that ends as most training loops do (issue 44, section 2).
ITEM_STEP = """\
workload = workloads[{name!r}]
model, opt = bench.workloads_of.fresh(torch, workload, device)
def train(bs):
    opt.zero_grad(set_to_none=True)
    inputs, targets = workload.batch(bs, device)
    loss = workload.loss(model, inputs, targets)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss
def item_step(bs):
    return train(bs).item()
def plain_step(bs):
    train(bs)
item_step(2)
"""


@pytest.mark.parametrize("name, batch_size", [("transformer", 32), ("attention", 32), ("mlp", 2048)])
def test_a_step_that_returns_loss_item_is_estimated_within_2_percent_of_its_real_peak(kernel, name, batch_size):
    kernel.run(MODELS + ITEM_STEP.format(name=name))
    kernel.run(f"result, seconds, allocated = bench.estimated(torch, gpuexp, item_step, {batch_size}, device)\n"
               f"without = gpuexp.estimate(plain_step, {batch_size}).peak\n"
               f"real = bench.measured_peak(torch, item_step, {batch_size}, device)")
    estimate, without, real, allocated = kernel.value("[result.peak, without, real, allocated]")
    assert estimate == without, (name, estimate, without)
    assert abs(estimate - real) <= 0.02 * real and allocated == 0, (name, batch_size, estimate, real, allocated)


def test_the_finder_starts_from_the_estimate_of_a_step_that_returns_loss_item(kernel):
    kernel.run(MODELS + ITEM_STEP.format(name="transformer"))
    kernel.run(f"found = gpuexp.find_batch_size(item_step, start=8, max=8192, limit={24 * GiB}, progress=False)")
    shown = kernel.run("print(found)").text
    assert "estimate under fake tensors at 8, 32" in shown and kernel.value("found.trials") <= 2, shown
