"""gpuexp.checkpointed and the state verify restores, on the CPU in real kernels: checkpointing
changes what is saved for backward and nothing else, and is undone exactly; a real step's every
change (parameters, gradients, buffers, optimizer state and counters, schedulers, RNG) is put
back to the bit, and what can't be put back is named with its value kept."""

from test_estimate import FINGERPRINT, SETUP

TRANSFORMER = """\
import torch, gpuexp
torch.manual_seed(0)
layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.1)
model = torch.nn.Sequential(torch.nn.Embedding(100, 64),
                            torch.nn.TransformerEncoder(layer, 3, enable_nested_tensor=False),
                            torch.nn.Linear(64, 100))
hooked = []
hook = model[1].layers[0].register_forward_hook(lambda m, i, o: hooked.append(1))
x = torch.randint(0, 100, (8, 32))
def run():
    saved = []
    def pack(t):
        saved.append(t.untyped_storage().nbytes())
        return t
    torch.manual_seed(1)  # dropout draws the same masks in both runs
    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    out.sum().backward()
    return out.detach().clone(), [p.grad.clone() for p in model.parameters()], sum(saved)
def shape():
    return {
        "modules": [(n, id(m), sorted(m.__dict__)) for n, m in model.named_modules()],
        "hooks": [(id(m._forward_hooks), list(m._forward_hooks)) for m in model.modules()],
        "keys": list(model.state_dict()),
        "forward": [type(m).forward is getattr(m.forward, "__func__", None) for m in model.modules()],
    }
"""


def test_checkpointed_blocks_give_the_same_outputs_and_grads_and_save_less(kernel):
    kernel.run(TRANSFORMER + "before = shape()\nplain = run()")
    kernel.run("with gpuexp.checkpointed(model, ['1.layers.0', '1.layers.1']) as wrapped:\n"
               "    inside = shape()\n"
               "    checked = run()")
    assert kernel.value("wrapped is model") is True
    assert kernel.value("torch.equal(plain[0], checked[0])") is True
    assert kernel.value("all(torch.equal(a, b) for a, b in zip(plain[1], checked[1]))") is True
    plain_saved, checked_saved = kernel.value("[plain[2], checked[2]]")
    assert checked_saved < 0.75 * plain_saved, (plain_saved, checked_saved)  # two of three layers recomputed
    assert kernel.value("hooked") == [1, 1]  # the hook ran once per call: not again in the recompute
    assert kernel.value("inside['forward'] != before['forward']") is True  # it really wrapped them
    assert kernel.value("shape() == before") is True
    assert kernel.value("run()[2] == plain[2]") is True


def test_batch_norms_update_their_running_statistics_once_as_without_checkpointing(kernel):
    kernel.run("import torch, gpuexp\ntorch.manual_seed(0)\n"
               "net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Sequential(\n"
               "    torch.nn.Conv2d(8, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()), torch.nn.Flatten(),\n"
               "    torch.nn.Linear(8 * 8 * 8, 2))\n"
               "x = torch.randn(4, 3, 12, 12)\n"
               "start = {k: v.clone() for k, v in net.state_dict().items()}\n"
               "def run():\n"
               "    net.load_state_dict(start)\n"
               "    net.zero_grad(set_to_none=True)\n"
               "    net(x).sum().backward()\n"
               "    state = {k: v.clone() for k, v in net.state_dict().items()}\n"
               "    return state, [p.grad.clone() for p in net.parameters()]\n"
               "plain = run()\n"
               "with gpuexp.checkpointed(net, ['1']):\n"
               "    checked = run()")
    assert kernel.value("all(torch.equal(plain[0][k], checked[0][k]) for k in plain[0])") is True
    assert kernel.value("all(torch.equal(a, b) for a, b in zip(plain[1], checked[1]))") is True
    assert kernel.value("[net[1][1].momentum, int(net[1][1].num_batches_tracked)]") == [0.1, 1]


def test_a_transformers_layer_writes_no_kv_cache_twice(kernel):
    # Its recompute would write the cache again (twice the length), as transformers' own switch avoids.
    kernel.run("import torch, gpuexp, transformers\ntorch.manual_seed(0)\n"
               "config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32)\n"
               "gpt = transformers.GPT2LMHeadModel(config).train()\n"
               "tokens = torch.randint(0, 100, (2, 16))\n"
               "def run():\n"
               "    torch.manual_seed(1)\n"
               "    gpt.zero_grad(set_to_none=True)\n"
               "    out = gpt(input_ids=tokens, labels=tokens, use_cache=True)\n"
               "    out.loss.backward()\n"
               "    return out, [p.grad.clone() for p in gpt.parameters()]\n"
               "plain, plain_grads = run()\n"
               "with gpuexp.checkpointed(gpt, ['transformer.h.0', 'transformer.h.1']):\n"
               "    checked, checked_grads = run()")
    assert kernel.value("torch.equal(plain.loss, checked.loss)") is True
    assert kernel.value("all(torch.equal(a, b) for a, b in zip(plain_grads, checked_grads))") is True
    assert kernel.value("checked.past_key_values.get_seq_length()") in (0, 16)  # never 32


