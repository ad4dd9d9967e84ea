"""What estimate, fit and verify's capture/restore leave as it was (issue 38, section 2): dict
subclasses put back through their own methods, every real tensor the step reaches faked while it
runs, rebound parameters and buffers, the four RNGs, Ctrl-C and the user's own errors, a step with
no module, a class passed as the step, and how many times each tool calls the step. In-process:
none of these needs a notebook."""

import collections
import itertools
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import gpuexp  # noqa: E402
from gpuexp import fit_apply  # noqa: E402

MODEL = """
import collections, random
import numpy as np
import torch
import gpuexp
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def step(bs):
    opt.zero_grad(set_to_none=True)
    loss = model(torch.randn(bs, 64)).sum()
    loss.backward()
    opt.step()
    return loss
"""


def namespace(extra=""):
    """A fresh module-like namespace with a model, an optimizer and `step`, plus `extra`."""
    names = {"__name__": "user_notebook"}
    exec(compile(MODEL + extra, "user_notebook.py", "exec"), names)  # noqa: S102
    return names


def host_peak_reset():
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def host_peak():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_a_modules_hook_dict_a_global_and_an_attribute_ordereddict_stay_whole():
    ns = namespace(
        "handles = []\n"
        "table = collections.OrderedDict(a=1)\n"
        "class Holder: pass\n"
        "holder = Holder(); holder.cache = collections.OrderedDict(x=1)\n"
        "def hooky(bs):\n"
        "    handles.append(model[0].register_forward_hook(lambda m, a, o: None))\n"
        "    table['b'] = 2; table.move_to_end('a')\n"
        "    holder.cache['y'] = 2; del holder.cache['x']\n"
        "    return step(bs)\n"
    )
    hooks = ns["model"][0]._forward_hooks
    gpuexp.estimate(ns["hooky"], 8)
    assert (len(hooks), list(hooks.items())) == (0, [])
    assert list(ns["table"].items()) == [("a", 1)]
    assert list(ns["holder"].cache.items()) == [("x", 1)]
    # The model still works, with a hook registered and called.
    called = []
    ns["model"][0].register_forward_hook(lambda m, a, o: called.append(1))
    ns["model"](torch.randn(2, 64))
    assert called == [1]
    gpuexp.fit(ns["hooky"], 8, limit="1TiB")
    assert list(ns["table"].items()) == [("a", 1)] and len(ns["model"][0]._forward_hooks) == 1


class Refusing(collections.OrderedDict):
    """Like transformers' ModelOutput: its mutating methods other than item assignment refuse."""

    def update(self, *args, **kwargs):
        raise RuntimeError("You cannot use ``update`` on a Refusing instance.")

    def __delitem__(self, key):
        raise RuntimeError("You cannot use ``__delitem__`` on a Refusing instance.")

    def pop(self, *args):
        raise RuntimeError("You cannot use ``pop`` on a Refusing instance.")


def test_a_subclass_whose_methods_refuse_is_put_back_through_ordereddicts_own_methods():
    ns = namespace("def keeps(bs):\n    out['loss'] = step(bs)\n    out['extra'] = 1\n    return out['loss']\n")
    ns["out"] = out = Refusing(logits=1)
    keeping = collections.defaultdict(list, a=[1])
    ns["keeping"] = keeping
    gpuexp.estimate(ns["keeps"], 8)
    assert list(out.items()) == [("logits", 1)] and type(out) is Refusing
    assert dict(keeping) == {"a": [1]} and keeping.default_factory is list


def test_real_tensors_the_step_only_reads_are_faked_nothing_computed_on_them():
    ns = namespace(
        "table = torch.ones(100 << 20)\n"
        "counter = torch.zeros((), dtype=torch.long)\n"
        "def uses_table(bs):\n"
        "    scaled = table * 2\n"
        "    counter.add_(1)\n"
        "    return step(bs) + scaled[0]\n"
    )
    table, counter = ns["table"], ns["counter"]
    version = counter._version
    host_peak_reset()
    before = host_peak()
    gpuexp.estimate(ns["uses_table"], 16)
    gpuexp.fit(ns["uses_table"], 16, limit="1TiB")
    assert host_peak() - before <= 16 << 20, (host_peak() - before) >> 20
    assert ns["counter"] is counter and counter.item() == 0 and counter._version == version
    assert ns["table"] is table


def test_a_closure_cells_tensor_is_faked_and_put_back():
    ns = namespace(
        "def make():\n"
        "    total = torch.zeros(3)\n"
        "    def accumulate(bs):\n"
        "        total.add_(1)\n"
        "        return step(bs)\n"
        "    return accumulate, lambda: total\n"
        "accumulate, total_of = make()\n"
    )
    total = ns["total_of"]()
    gpuexp.estimate(ns["accumulate"], 8)
    assert ns["total_of"]() is total and total.tolist() == [0.0, 0.0, 0.0]


def rngs():
    states = [torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tolist()]
    if torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state_all())
    return states


def same_rngs(a, b):
    return torch.equal(a[0], b[0]) and a[1] == b[1] and a[2] == b[2] and len(a) == len(b)


def test_all_four_rngs_are_as_before_after_estimate_fit_and_capture_restore():
    ns = namespace("def augments(bs):\n    random.random(); np.random.rand(3); torch.rand(2)\n    return step(bs)\n")
    before = rngs()
    gpuexp.estimate(ns["augments"], 8)
    assert same_rngs(rngs(), before)
    gpuexp.fit(ns["augments"], 8, limit="1TiB")
    assert same_rngs(rngs(), before)
    saved = fit_apply.capture(modules={"model": ns["model"]}, optimizers={"opt": ns["opt"]})
    ns["augments"](8)
    saved.restore()
    assert same_rngs(rngs(), before)


