"""OOM rescue on an NVIDIA GPU (`pytest -m gpu`): real torch.OutOfMemoryError, real memory."""

import pytest

pytestmark = pytest.mark.gpu

GiB = 1 << 30

SETUP = """\
import torch
import gpuexp
torch.ones(1, device="cuda");
"""


def allocated(kernel):
    return kernel.value("torch.cuda.memory_allocated()")


def test_an_oom_in_a_function_holding_2_gib_with_no_experiment_open(kernel):
    kernel.run(SETUP)
    before = allocated(kernel)
    failed = kernel.run(
        "def step():\n"
        "    held = torch.empty(2 << 30, dtype=torch.uint8, device='cuda')\n"
        "    return torch.empty(1 << 50, dtype=torch.uint8, device='cuda')\n"
        "step()",
        expect_error=True,
    )
    assert "OutOfMemoryError" in failed.error
    assert allocated(kernel) == before
    diagnosis = failed.text.split("rescued")[1]
    assert "1.00 PiB" in diagnosis.split("requested")[1].splitlines()[0]  # 1 << 50 bytes
    free = kernel.value("__import__('gpuexp').snapshot().to_dict()['gpus'][0]['free']")
    total = kernel.value("torch.cuda.get_device_properties(0).total_memory")
    assert free > total * 0.5  # the 2 GiB came back to the device


def test_an_oom_inside_a_models_forward(kernel):
    kernel.run(SETUP + "exp = gpuexp.GPUExperiment('forward')")
    kernel.run(
        "class Big(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.layer = torch.nn.Linear(4096, 4096)\n"
        "    def forward(self, x):\n"
        "        h = self.layer(x)\n"
        "        wide = h.repeat(1, 1 << 40)\n"
        "        return wide\n"
        "model = Big().cuda()\n"
        "x = torch.randn(256, 4096, device='cuda')"
    )
    before = allocated(kernel)
    failed = kernel.run("model(x)", expect_error=True)
    assert "OutOfMemoryError" in failed.error and "rescued" in failed.text
    assert allocated(kernel) == before
    cell = kernel.value("gpuexp.cells()[-1].to_dict()['gpus'][0]['torch_allocated']")
    assert cell["consumed"] == 0


def test_the_diagnosis_reports_the_request_and_free_memory(kernel):
    kernel.run(SETUP)
    free = kernel.value("__import__('gpuexp').snapshot().to_dict()['gpus'][0]['free']")
    request = free + (8 << 30)  # just over what is free: a realistic OOM
    failed = kernel.run(f"t = torch.empty({request}, dtype=torch.uint8, device='cuda')", expect_error=True)
    text = failed.text.split("rescued")[1]
    requested_line = text.split("requested")[1].splitlines()[0]
    # torch's message gives the size to 2 decimals, after rounding the request up to its blocks.
    shown = float(requested_line.split("GiB")[0].split()[-1])
    assert abs(shown - request / GiB) <= 0.011, (request / GiB, requested_line)
    assert "device free" in text and "hint:" in text


DEEP_MODEL = """\
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(1024, 4096)
        self.down = torch.nn.Linear(4096, 1024)
    def forward(self, x):
        return self.down(torch.relu(self.up(x)))
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block() for _ in range(4)])
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x
model = Net().cuda()
opt = torch.optim.AdamW(model.parameters())
x = torch.randn(64, 1024, device="cuda")
def step(batch):
    opt.zero_grad()
    model(batch).sum().backward()
    opt.step()
step(x)
opt.zero_grad()
"""


