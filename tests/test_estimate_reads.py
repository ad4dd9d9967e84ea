"""A step that reads its loss (`loss.item()`, `float(loss)`, `.tolist()`) only to return it, keep
it, add it up or print it is estimated, on the CPU in a real kernel, byte for byte as the same
step without the read; one that branches on it is refused naming its line (issue 44, section 2)."""

import pytest

from kernel import module_kernel
from test_estimate import FINGERPRINT, SETUP

STEPS = """\
losses, running = [], 0.0
class Meter:
    total = 0.0
meter = Meter()
def train(bs):
    opt.zero_grad(set_to_none=True)
    x, y = torch.randn(bs, 512), torch.randint(0, 10, (bs,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss
def plain(bs):
    train(bs)
def kept():
    return [losses, running, meter.total]
def estimated(estimate):  # its figures, less what the machine's RSS, free memory and speed change
    found = estimate.to_dict()
    for varies in ("seconds", "now", "fits"):
        found.pop(varies)
    return found
"""

shared = module_kernel(SETUP + FINGERPRINT + STEPS)

# Each read, as the body of a step; the body of the step without it where it is not `train(bs)`.
WITHOUT = {"tolist returned": "train(bs).detach().reshape(1)"}
READS = {
    "item returned": "return train(bs).item()",
    "float returned": "return float(train(bs))",
    "tolist returned": "return train(bs).detach().reshape(1).tolist()",
    "appended": "losses.append(train(bs).item())",
    "added to a global": "global running\n    running += train(bs).item()",
    "added to an attribute": "meter.total += train(bs).item()",
    "printed": 'value = train(bs).item()\n    print(f"loss {value:.3f}", value)',
    "skipped while estimating":
        "loss = train(bs)\n    if not gpuexp.estimating() and loss.item() > 10:\n        print('big')",
}


@pytest.mark.parametrize("read", sorted(READS))
def test_a_step_that_reads_its_loss_is_estimated_as_the_step_without_the_read(shared, read):
    shared.run(f"def reads(bs):\n    {READS[read]}\ndef plain_of(bs):\n    {WITHOUT.get(read, 'train(bs)')}\n"
               "before, kept_before = fingerprint(), kept()")
    shared.run("with_read = gpuexp.estimate(reads, 16, steps=2)\nwithout = gpuexp.estimate(plain_of, 16, steps=2)")
    with_read, without = shared.value("[estimated(with_read), estimated(without)]")
    if read == "float returned":  # float() must return a float: NaN stood in, and a note says where
        extra = [note for note in with_read["notes"] if note not in without["notes"]]
        assert len(extra) == 1 and extra[0].startswith("float() of a fake tensor returned NaN"), extra
        assert "return float(train(bs))" in extra[0], extra
        with_read["notes"] = without["notes"]
    if read == "tolist returned":  # its operators count the view and the device queries .tolist() runs
        assert with_read.pop("ops") > without.pop("ops")
    assert with_read == without, (read, with_read, without)
    assert with_read["peak"] > 0
    assert shared.value("fingerprint() == before and kept() == kept_before") is True, shared.value("kept()")
    # The real step runs right after, and its read is a real number.
    assert shared.value("[type(train(8).item()).__name__, gpuexp.estimating()]") == ["float", False]


def test_what_a_step_prints_of_a_read_says_it_was_a_stand_in(shared):
    shared.run('def printing(bs):\n    v = train(bs).item()\n    print(f"loss {v:.3f}", [v], "%.2f" % v)')
    shown = shared.run("printed = gpuexp.estimate(printing, 8)").text
    stand_in = "<stand-in: gpuexp.estimate runs this step on fake tensors>"
    assert f"loss {stand_in} [{stand_in}] nan" in shown, shown
    notes = shared.value("printed.to_dict()['notes']")
    assert any(note.startswith("float() of a fake tensor returned NaN") for note in notes), notes
    real = shared.run("printing(8)").text
    assert "stand-in" not in real and real.startswith("loss "), real


def test_gpuexp_estimating_is_true_only_while_the_step_runs_on_fake_tensors(shared):
    shared.run("def asks(bs):\n    print('estimating:', gpuexp.estimating())\n    train(bs)")
    shown = shared.run("gpuexp.estimate(asks, 8)\nasks(8)\nprint('after:', gpuexp.estimating())").text
    assert shown.split() == ["estimating:", "True", "estimating:", "False", "after:", "False"], shown


