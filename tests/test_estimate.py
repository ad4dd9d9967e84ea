"""gpuexp.estimate on the CPU, in real kernels: a step run under fake tensors leaves the model,
its gradients and the optimizer state exactly as they were, and says so when it can't run."""

import pytest

SETUP = """\
import time
import torch
import gpuexp
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.BatchNorm1d(256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
def step(bs):
    opt.zero_grad(set_to_none=True)
    x, y = torch.randn(bs, 512), torch.randint(0, 10, (bs,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
step(4)  # optimizer state and gradients exist
"""

# Everything a step could change, to the bit: values (as integers), object identity and autograd's
# version counters.
FINGERPRINT = """\
def fingerprint():
    def bits(t):
        return t.detach().reshape(-1).view(torch.int32 if t.element_size() == 4 else torch.int64).tolist()
    state = {}
    for i, (p, s) in enumerate(opt.state.items()):
        state[i] = {k: (bits(v), v._version, id(v)) if torch.is_tensor(v) else v for k, v in s.items()}
    return {
        "params": [(n, bits(p), p._version, id(p)) for n, p in model.named_parameters()],
        "grads": [(bits(p.grad), p.grad._version, id(p.grad)) for p in model.parameters()],
        "buffers": [(n, bits(b), b._version, id(b)) for n, b in model.named_buffers()],
        "state": state,
        "state_object": id(opt.state),
        "groups": [(id(g), id(g["params"]), [id(p) for p in g["params"]], g["lr"], g["foreach"])
                   for g in opt.param_groups],
        "training": model.training,
        "rng": torch.get_rng_state().tolist(),
    }
"""

TRANSFORMER = """\
layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True)
lm = torch.nn.Sequential(torch.nn.Embedding(4096, 256), torch.nn.TransformerEncoder(layer, 2),
                         torch.nn.Flatten(), torch.nn.LazyLinear(10))
lm(torch.randint(0, 4096, (2, 128)))
lm_opt = torch.optim.AdamW(lm.parameters())
def lm_step(bs):
    x, y = torch.randint(0, 4096, (bs, 128)), torch.randint(0, 10, (bs,))
    torch.nn.functional.cross_entropy(lm(x), y).backward()
    lm_opt.step()
    lm_opt.zero_grad(set_to_none=True)
lm_step(2)
"""


def test_the_model_gradients_buffers_and_optimizer_state_are_untouched_to_the_bit(kernel):
    kernel.run(SETUP + FINGERPRINT + "before = fingerprint()\n"
               "import torch._subclasses.fake_tensor as fake_tensor\nprobe = fake_tensor.init_gpu_context")
    kernel.run("estimated = gpuexp.estimate(step, 64)")
    assert kernel.value("fingerprint() == before") is True
    # Fake tensors' GPU probe, quieted while the step ran, is torch's own again.
    assert kernel.value("fake_tensor.init_gpu_context is probe") is True
    assert kernel.value("estimated.peak") > 0
    kernel.run("step(4)")  # the real step still trains the real model
    assert kernel.value("fingerprint()['params'] != before['params']") is True


def test_a_transformer_encoder_model_is_estimated_in_well_under_two_seconds(kernel):
    kernel.run(SETUP + TRANSFORMER)
    found = kernel.value(
        "[(e.peak, e.seconds, e.to_dict()['categories']) for e in (gpuexp.estimate(lm_step, 16), "
        "gpuexp.estimate(lm_step, 64))]"
    )
    (small, small_s, categories), (large, large_s, _) = found
    assert 0 < small < large
    assert 3.5 < large / small < 4.1, (small, large)  # activations grow with the batch
    assert max(small_s, large_s) < 2.0
    params = kernel.value("sum(p.numel() * 4 for p in lm.parameters())")
    assert categories["parameters"] == params
    assert categories["optimizer_state"] >= 2 * params
    assert categories["activations"] > 0


def test_a_known_allocation_pattern_gives_its_exact_peak(kernel):
    kernel.run(
        "import torch, gpuexp\n"
        "def step(bs):\n"
        "    a = torch.empty(bs, 1024)\n"
        "    b = torch.empty(bs, 2048)\n"
        "    del a\n"
        "    c = b[:, :10].clone()\n"
        "    b.add_(1)\n"
        "    return b.view(-1)"
    )
    found = kernel.value("gpuexp.estimate(step, 8).to_dict()")
    assert found["peak"] == 8 * (1024 + 2048) * 4  # a and b alive together; views and in-place make nothing
    assert found["categories"]["temporaries"] == 8 * 1024 * 4  # a: freed within the step
    assert found["categories"]["activations"] == 8 * 2048 * 4  # b: its output