def test_it_is_undone_when_the_block_raises_and_an_own_forward_comes_back(kernel):
    kernel.run(TRANSFORMER + "before = shape()\n"
               "own = lambda *a, **k: type(model[2]).forward(model[2], *a, **k)\n"
               "model[2].forward = own")
    failed = kernel.run("with gpuexp.checkpointed(model, ['2', '1.layers.2']):\n"
                        "    raise KeyError('in the block')", expect_error=True)
    assert failed.error.startswith("KeyError"), failed.error
    assert kernel.value("model[2].forward is own") is True
    assert kernel.value("'forward' not in model[1].layers[2].__dict__") is True


def test_unknown_or_nested_paths_are_refused_with_the_closest_names_and_nothing_is_wrapped(kernel):
    kernel.run(TRANSFORMER + "before = shape()")
    for paths, error in [
        ("['1.layers.0', '1.layer.1']", "ValueError: Sequential has no submodule '1.layer.1' (closest: 1.layers.1, "),
        ("['1', '1.layers.0']", "ValueError: '1.layers.0' is inside '1': checkpointing both would recompute"),
        ("[]", "TypeError: paths must be a non-empty list of submodule names"),
        ("[3]", "TypeError: paths must be a non-empty list of submodule names"),
    ]:
        failed = kernel.run(f"with gpuexp.checkpointed(model, {paths}):\n    pass", expect_error=True)
        assert failed.error.startswith(error), (paths, failed.error)
    failed = kernel.run("with gpuexp.checkpointed(model.state_dict(), ['1']):\n    pass", expect_error=True)
    assert failed.error.startswith("TypeError: checkpointed() takes a torch.nn.Module"), failed.error
    assert kernel.value("shape() == before") is True


STEPS = """\
from gpuexp.fit_apply import capture
import random
scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
def real_step(bs):
    step(bs)
    scheduler.step()
real_step(4)
def everything():
    return (fingerprint(), scheduler.last_epoch, scheduler.get_last_lr(), opt.param_groups[0]['lr'],
            random.random(), [t.data_ptr() for t in model.parameters()])
"""


def test_a_real_step_is_put_back_to_the_bit_into_the_same_objects(kernel):
    kernel.run(SETUP + FINGERPRINT + STEPS)
    # Read twice from the same RNG state: each read draws from Python's random.
    kernel.run("random.seed(5)\nbefore = everything()\nrandom.seed(5)\n"
               "saved = capture(modules={'model': model}, optimizers={'opt': opt}, objects={'scheduler': scheduler})")
    kernel.run("real_step(32)\nreal_step(32)\nmodel.eval()\nrandom.random()")
    assert kernel.value("fingerprint()['params'] != before[0]['params']") is True  # the steps did change them
    kernel.run("saved.restore()")
    assert kernel.value("everything() == before") is True
    kernel.run("real_step(4)")  # and it trains on from there
    assert kernel.value("fingerprint()['params'] != before[0]['params']") is True


def test_state_a_first_step_creates_is_taken_away_again(kernel):
    kernel.run("import torch, gpuexp\nfrom gpuexp.fit_apply import capture\n"
               "model = torch.nn.Linear(64, 64)\nopt = torch.optim.Adam(model.parameters())\n"
               "state, groups = opt.state, opt.param_groups\n"
               "saved = capture(modules=[model], optimizers=[opt])\n"
               "model(torch.randn(4, 64)).sum().backward()\nopt.step()")
    assert kernel.value("len(opt.state)") == 2
    kernel.run("saved.restore()")
    assert kernel.value("[len(opt.state), model.weight.grad is None, opt.state is state, "
                        "opt.param_groups is groups]") == [0, True, True, True]


