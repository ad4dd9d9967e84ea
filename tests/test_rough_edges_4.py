"""Issue 38's rough edges (sections 4 and 5), one test each, in a real IPython kernel:
checkpointed's keywords and overlaps, arguments refused with a named fix, and fit's text."""

import pytest

from kernel import error_of, module_kernel

SETUP = """\
import threading
import torch
import gpuexp
from gpuexp import GPUExperiment
"""

BLOCKS = """\
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
    def forward(self, x, *, debug=False, preserve_rng_state=1.0, early_stop=0.0, determinism_check=0.0,
                context_fn=None, use_reentrant=None):
        out = self.linear(x) * preserve_rng_state + early_stop + determinism_check
        return out * 2 if debug else out + (0 if context_fn is None else 5) + (0 if use_reentrant is None else 7)
torch.manual_seed(0)
model = torch.nn.Sequential(Block(), Block())
x = torch.randn(2, 4, requires_grad=True)
KEYWORDS = dict(debug=True, preserve_rng_state=3.0, early_stop=0.5, determinism_check=0.25)
def outputs():
    return [model[0](x, **KEYWORDS), model[0](x, context_fn=1, use_reentrant=True), model(x)]
def same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b))
plain = outputs()
"""


shared = module_kernel(SETUP)


# ---- checkpointed (section 4) ---------------------------------------------------------------


def test_a_checkpointed_blocks_own_keywords_reach_the_block(kernel):
    kernel.run(SETUP + BLOCKS)
    kernel.run("with gpuexp.checkpointed(model, ['0', '1']):\n    wrapped = outputs()\n"
               "    wrapped[0].sum().backward()")
    assert kernel.value("same(plain, wrapped)"), "debug, preserve_rng_state... went to the block, not checkpoint"
    assert kernel.value("x.grad is not None")


def test_a_second_checkpointed_over_a_wrapped_module_names_the_open_one(kernel):
    kernel.run(SETUP + BLOCKS)
    kernel.run("first = gpuexp.checkpointed(model, ['0'])\nfirst.__enter__()")
    for paths in ("['0']", "['']", "'0.linear'"):
        error = error_of(kernel, f"gpuexp.checkpointed(model, {paths}).__enter__()")
        assert error.startswith("ValueError") and "checkpointed(Sequential, ['0'])" in error, error
        assert "exit that block first" in error, error
    kernel.run("second = gpuexp.checkpointed(model, ['1'])\nsecond.__enter__()")
    kernel.run("first.__exit__(None, None, None)\nsecond.__exit__(None, None, None)")  # out of order
    assert kernel.value("[name for name, m in model.named_modules() if 'forward' in m.__dict__]") == []
    assert kernel.value("same(plain, outputs())")
    kernel.run("with gpuexp.checkpointed(model, ['0']):\n    pass")  # the modules are free again


def test_checkpointed_on_two_threads_leaves_no_wrapper(kernel):
    kernel.run(SETUP + BLOCKS)
    kernel.run("""\
entered, leave, errors = threading.Event(), threading.Event(), []
def hold():
    with gpuexp.checkpointed(model, ['0', '1']):
        entered.set()
        leave.wait(30)
holder = threading.Thread(target=hold)
holder.start()
entered.wait(30)
try:
    with gpuexp.checkpointed(model, ['1']):
        pass
except ValueError as error:
    errors.append(str(error))
leave.set()
holder.join(30)
""")
    assert len(kernel.value("errors")) == 1, "the second, on another thread, is refused"
    assert kernel.value("[name for name, m in model.named_modules() if 'forward' in m.__dict__]") == []
    assert kernel.value("same(plain, outputs())")


def test_checkpointed_of_bytes_shows_the_value_as_given(kernel):
    kernel.run(SETUP + BLOCKS)
    error = error_of(kernel, "gpuexp.checkpointed(model, b'0').__enter__()")
    assert error.startswith("TypeError") and "got b'0'" in error, error


# ---- arguments refused with the fix (section 5) ---------------------------------------------