@pytest.mark.parametrize("body, operator", [
    ("return torch.nonzero(torch.randn(bs, 10) > 0)", "aten.nonzero"),
    ("return model(torch.randn(bs, 512)).sum().item()", "aten._local_scalar_dense"),
])
def test_an_operator_that_cannot_run_under_fake_tensors_is_named_and_no_estimate_is_made(kernel, body, operator):
    kernel.run(SETUP + FINGERPRINT + "before = fingerprint()")
    kernel.run(f"def bad(bs):\n    {body}")
    failed = kernel.run("gpuexp.estimate(bad, 8)", expect_error=True)
    assert failed.error.startswith("NoEstimate: no estimate was made"), failed.error
    assert operator in failed.error, failed.error
    assert kernel.value("fingerprint() == before") is True


def test_a_parameter_the_step_reaches_in_no_module_stops_the_estimate(kernel):
    kernel.run(
        "import torch, gpuexp\n"
        "def make():\n"
        "    w = torch.randn(64, 64, requires_grad=True)\n"
        "    return w, lambda bs: (torch.randn(bs, 64) @ w).sum().backward()\n"
        "w, bare = make()"
    )
    failed = kernel.run("gpuexp.estimate(bare, 8)", expect_error=True)
    assert "requires grad" in failed.error and "no estimate was made" in failed.error, failed.error
    assert kernel.value("w.grad is None") is True


def test_it_answers_whether_it_fits_a_limit(kernel):
    kernel.run(SETUP)
    kernel.run("small = gpuexp.estimate(step, 64, limit='1MiB')\nlarge = gpuexp.estimate(step, 64, limit=1 << 50)")
    assert kernel.value("[small.fits_limit, large.fits_limit, small.fits_free_memory]") == [False, True, True]
    text = kernel.run("print(small)").text
    assert "fits in 1.00 MiB of host memory: no, " in text and "short" in text, text
    assert "gpuexp · estimate · step(64) on cpu" in text
    for label in ("parameters", "buffers", "gradients", "optimizer state", "activations and saved tensors"):
        assert f"│ {label} " in text, (label, text)
    assert "<table>" in kernel.run("small").html
    keys = kernel.value("sorted(small.to_dict()['categories'])")
    assert keys == ["activations", "buffers", "gradients", "optimizer_state", "parameters", "temporaries"]


def test_a_second_call_shows_the_state_the_first_one_created(kernel):
    kernel.run(
        "import torch, gpuexp\n"
        "model = torch.nn.Linear(1024, 1024)\n"
        "opt = torch.optim.Adam(model.parameters())\n"
        "def step(bs):\n"
        "    model(torch.randn(bs, 1024)).sum().backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()"
    )
    once = kernel.value("gpuexp.estimate(step, 8).to_dict()")
    twice = kernel.value("gpuexp.estimate(step, 8, steps=2).to_dict()")
    assert once["steps"] == 1 and "steps=2" in once["notes"][0]
    assert twice["steps"] == 2
    state = 2 * (1024 * 1024 + 1024) * 4
    assert twice["categories"]["optimizer_state"] >= state
    assert kernel.value("len(opt.state)") == 0  # the real optimizer never got state


def test_bad_arguments_get_clear_errors(kernel):
    kernel.run(SETUP)
    for call, error in [
        ("gpuexp.estimate(42, 8)", "TypeError: step must be a function of the batch size"),
        ("gpuexp.estimate(step, 0)", "ValueError: batch_size must be a positive int"),
        ("gpuexp.estimate(step, True)", "ValueError: batch_size must be a positive int"),
        ("gpuexp.estimate(step, 8, limit='lots')", "ValueError: \"lots\" is not a memory size"),
        ("gpuexp.estimate(step, 8, steps=0)", "ValueError: batch_size=8, steps=0"),
    ]:
        failed = kernel.run(call, expect_error=True)
        assert failed.error.startswith(error), (call, failed.error)


def test_without_torch_it_says_to_import_it(kernel):
    kernel.run("import gpuexp")
    failed = kernel.run("gpuexp.estimate(lambda bs: None, 8)", expect_error=True)
    assert failed.error.startswith("RuntimeError") and "import torch" in failed.error