def test_what_cannot_be_put_back_is_named_and_its_value_kept_and_the_rest_restored(kernel):
    kernel.run("import torch, gpuexp\nfrom gpuexp.fit_apply import capture\n"
               # A dict subclass whose methods refuse is put back through dict's; a list's cannot be.
               "class Locked(list):\n"
               "    def clear(self):\n"
               "        raise TypeError('this table is locked')\n"
               "class Config:\n"
               "    def __init__(self):\n"
               "        self.table = Locked([0.1])\n"
               "config = Config()\n"
               "model = torch.nn.Linear(8, 8)\n"
               "with torch.inference_mode():\n"
               "    model.register_buffer('frozen', torch.arange(4.0))  # in-place only in inference mode\n"
               "weight = model.weight.detach().clone()\n"
               "saved = capture(modules={'model': model}, objects={'config': config})\n"
               "with torch.no_grad():\n"
               "    model.weight.add_(1)\n"
               "with torch.inference_mode():\n"
               "    model.frozen.mul_(2)\n"
               "config.table.append(0.5)")
    failed = kernel.run("try:\n    saved.restore()\nexcept Exception as e:\n    error = e\n    raise",
                        expect_error=True)
    assert failed.error.startswith("RestoreFailed: verify could not put back 1 piece(s) of state"), failed.error
    assert "config.table (TypeError: this table is locked)" in failed.error, failed.error
    assert kernel.value("error.saved") == {"config.table": [0.1]}
    assert kernel.value("[torch.equal(model.weight, weight), model.frozen.tolist()]") == [True, [0.0, 1.0, 2.0, 3.0]]


def test_a_tensor_in_a_container_too_long_for_an_estimates_walk_gets_its_value_back(kernel):
    # An estimate walks no container's items past 10,000; verify's by-value save walks them all.
    kernel.run("import torch\nfrom gpuexp.fit_apply import capture\n"
               "class Bank:\n"
               "    def __init__(self):\n"
               "        self.rows = [torch.zeros(2) for _ in range(10_001)]\n"
               "bank = Bank()\n"
               "last = bank.rows[-1]\n"
               "saved = capture(objects={'bank': bank})\n"
               "last.add_(1)\n"
               "saved.restore()")
    assert kernel.value("[bank.rows[-1] is last, last.tolist()]") == [True, [0.0, 0.0]]


def test_verify_without_a_gpu_says_why(kernel):
    kernel.run(SETUP)
    failed = kernel.run("gpuexp.fit_apply.verify(step, 8, 'autocast', modules=[model], optimizers=[opt])",
                        expect_error=True)
    assert failed.error.startswith("RuntimeError: verify runs the step for real on a GPU"), failed.error
    assert "torch.cuda.is_available() is False" in failed.error
    # A bad list of modules to time fails first, naming the fix.
    failed = kernel.run("gpuexp.fit_apply.verify(step, 8, time_forwards=model)", expect_error=True)
    assert failed.error.startswith("TypeError: time_forwards is (model, ['layers.0', ...])"), failed.error
    failed = kernel.run("gpuexp.fit_apply.verify(step, 8, time_forwards=(model, ['nope']))", expect_error=True)
    assert failed.error.startswith("ValueError:") and "has no submodule 'nope'" in failed.error, failed.error


def test_without_torch_they_say_to_import_it(kernel):
    kernel.run("import gpuexp, sys")
    for call in ("gpuexp.fit_apply.capture()", "gpuexp.checkpointed(None, ['a']).__enter__()"):
        failed = kernel.run(call, expect_error=True)
        assert failed.error.startswith("RuntimeError") and "import torch" in failed.error, failed.error
    assert kernel.value("'torch' in sys.modules") is False


def test_a_gradient_the_step_drops_is_freed_during_the_step_and_comes_back_after(kernel):
    # verify measures the step's peak: the saved gradient must not hold its memory meanwhile.
    kernel.run("import torch, weakref, gpuexp\nfrom gpuexp.fit_apply import capture\n"
               "model = torch.nn.Linear(256, 256)\nmodel(torch.randn(4, 256)).sum().backward()\n"
               "grad, value = model.weight.grad, model.weight.grad.clone()\n"
               "storage = weakref.ref(grad.untyped_storage())\n"
               "address = grad.data_ptr()\n"
               "saved = capture(modules={'model': model})")
    assert kernel.value("[model.weight.grad is not grad, model.weight.grad.data_ptr() == address, grad.numel(), "
                        "storage() is not None]") == [True, True, 0, True]
    kernel.run("model.zero_grad(set_to_none=True)\nimport gc; gc.collect()")
    assert kernel.value("model.weight.grad is None and storage() is None") is True  # the step freed it
    kernel.run("model(torch.randn(4, 256)).sum().backward()\nsaved.restore()")
    assert kernel.value("model.weight.grad is grad and torch.equal(grad, value)") is True