def test_an_untraced_oom_deep_in_a_forward_explains_itself_the_first_time(kernel):
    kernel.run(SETUP + "exp = gpuexp.GPUExperiment('deep')")
    assert kernel.value("torch._C._cuda_isHistoryEnabled()")  # the flight recorder runs
    kernel.run(DEEP_MODEL)
    kernel.run("torch._C._cuda_clearCublasWorkspaces()")  # the rescue frees them too
    before = allocated(kernel)
    # A step that fits, then one whose first block's output alone needs 256 GiB.
    failed = kernel.run("step(x)\nstep(x[:1].expand(1 << 24, -1))", expect_error=True)
    assert "OutOfMemoryError" in failed.error and "rescued" in failed.text
    text = failed.text.split("rescued")[1]
    failed_at = next(line for line in text.splitlines() if "failed at" in line)
    assert "`return self.down(torch.relu(self.up(x)))`" in failed_at, text
    assert "blocks.0.up (Linear)" in failed_at, text
    assert "since the last completed optimizer step" in text and "blocks made since hold" in text, text
    assert "live then, by size" in text and "made since the last step" in text, text
    assert "may fit" not in text and "at least" in text, text
    assert allocated(kernel) == before  # the memory comes back as before the cell
    kernel.run("exp.finish()")
    assert not kernel.value("torch._C._cuda_isHistoryEnabled()")  # nothing outlives gpuexp's active state


def test_after_a_cells_first_steps_an_oom_counts_from_the_last_steps_level(kernel):
    kernel.run(SETUP + "exp = gpuexp.GPUExperiment('levels')")
    kernel.run(DEEP_MODEL)
    kernel.run("torch._C._cuda_clearCublasWorkspaces()")
    before = allocated(kernel)
    # Past the recorder's first steps the history is given back; each step's end reads a level.
    failed = kernel.run(
        "for _ in range(4):\n    step(x)\n"
        "assert not torch._C._cuda_isHistoryEnabled(), 'the recorder still records'\n"
        "step(x[:1].expand(1 << 24, -1))",
        expect_error=True,
    )
    assert "OutOfMemoryError" in failed.error and "rescued" in failed.text, failed.error
    text = failed.text.split("rescued")[1]
    failed_at = next(line for line in text.splitlines() if "failed at" in line)
    assert "`return self.down(torch.relu(self.up(x)))`" in failed_at and "blocks.0.up (Linear)" in failed_at, text
    assert "since the last completed optimizer step" in text and "which blocks grew is not known" in text, text
    assert "live then, by size" in text, text
    assert "may fit" not in text, text
    assert allocated(kernel) == before
    kernel.run("exp.finish()")
    assert not kernel.value("torch._C._cuda_isHistoryEnabled()")


def test_a_users_own_recording_is_shared_and_left_running(kernel):
    kernel.run(SETUP + "torch.cuda.memory._record_memory_history(max_entries=1000)\n"
               "exp = gpuexp.GPUExperiment('shared')\nexp.finish()")
    assert kernel.value("torch._C._cuda_isHistoryEnabled()")
    kernel.run("gpuexp.config(flight_recorder=False)\nexp = gpuexp.GPUExperiment('off')")
    kernel.run("torch.cuda.memory._record_memory_history(enabled=None)\nexp2 = gpuexp.GPUExperiment('off2')")
    assert not kernel.value("torch._C._cuda_isHistoryEnabled()")  # turned off: never started


# Issue 44: the figures at the error are the failure's own, not those read after the unwind.

CAPPED = """\
import torch, gpuexp
torch.ones(1, device="cuda")
total = torch.cuda.get_device_properties(0).total_memory
seen = []
def users_observer(device, alloc, limit, free):
    seen.append(torch.cuda.memory_allocated(device))
torch._C._cuda_attach_out_of_memory_observer(users_observer)
"""


def test_an_oom_with_a_large_unnamed_temporary_alive_gives_torchs_figures(kernel):
    kernel.run(CAPPED + "torch.cuda.set_per_process_memory_fraction((6 << 30) / total)\n")
    kernel.run("exp = gpuexp.GPUExperiment('temporary')")
    failed = kernel.run(
        "x = torch.ones(1 << 30, dtype=torch.uint8, device='cuda')\n"
        "y = (x.float() + 1).sum()  # x.float(), 4 GiB, is alive and nameless when + asks 4 GiB more",
        expect_error=True,
    )
    assert "at the error (torch's OOM observer)" in failed.text, failed.text
    found = kernel.value("__import__('gpuexp.extension').extension.last_oom.to_dict()")
    seen = kernel.value("seen")
    assert len(seen) == 1, "the user's own observer ran too"
    assert abs(found["torch_allocated_before"] - seen[0]) <= 1 << 20
    assert found["torch_allocated_before"] >= 5 << 30  # x and its 4 GiB float copy
    assert found["cause"] == "step_too_big"
    # torch's own message (in the traceback) always names expandable_segments: read gpuexp's hints
    assert not any("may fit" in hint or "expandable_segments" in hint for hint in found["hints"]), found["hints"]
    kernel.run("exp.finish()")