@pytest.mark.parametrize("call, named", [
    ("GPUExperiment(devices=2**70)", "devices=1180591620717411303424"),
    ("GPUExperiment(devices=1.5)", "devices=1.5"),
    ("GPUExperiment(devices=[0, 0])", "names GPU 0 twice"),
    ("GPUExperiment(cell_log='yes')", "cell_log must be True or False"),
    ("gpuexp.holders(2**70)", "device=1180591620717411303424"),
    ("gpuexp.holders(min_bytes=2**70)", "min_bytes=1180591620717411303424"),
    ("gpuexp.holders(1.5)", "device=1.5"),
    ("gpuexp.find_batch_size(lambda bs: None, start='8')", "start must be a positive int"),
    ("gpuexp.find_batch_size(lambda bs: None, verifications=-1)", "verifications is how often"),
    ("gpuexp.find_batch_size(lambda bs: None, want=-1)", "want must be a positive int"),
    ("gpuexp.find_batch_size(lambda bs: None, device='cpu')", "find_batch_size(device='cpu')"),
    ("gpuexp.fit(lambda bs: None, 2**64)", "batch_size=18446744073709551616 is past what any step runs"),
])
def test_a_bad_argument_is_a_value_error_naming_it(shared, call, named):
    error = error_of(shared, call)
    assert error.startswith("ValueError") and named in error, error
    assert "devices=" not in error or "devices" in call, f"says the keyword the call took: {error}"
    assert not shared.value("gpuexp._core.open_experiments()")


def test_fit_answers_where_estimate_does_at_a_huge_batch(shared):
    shared.run("""\
wide = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096))
sgd = torch.optim.SGD(wide.parameters(), 0.1)
def wide_step(bs):
    wide(torch.randn(bs, 4096)).sum().backward()
    sgd.step()
    sgd.zero_grad()
""")
    assert shared.value("gpuexp.estimate(wide_step, 2**40, device='cpu').peak") > 2**56
    report = shared.run("fitted = gpuexp.fit(wide_step, 2**40, device='cpu')\nprint(fitted)")
    assert "step(1099511627776)" in report.text, report.text
    assert shared.value("fitted.to_dict()['step_flops']") > 2**64, "the FLOPs past 2**64 are counted, not refused"


def test_an_estimate_of_a_meta_model_mixing_meta_tensors_names_the_fix(shared):
    shared.run("""\
with torch.device('meta'):
    planned = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
planned_device = next(planned.parameters()).device
meta_mask = torch.ones(64, device='meta')
def made_on_meta(bs):
    planned(torch.randn(bs, 64, device=planned_device)).sum().backward()
def reads_meta(bs):
    planned(torch.randn(bs, 64) * meta_mask).sum().backward()
def made_where_estimated(bs):
    planned(torch.randn(bs, 64)).sum().backward()
""")
    for step in ("made_on_meta", "reads_meta"):
        error = error_of(shared, f"gpuexp.estimate({step}, 8, device='cpu')")
        assert error.startswith("NoEstimate: no estimate was made: the step mixes a tensor on the meta device"), error
        assert "model.to_empty(device='cpu')" in error and "device='cpu'" in error, error
        assert "FakeTensorDeviceMismatchError" not in error, error
    assert shared.value("gpuexp.estimate(made_where_estimated, 8, device='cpu').peak") > 0


# ---- fit's text -----------------------------------------------------------------------------

FIT_STEP = """\
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4096, 4096), {norm}torch.nn.ReLU(), torch.nn.Linear(4096, 4096))
sgd = torch.optim.SGD(net.parameters(), 0.1)
def train(bs):
    net(torch.randn(bs, 4096)).sum().backward()
    sgd.step()
    sgd.zero_grad()
text = str(gpuexp.fit(train, 2**40, device='cpu'))
"""


def test_fit_gives_the_largest_batch_once_and_batchnorm_only_where_there_is_one(shared):
    shared.run(FIT_STEP.format(norm=""))
    text = shared.value("text")
    assert "the largest that fits as the step is" in text, text
    assert "the largest batch that fits as the step is: about" not in text, "said twice: " + text
    assert "accumulate gradients" in text, text
    assert "BatchNorm" not in text, text
    shared.run(FIT_STEP.format(norm="torch.nn.BatchNorm1d(4096), "))
    text = shared.value("text")
    assert "BatchNorm sees" in text, text


# ---- section 6: what a newcomer reads ---------------------------------------------------------


def test_the_returned_classes_import_from_gpuexp_and_config_documents_host_peak(shared):
    for name in ("BatchSizeResult", "Holders", "OomDiagnosis", "Ranks"):
        assert shared.value(f"gpuexp.{name} is gpuexp._core.{name} and {name!r} in gpuexp.__all__"), name
    assert shared.value("'host_peak' in gpuexp.config() and 'host_peak' in gpuexp.config.__doc__")