def test_restore_puts_back_a_rebound_buffer_and_a_replaced_parameter():
    ns = namespace()
    model = ns["model"]
    model.register_buffer("count", torch.zeros(()))
    count, weight = model.count, model[0].weight
    saved = fit_apply.capture(modules={"model": model})
    model.count = model.count + 1
    model[0].weight = torch.nn.Parameter(torch.zeros(64, 64))
    saved.restore()
    assert model.count is count and model.count.item() == 0
    assert model[0].weight is weight and model[0]._parameters["weight"] is weight


@pytest.mark.parametrize("interrupted_call", [1, 3])
def test_ctrl_c_leaves_estimate_and_fit_as_itself(interrupted_call):
    ns = namespace()
    # A counter kept in C: estimate puts back the containers the step reaches, not an iterator.
    calls = itertools.count(1)

    def interrupting(bs):
        if next(calls) == interrupted_call:
            raise KeyboardInterrupt
        return ns["step"](bs)

    if interrupted_call == 1:
        with pytest.raises(KeyboardInterrupt):
            gpuexp.estimate(interrupting, 8)
        calls = itertools.count(1)
    with pytest.raises(KeyboardInterrupt):
        gpuexp.fit(interrupting, 8, limit="1TiB")
    assert next(calls) == interrupted_call + 1


def test_system_exit_leaves_estimate_as_itself():
    def exiting(bs):
        raise SystemExit(3)

    with pytest.raises(SystemExit):
        gpuexp.estimate(exiting, 8)


def test_the_users_own_error_leads_the_message_at_its_file_and_line():
    ns = namespace("def lookup(bs):\n    step(bs)\n    return {}['missing']\n")
    with pytest.raises(gpuexp.NoEstimate) as raised:
        gpuexp.estimate(ns["lookup"], 8)
    message = str(raised.value)
    assert message.startswith("KeyError: 'missing' at user_notebook.py:"), message
    line = int(message.split("user_notebook.py:")[1].split(";")[0])
    assert (MODEL + "def lookup").count("\n") + 3 == line, message
    assert isinstance(raised.value.__cause__, KeyError)


def test_fit_of_a_step_that_reaches_no_module_skips_checkpointing_by_name():
    names = {}
    exec("import torch\ndef plain(bs):\n    return (torch.randn(bs, 100) @ torch.randn(100, 100)).sum()\n", names)  # noqa: S102
    report = gpuexp.fit(names["plain"], 8, limit="1TiB").to_dict()
    assert "activation checkpointing: not offered: the step reaches no torch.nn.Module" in report["notes"], report
    assert report["options"], "the other options are offered all the same"


@pytest.mark.parametrize("tool", [gpuexp.fit, gpuexp.estimate])
def test_a_class_passed_as_the_step_is_refused_with_the_fix(tool):
    with pytest.raises(TypeError, match=r"got the class Sequential.*def train_step\(batch_size\)"):
        tool(torch.nn.Sequential, 8)


def test_how_many_times_each_tool_calls_the_step():
    """Counted by an iterator kept in C, which the estimate does not rewind (its docs say so)."""
    extra = "import itertools\ncalls = itertools.count()\ndef counted(bs):\n    next(calls)\n    return step(bs)\n"
    ns = namespace(extra)
    gpuexp.estimate(ns["counted"], 8)
    assert next(ns["calls"]) == 1, "SGD without momentum creates no optimizer state: one call"
    adam = namespace("opt = torch.optim.Adam(model.parameters())\n" + extra)
    gpuexp.estimate(adam["counted"], 8)
    assert next(adam["calls"]) == 1, "once by default, saying that the call created Adam's state"
    gpuexp.estimate(adam["counted"], 8, steps=3)
    assert next(adam["calls"]) == 4, "the first call created Adam's state, the second none: two calls"
    ns = namespace(extra)
    gpuexp.fit(ns["counted"], 8, limit="1TiB")
    assert 2 <= next(ns["calls"]) <= 8


@pytest.mark.gpu
@pytest.mark.parametrize("interrupted_call", [1, 2])
def test_ctrl_c_leaves_find_batch_size_as_itself(interrupted_call):
    """The finder seeds from at least two estimates (one call each: SGD without momentum makes no
    state), which fall back to trials on a NoEstimate; an interrupt in either stops it."""
    ns = namespace("model.cuda()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n")
    calls = itertools.count(1)

    def interrupting(bs):
        if next(calls) == interrupted_call:
            raise KeyboardInterrupt
        opt = ns["opt"]
        opt.zero_grad(set_to_none=True)
        ns["model"](torch.randn(bs, 64, device="cuda")).sum().backward()
        opt.step()

    with pytest.raises(KeyboardInterrupt):
        gpuexp.find_batch_size(interrupting, start=8, progress=False)
    assert next(calls) == interrupted_call + 1


@pytest.mark.gpu
def test_a_real_gpu_counter_the_step_reaches_is_not_changed_by_a_gpu_estimate():
    ns = namespace(
        "model.cuda()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "counter = torch.zeros((), dtype=torch.long, device='cuda')\nhost_counter = torch.zeros((), dtype=torch.long)\n"
        "def counts(bs):\n    counter.add_(1); host_counter.add_(1)\n"
        "    opt.zero_grad(set_to_none=True)\n"
        "    model(torch.randn(bs, 64, device='cuda')).sum().backward()\n    opt.step()\n"
    )
    gpuexp.estimate(ns["counts"], 8, device="cuda:0")
    gpuexp.fit(ns["counts"], 8, device="cuda:0", limit="1TiB")
    assert ns["counter"].item() == 0 and ns["host_counter"].item() == 0
