"""OOM rescue, on the host: torch.OutOfMemoryError raised by hand takes the path a real one
takes, so the frames, references and diagnosis are checked here too. (A RuntimeError that only
mentions CUDA's out-of-memory text, without CUDA in use, is no OOM: tests/test_rough_edges.py.)"""

import pytest

SETUP = "import builtins, weakref\nimport numpy as np\nimport torch\nimport gpuexp\n"

OOM_CELL = (
    "def forward():\n"
    "    activations = np.ones(128 << 20, dtype=np.uint8)\n"
    "    builtins.held = weakref.ref(activations)\n"
    "    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
    "capacity of 79.19 GiB of which 1.50 GiB is free.')\n"
    "forward()"
)


def test_an_oom_frees_what_the_failed_frames_held_and_explains_itself(kernel):
    kernel.run(SETUP)
    failed = kernel.run(OOM_CELL, expect_error=True)
    assert failed.error.startswith("OutOfMemoryError: CUDA out of memory")
    assert failed.text.index("OutOfMemoryError") < failed.text.index("CUDA out of memory on cuda:0 · rescued")
    assert "requested" in failed.text and "2.00 GiB" in failed.text
    assert kernel.value("builtins.held() is None")


def test_other_errors_are_left_alone(kernel):
    kernel.run(SETUP)
    not_oom = OOM_CELL.replace("torch.OutOfMemoryError('CUDA out of memory", "RuntimeError('shape mismatch")
    failed = kernel.run(not_oom, expect_error=True)
    assert "rescued" not in failed.text
    assert kernel.value("builtins.held() is not None")


def test_oom_rescue_can_be_turned_off_for_debugging(kernel):
    kernel.run(SETUP + "gpuexp.config(oom_rescue=False)")
    failed = kernel.run(OOM_CELL, expect_error=True)
    assert "rescued" not in failed.text
    assert kernel.value("builtins.held() is not None")  # %debug can still see the frames


def test_the_cell_log_shows_memory_after_the_rescue(kernel):
    kernel.run(SETUP + "%gpuexp log on")
    kernel.run(OOM_CELL, expect_error=True)
    record = kernel.value("gpuexp.cells()[-1].to_dict()['host']")
    assert record["peak_above_start"] >= 120 << 20
    assert record["consumed"] < 16 << 20


@pytest.mark.parametrize(
    "message, requested, device",
    [
        ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity", 2 << 30, 0),
        ("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 1; 79.19 GiB total capacity", 20 << 20, 1),
        ("CUDA error: out of memory", None, None),
    ],
)
def test_the_request_is_read_from_torchs_message(kernel, message, requested, device):
    kernel.run(SETUP)
    failed = kernel.run(f"raise torch.OutOfMemoryError({message!r})", expect_error=True)
    if requested is None:
        assert "requested" in failed.text and "n/a" in failed.text.split("requested")[1].splitlines()[0]
    else:
        expected = "2.00 GiB" if requested == 2 << 30 else "20.00 MiB"
        assert expected in failed.text.split("requested")[1].splitlines()[0]
        assert f"cuda:{device}" in failed.text


MODEL_OOM = (
    "class Block(torch.nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.fc1 = Wide()\n"
    "    def forward(self, x):\n"
    "        return self.fc1(x)\n"
    "class Wide(torch.nn.Module):\n"
    "    def forward(self, x):\n"
    "        y = x.repeat(4)\n"
    "        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total "
    "capacity of 79.19 GiB of which 1.50 GiB is free.')\n"
    "class Net(torch.nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.blocks = torch.nn.ModuleList([Block(), Block()])\n"
    "    def forward(self, x):\n"
    "        for block in self.blocks:\n"
    "            x = block(x)\n"
    "        return x\n"
    "model = Net()\n"
)


def test_an_oom_inside_a_forward_names_the_line_the_module_and_that_no_step_completed(kernel):
    kernel.run(SETUP + MODEL_OOM)
    failed = kernel.run("out = model(torch.ones(3))", expect_error=True)
    # The innermost line of the user's code, with its source, in the innermost module's path.
    failed_at = next(line for line in failed.text.splitlines() if "failed at" in line)
    assert "`raise torch.OutOfMemoryError(" in failed_at, failed.text
    assert "in model.blocks.0.fc1 (Wide), asking 4.00 GiB" in failed_at, failed.text
    # The setup cell completed: what grew since is unknown without a record (no CUDA here).
    assert "since the last completed cell: unknown" in failed.text, failed.text


def test_without_any_completed_step_the_diagnosis_says_so(kernel):
    failed = kernel.run(SETUP + MODEL_OOM + "model(torch.ones(3))", expect_error=True)
    assert "none completed in this kernel" in failed.text, failed.text


def test_the_flight_recorder_is_on_by_default_and_one_setting_turns_it_off(kernel):
    kernel.run(SETUP)
    assert kernel.value("gpuexp.config()['flight_recorder']") is True
    assert kernel.value("gpuexp.config(flight_recorder=False)['flight_recorder']") is False
    failed = kernel.run("gpuexp.config(flight_recorder='off')", expect_error=True)
    assert "flight_recorder is True or False" in failed.text
    # Off, and a step completed: the diagnosis says why it cannot tell what grew since.
    failed = kernel.run(MODEL_OOM + "model(torch.ones(3))", expect_error=True)
    assert "the flight recorder is off: gpuexp.config(flight_recorder=True)" in failed.text, failed.text


# Torch 2.1's message (its "capacty"), as a user's report quotes it: with no observer run, the
# table's "at the error" figures are the message's, and its header says so.
TORCH_2_1_MESSAGE = (
    "CUDA out of memory. Tried to allocate 224.00 MiB. GPU 0 has a total capacty of 14.75 GiB of which 11.06 MiB "
    "is free. Including non-PyTorch memory, this process has 14.73 GiB memory in use. Of the allocated memory "
    "14.04 GiB is allocated by PyTorch, and 509.85 MiB is reserved by PyTorch but unallocated."
)


def test_without_an_observer_the_figures_at_the_error_are_torchs_message(kernel):
    kernel.run(SETUP)
    failed = kernel.run(f"raise torch.OutOfMemoryError({TORCH_2_1_MESSAGE!r})", expect_error=True)
    assert "at the error (torch's message)" in failed.text, failed.text
    row = lambda name: failed.text.split(name)[1].splitlines()[0]  # noqa: E731
    assert "14.04 GiB" in row("torch allocated")
    assert "509.85 MiB" in row("torch reserved, unallocated")
    found = kernel.value("__import__('gpuexp.extension').extension.last_oom.to_dict()")
    assert found["at_error_source"] == "message"
    assert found["cause"] == "fragmentation"  # 509.85 MiB cached, more than the 224 MiB asked
    assert found["torch_allocated_before"] == round(14.04 * (1 << 30))
