"""The one mechanism that saves and restores what a step reaches (issue 38, section 2, "The
structural fix"): the core's step_state (rust/src/step_state.rs, its Python objects in
rust/src/bindings/instrumentation/step_state.rs) saves the RNGs, the places the step's roots are
held in, the containers the fakes go into and every container it reaches, for estimate, fit and
verify's capture alike (verify's by value: rust/src/bindings/instrumentation/saved_step.rs, each
tensor copied by tensor_values.py); step_roots.py is the one walk of a step's closure and
globals. A source check fails on a second copy; the refusal of a free tensor that requires grad
names its path."""

import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import gpuexp  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# An RNG saved or put back: torch's, CUDA's, Python's, NumPy's, or torch's fork of them.
RNG_SAVE = re.compile(r"\b(get|set)_rng_state|random\.(get|set)_?state\b|[\"'](get|set)_?state[\"']|\bfork_rng\b")
# A walk of a function's closure or of the globals its code loads.
CLOSURE_WALK = re.compile(r"__closure__|co_freevars|__globals__|LOAD_GLOBAL")
# A walk of containers, or a container put back, in Python: items or indices gone through, a
# value told apart by its container type, a container refilled.
CONTAINER_WALK = re.compile(
    r"\.items\(\)|\.values\(\)|\benumerate\(|isinstance\([^)]*\b(dict|list|tuple|set)\b|\.clear\(\)|\[:\]\s*="
)
# verify's save, which the core's by-value saving walks for: the files that must not walk themselves.
BY_VALUE_SAVE = ("python/gpuexp/saved_state.py", "python/gpuexp/tensor_values.py")

ALLOWED = {
    # The four RNGs read and set for the core's state saving (its order: rust/src/step_state.rs).
    RNG_SAVE: {"rust/src/bindings/instrumentation/rngs.rs"},
    CLOSURE_WALK: {
        # The roots of a step: its closure, the globals its code loads and assigns.
        "python/gpuexp/step_roots.py",
        # The one state saving's walk, which reaches a function's closure.
        "rust/src/bindings/instrumentation/step_state.rs",
        # The leak hunter's heap: it names what holds memory, and saves nothing.
        "rust/src/bindings/interpreter/python_heap/mod.rs",
    },
}


def second_copies(root):
    """Each source file under ``root`` (the package's Python, the core's Rust without its tests)
    that saves an RNG or walks a closure or globals outside the one mechanism's files."""
    found = []
    sources = [*(root / "python" / "gpuexp").rglob("*.py"), *(root / "rust" / "src").rglob("*.rs")]
    for source in sorted(sources):
        relative = source.relative_to(root).as_posix()
        if relative.endswith("_tests.rs") or "/tests/" in relative:
            continue
        text = source.read_text(errors="replace")
        for pattern, allowed in ALLOWED.items():
            match = pattern.search(text)
            if match and relative not in allowed:
                found.append(f"{relative}: {match.group(0)}")
        match = CONTAINER_WALK.search(text) if relative in BY_VALUE_SAVE else None
        if match:
            found.append(f"{relative}: {match.group(0)}")
    return found


def test_no_second_rng_saving_or_closure_walk_in_the_sources():
    assert second_copies(REPO) == [], "use the core's step_state (or step_roots for a step's roots)"


@pytest.mark.parametrize(
    ("path", "line"),
    [
        ("python/gpuexp/fit.py", "saved = torch.get_rng_state()"),
        ("python/gpuexp/saved_state.py", "python = random.getstate()"),
        ("python/gpuexp/fit.py", "cells = step.__closure__"),
        ("rust/src/bindings/api/fit.rs", 'step.getattr("__globals__")?'),
        ("python/gpuexp/saved_state.py", "for key, item in list(value.items()):"),
        ("python/gpuexp/saved_state.py", "if isinstance(value, dict):"),
        ("python/gpuexp/tensor_values.py", "container[:] = before"),
    ],
)
def test_the_source_check_finds_a_planted_copy(tmp_path, path, line):
    for relative in ("python/gpuexp", "rust/src"):
        (tmp_path / relative).mkdir(parents=True, exist_ok=True)
    planted = tmp_path / path
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_text(f"x = 1\n{line}\n")
    assert [found.split(":")[0] for found in second_copies(tmp_path)] == [path]