@pytest.mark.parametrize("body, line, code", [
    ("loss = train(bs)\n    if loss.item() > 10:\n        print('big')", 3, "if loss.item() > 10:"),
    ("value = train(bs).item()\n    return torch.zeros(int(value))", 3, "return torch.zeros(int(value))"),
    ("if train(bs) > 10:\n        print('big')", 2, "if train(bs) > 10:"),
])
def test_a_step_that_branches_on_a_read_is_refused_naming_its_line(shared, body, line, code):
    shared.run(f"def branches(bs):\n    {body}\nbefore, kept_before = fingerprint(), kept()")
    failed = shared.run("gpuexp.estimate(branches, 8)", expect_error=True).error
    where = shared.value("branches.__code__.co_filename")
    assert failed.startswith(f"NoEstimate: the step needs the value of a tensor at {where}:{line} (`{code}`)"), failed
    assert "if not gpuexp.estimating(): ..." in failed, failed
    assert shared.value("fingerprint() == before and kept() == kept_before") is True


def test_a_bool_read_on_one_line_and_branched_on_another_names_both(shared):
    shared.run("def flag(bs):\n    big = (train(bs) > 10).item()\n    if big:\n        print('big')")
    failed = shared.run("gpuexp.estimate(flag, 8)", expect_error=True).error
    where = shared.value("flag.__code__.co_filename")
    assert f"at {where}:3 (`if big:`)" in failed and f"read at {where}:2" in failed, failed


def test_a_value_read_on_one_line_and_needed_on_another_names_both(shared):
    shared.run("def later(bs):\n    value = train(bs).item()\n    total = value * 2\n    if total > 1:\n"
               "        print('big')")
    failed = shared.run("gpuexp.estimate(later, 8)", expect_error=True).error
    where = shared.value("later.__code__.co_filename")
    assert f"at {where}:4 (`if total > 1:`)" in failed, failed
    assert f"read at {where}:2 (`value = train(bs).item()`)" in failed, failed


def test_fit_works_on_a_step_that_returns_its_loss(shared):
    shared.run("def reads(bs):\n    return train(bs).item()\nbefore = fingerprint()")
    shared.run("with_read = gpuexp.fit(reads, 16, device='cpu', limit='1TiB')\n"
               "without = gpuexp.fit(plain, 16, device='cpu', limit='1TiB')")
    figures = "[(found['peak'], [(o['option'], o['peak'], o['saves']) for o in found['options']])" \
              " for found in (with_read.to_dict(), without.to_dict())]"
    with_read, without = shared.value(figures)
    assert with_read == without and len(with_read[1]) >= 1, (with_read, without)
    assert shared.value("fingerprint() == before") is True


def test_a_closure_variable_the_step_adds_its_loss_to_is_put_back(shared):
    shared.run("def make():\n    running = 0.0\n    def adds(bs):\n        nonlocal running\n"
               "        running += train(bs).item()\n    return adds, lambda: running\nadds, running_of = make()")
    shared.run("gpuexp.estimate(adds, 8)")
    assert shared.value("running_of() == 0.0 and type(running_of()) is float") is True


def test_torchs_methods_are_put_back_after_an_estimate_even_a_refused_one(shared):
    shared.run("kinds = (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)\n"
               "names = ('__repr__', '__str__', '__format__', '__float__')\n"
               "methods = lambda: [vars(kind).get(name) for kind in kinds for name in names]\n"
               "before_methods = methods()\n"
               "def bad(bs):\n    if train(bs).item() > 1:\n        pass")
    shared.run("gpuexp.estimate(lambda bs: train(bs).item(), 8)")
    assert shared.run("gpuexp.estimate(bad, 8)", expect_error=True).error.startswith("NoEstimate")
    assert shared.value("methods() == before_methods and float(torch.ones(())) == 1.0") is True


def test_a_grad_scaler_step_that_returns_its_loss_is_estimated_as_the_one_without(shared):
    shared.run("scaler = torch.amp.GradScaler('cpu', init_scale=1024.0)\n"
               "def scaled_loss(bs):\n"
               "    opt.zero_grad(set_to_none=True)\n"
               "    x, y = torch.randn(bs, 512), torch.randint(0, 10, (bs,))\n"
               "    with torch.autocast('cpu', dtype=torch.bfloat16):\n"
               "        loss = torch.nn.functional.cross_entropy(model(x), y)\n"
               "    scaler.scale(loss).backward()\n    scaler.step(opt)\n    scaler.update()\n    return loss\n"
               "def scaled_item(bs):\n    return scaled_loss(bs).item()\n"
               "def scaled(bs):\n    scaled_loss(bs)\n"
               "scaled(8)\nscale = scaler._scale.item()")
    with_read, without = shared.value("[estimated(gpuexp.estimate(scaled_item, 16)), "
                                      "estimated(gpuexp.estimate(scaled, 16))]")
    assert with_read == without and any("GradScaler" in note for note in with_read["notes"]), with_read
    assert shared.value("scaler._scale.item() == scale and type(scaled_item(8)) is float") is True