def test_a_real_fragmentation_is_still_called_fragmentation(kernel):
    kernel.run(CAPPED + "torch.cuda.set_per_process_memory_fraction(((2 << 30) + (100 << 20)) / total)\n")
    kernel.run("exp = gpuexp.GPUExperiment('fragmented')")
    kernel.run(
        "big = torch.empty(2 << 30, dtype=torch.uint8, device='cuda'); del big\n"
        "chunks = [torch.empty(64 << 20, dtype=torch.uint8, device='cuda') for _ in range(32)]\n"
        "del chunks[::2]  # 16 free blocks of 64 MiB inside one segment that can't be given back"
    )
    failed = kernel.run("wide = torch.empty(256 << 20, dtype=torch.uint8, device='cuda')", expect_error=True)
    found = kernel.value("__import__('gpuexp.extension').extension.last_oom.to_dict()")
    assert found["at_error_source"] == "observer"
    assert found["cause"] == "fragmentation", failed.text
    assert any("expandable_segments" in hint for hint in found["hints"]), found["hints"]
    kernel.run("exp.finish()")


def test_an_oom_beside_another_processs_allocation_names_that_process(kernel, tmp_path):
    ready = tmp_path / "ready"
    holder = (
        "import torch, time, pathlib\n"
        "total = torch.cuda.get_device_properties(0).total_memory\n"
        "held = torch.empty(total // 5, dtype=torch.uint8, device='cuda')\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "time.sleep(120)\n"
    )
    import subprocess
    import sys
    import time

    other = subprocess.Popen([sys.executable, "-c", holder])
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert other.poll() is None and time.monotonic() < deadline, "the other process did not start"
            time.sleep(0.2)
        kernel.run(SETUP + "exp = gpuexp.GPUExperiment('crowded')")
        # 90% of the device: more than is free beside the other's fifth, less than it would be without.
        failed = kernel.run(
            "torch.empty(int(torch.cuda.get_device_properties(0).total_memory * 0.9), dtype=torch.uint8, "
            "device='cuda')",
            expect_error=True,
        )
        assert f"process {other.pid}" in failed.text, failed.text
        assert "other processes hold" in failed.text
        assert kernel.value("__import__('gpuexp.extension').extension.last_oom.to_dict()['cause']") == "other_process"
        # A request the device could not give even without them is not theirs to answer for.
        failed = kernel.run("torch.empty(1 << 50, dtype=torch.uint8, device='cuda')", expect_error=True)
        assert f"process {other.pid}" in failed.text and "other processes hold" not in failed.text, failed.text
        kernel.run("exp.finish()")
    finally:
        other.kill()
        other.wait()


def test_a_training_cell_after_setup_cells_oom_on_its_second_step_names_the_blocks_made_since(kernel):
    # Issue 44, section 4: the opening cell and two setup cells end with no optimizer step; the
    # cells' ends used to count as steps, so this cell's first step gave the history back.
    kernel.run(SETUP + "exp = gpuexp.GPUExperiment('after setup')")
    kernel.run(DEEP_MODEL)
    kernel.run("torch._C._cuda_clearCublasWorkspaces()")
    failed = kernel.run("step(x)\nstep(x[:1].expand(1 << 24, -1))", expect_error=True)
    assert "OutOfMemoryError" in failed.error and "rescued" in failed.text, failed.error
    text = failed.text.split("rescued")[1]
    assert "since the last completed optimizer step" in text and "blocks made since hold" in text, text
    assert "which blocks grew is not known" not in text, text
    kernel.run("exp.finish()")