STEP = """
import torch
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 3)
    def forward(self, x):
        return self.head(self.body(x))
model = Net()
"""


def namespace(extra):
    names = {"__name__": "user_notebook"}
    exec(compile(STEP + extra, "user_notebook.py", "exec"), names)  # noqa: S102
    return names


@pytest.mark.parametrize(
    ("extra", "path"),
    [
        ("model.head.extra = torch.randn(3, requires_grad=True)\n"
         "def step(bs):\n"
         "    (model(torch.randn(bs, 8)) * model.head.extra).sum().backward()\n",
         "model.head.extra"),
        ("cache = {'k': torch.randn(3, requires_grad=True)}\n"
         "def step(bs):\n"
         "    (model(torch.randn(bs, 8)) * cache['k']).sum().backward()\n",
         "cache['k']"),
    ],
)
def test_a_free_tensor_that_requires_grad_is_refused_by_the_path_the_user_writes(extra, path):
    ns = namespace(extra)
    with pytest.raises(gpuexp.NoEstimate) as refused:
        gpuexp.estimate(ns["step"], 4)
    message = str(refused.value)
    assert f"the step uses {path}, a tensor that requires grad (torch.Size([3]))" in message, message
    assert "nn.Parameter" in message, message
    assert all(p.grad is None for p in ns["model"].parameters())


def test_a_closure_cell_the_step_rebinds_is_put_back():
    ns = namespace(
        "def make():\n"
        "    last = None\n"
        "    def step(bs):\n"
        "        nonlocal last\n"
        "        last = model(torch.randn(bs, 8)).sum()\n"
        "        last.backward()\n"
        "    return step, lambda: last\n"
        "step, last_of = make()\n"
    )
    gpuexp.estimate(ns["step"], 4)
    assert ns["last_of"]() is None


def test_the_loop_option_of_fit_leaves_the_param_groups_as_they_were():
    ns = namespace(
        "opt = torch.optim.AdamW(model.parameters(), foreach=True)\n"
        "def step(bs):\n"
        "    model(torch.randn(bs, 8)).sum().backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n"
    )
    opt = ns["opt"]
    groups = [dict(group) for group in opt.param_groups]
    report = gpuexp.fit(ns["step"], 4, limit="1TiB").to_dict()
    assert any(o["option"] == "foreach_off" for o in report["options"]), report["options"]
    assert [dict(group) for group in opt.param_groups] == groups
    assert all(group["params"][0] is p for group, p in zip(opt.param_groups, ns["model"].body.parameters()))
    assert opt.state == {}


@pytest.mark.parametrize(
    "holder",
    [
        # A model held only in a slot of the user's object, and only in a class attribute: the
        # one walk of the step's state finds it, as the leak hunter's walk did before it.
        "class Holder:\n    __slots__ = ('net', 'seen')\nheld = Holder()\nheld.net = model\nheld.seen = {}\n"
        "def step(bs):\n    held.seen['k'] = 1\n    held.net(torch.randn(bs, 8)).sum().backward()\n",
        "class Config:\n    net = model\n    seen = {}\n"
        "def step(bs):\n    Config.seen['k'] = 1\n    Config.net(torch.randn(bs, 8)).sum().backward()\n",
    ],
    ids=["slot", "class attribute"],
)
def test_the_one_walk_finds_a_model_held_in_a_slot_or_a_class_and_puts_back_what_it_reaches(holder):
    ns = namespace(holder)
    found = gpuexp.estimate(ns["step"], 4).to_dict()
    weights = sum(p.numel() * p.element_size() for p in ns["model"].parameters())
    assert found["categories"]["parameters"] == weights, found["categories"]
    assert found["categories"]["gradients"] > 0
    assert all(p.grad is None for p in ns["model"].parameters()), "the real gradients untouched"
    seen = ns["held"].seen if "held" in ns else ns["Config"].seen
    assert seen == {}, "a dict reached through the slot or the class is put back"
