"""Memory that creeps (issue 39), on an NVIDIA GPU (`pytest -m gpu`): loops that keep a little on
every iteration, run under a memory fraction's cap until torch raises, in real kernels."""

import pytest

pytestmark = pytest.mark.gpu

# A 4 GiB cap, so that each loop fills it in a few seconds.
CAPPED = """\
import time
import torch, gpuexp
torch.ones(1, device="cuda")
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction((4 << 30) / total)
exp = gpuexp.GPUExperiment('creep')
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).cuda()
x = torch.randn(256, 1024, device="cuda")
"""

LAST_OOM = "__import__('gpuexp.extension').extension.last_oom.to_dict()"

STEP_HINTS = ("a batch of at most", "Make the step smaller", "gpuexp.fit(")


def kept_by(kernel, code):
    """What one run of `code` keeps on the device, measured in the kernel."""
    kernel.run(
        "torch.cuda.synchronize(); _before = torch.cuda.memory_allocated()\n"
        f"{code}\n"
        "torch.cuda.synchronize(); _kept = torch.cuda.memory_allocated() - _before"
    )
    return kernel.value("_kept")


def assert_step_hints_absent(hints):
    for hint in hints:
        assert not any(step_hint in hint for step_hint in STEP_HINTS), hints


def test_an_evaluation_loop_without_no_grad_that_keeps_its_outputs_creeps(kernel):
    # The first matmul makes cuBLAS's workspace (32 MiB), which no output keeps.
    kernel.run(CAPPED + "outs = []\nmodel(x)")
    # Each output keeps its graph: the ReLU's output saved for the second Linear, and itself.
    each = kept_by(kernel, "outs.append(model(x))")
    assert each >= 4 << 20
    failed = kernel.run("while True:\n    outs.append(model(x))", expect_error=True)
    assert "OutOfMemoryError" in failed.error and "rescued" in failed.text
    found = kernel.value(LAST_OOM)
    assert found["cause"] == "creep", failed.text
    creep = found["creep"]
    assert creep["over"] == "repetitions", creep  # no step completed: the loop's repetitions in the history
    assert abs(creep["per_iteration"] - each) <= each / 10, (creep, each)
    assert creep["iterations"] >= 5
    hints = "\n".join(found["hints"])
    assert "torch.no_grad()" in hints and "torch.inference_mode()" in hints, hints
    assert "outs (a list of" in hints and "each keeping its graph" in hints and "`del outs`" in hints, hints
    assert_step_hints_absent(found["hints"])
    assert found["held_after"][0]["path"] == "outs", found["held_after"]
    # The rescue deletes no holder: the list and its graphs are still there.
    assert kernel.value("len(outs) > 100 and outs[-1].grad_fn is not None")
    kernel.run("outs.clear()\nexp.finish()")


def test_a_training_loop_that_keeps_a_tensor_per_step_creeps(kernel):
    kernel.run(
        CAPPED + "opt = torch.optim.SGD(model.parameters(), lr=1e-3)\n"
        "kept = []\n"
        "def step():\n"
        "    opt.zero_grad()\n"
        "    out = model(x)\n"
        "    out.sum().backward()\n"
        "    opt.step()\n"
        "    kept.append(out)  # its graph was freed by backward: it keeps its own 1 MiB\n"
        "    time.sleep(0.004)  # a data loader's wait: levels are read at most four times a second\n"
        "for _ in range(3):\n"
        "    step()"
    )
    each = kept_by(kernel, "step()")
    assert each == 256 * 1024 * 4
    failed = kernel.run("while True:\n    step()", expect_error=True)
    assert "OutOfMemoryError" in failed.error and "rescued" in failed.text
    found = kernel.value(LAST_OOM)
    assert found["cause"] == "creep", failed.text
    creep = found["creep"]
    assert creep["over"] == "steps", creep
    assert abs(creep["per_iteration"] - each) <= each / 10, (creep, each)
    hints = "\n".join(found["hints"])
    assert "a step over" in hints and ".item()" in hints and ".detach()" in hints, hints
    assert "kept (a list of" in hints, hints
    assert_step_hints_absent(found["hints"])
    assert kernel.value("len(kept) > 1000")  # still there afterwards
    kernel.run("kept.clear()\nexp.finish()")


def test_a_step_simply_too_big_after_steady_steps_keeps_todays_diagnosis(kernel):
    kernel.run(
        CAPPED + "opt = torch.optim.SGD(model.parameters(), lr=1e-3)\n"
        "def step(batch):\n"
        "    opt.zero_grad()\n"
        "    model(batch).sum().backward()\n"
        "    opt.step()\n"
        "    time.sleep(0.004)\n"
        "for _ in range(400):\n"
        "    step(x)"
    )
    failed = kernel.run("step(x[:1].expand(1 << 20, -1))", expect_error=True)
    found = kernel.value(LAST_OOM)
    assert found["cause"] == "step_too_big", failed.text
    assert found["creep"] is None and found["also"] == []
    hints = "\n".join(found["hints"])
    assert "needed at least" in hints and "memory crept" not in hints, hints
    kernel.run("exp.finish()")


def test_one_forward_through_identical_blocks_too_big_is_no_creep(kernel):
    # 24 identical blocks: the first forward repeats the same allocations once per block, each
    # keeping its activations for backward, until the cap refuses one some 15 blocks in. No step
    # ever completed, and the repetitions are layers of one pass, not iterations of a loop.
    kernel.run(
        CAPPED + "deep = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU())\n"
        "                              for _ in range(24)]).cuda()\n"
        "big = torch.randn(32768, 1024, device='cuda')"
    )
    failed = kernel.run("deep(big).sum().backward()", expect_error=True)
    assert "OutOfMemoryError" in failed.error
    found = kernel.value(LAST_OOM)
    assert found["cause"] == "step_too_big", failed.text
    assert found["creep"] is None
    assert "memory crept" not in "\n".join(found["hints"]), found["hints"]
    assert found["failed_line"]["module"].startswith("deep."), found["failed_line"]
    kernel.run("exp.finish()")


def test_a_loop_whose_passes_differ_crept_within_the_cell(kernel):
    # Each pass a random batch size, so no two passes allocate alike and no iteration repeats;
    # a data loader's wait makes the loop take a few seconds. What rose is still held by `outs`.
    kernel.run(CAPPED + "import random\nrandom.seed(0)\nouts = []\nmodel(x)")
    failed = kernel.run(
        "while True:\n"
        "    outs.append(model(x[: random.randint(64, 256)]))\n"
        "    time.sleep(0.003)",
        expect_error=True,
    )
    assert "OutOfMemoryError" in failed.error and "rescued" in failed.text
    found = kernel.value(LAST_OOM)
    assert found["cause"] == "creep", failed.text
    creep = found["creep"]
    assert creep["over"] == "within_cell" and creep["per_iteration"] is None, creep
    hints = "\n".join(found["hints"])
    assert "memory crept within the cell" in hints and "`del outs`" in hints, hints
    assert_step_hints_absent(found["hints"])
    assert kernel.value("len(outs) > 100")
    kernel.run("outs.clear()\nexp.finish()")
