import ctypes
import os
import signal

import pytest

from browser import chrome, jupyter_lab, lab, screenshots  # noqa: F401 (fixtures of the browser tests)
from kernel import Kernel


def nvml_uuids():
    """UUIDs of the GPUs the driver lists, in NVML order; empty without a driver.
    Read through ctypes so that the tests' own process has no torch and no CUDA context."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return []
    if nvml.nvmlInit_v2() != 0:
        return []
    count = ctypes.c_uint(0)
    uuids = []
    if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0:
        for index in range(count.value):
            handle = ctypes.c_void_p()
            buffer = ctypes.create_string_buffer(96)
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) == 0 and \
                    nvml.nvmlDeviceGetUUID(handle, buffer, 96) == 0:
                uuids.append(buffer.value.decode())
    nvml.nvmlShutdown()
    return uuids


# A runner started in the background (`cmd &` in a script, nohup) can hand the suite SIGINT
# ignored, and every process it starts inherits that: their Ctrl-C then does nothing, and the tests
# that press it fail for the runner's sake. Python's own handler here gives children the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

GPU_UUIDS = nvml_uuids()
GPU = bool(GPU_UUIDS)


def pytest_collection_modifyitems(config, items):
    if GPU:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and driver (run `pytest -m gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Under CI (.ci/run exports GPUEXP_CI=1) a skip is a failure: a test that skips for a missing
# dependency proves nothing. Only what CI's machine can't have is let skip: a GPU, two GPUs,
# and the browser where the run isn't root and so could not install it.
CI_SKIPS = ("needs an NVIDIA GPU", "needs two GPUs")


def allowed_skip(reason):
    if reason.startswith(CI_SKIPS):
        return True
    return "chromedriver" in reason and "not found" in reason and os.geteuid() != 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("GPUEXP_CI") != "1" or not report.skipped or getattr(report, "wasxfail", None) is not None:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    if not allowed_skip(reason):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI (GPUEXP_CI=1), where only GPU and browser tests may skip: {reason}"


@pytest.fixture
def kernel():
    k = Kernel()
    yield k
    k.shutdown()


@pytest.fixture
def make_kernel():
    """Kernels with a given environment, e.g. CUDA_VISIBLE_DEVICES."""
    started = []

    def start(**env):
        k = Kernel(env=env)
        started.append(k)
        return k

    yield start
    for k in started:
        k.shutdown()


# Whether gpuexp's native sampler thread runs in a kernel, as the kernel's own /proc shows it.
SAMPLER_RUNNING = (
    "'gpuexp-sampler' in [open(f'/proc/self/task/{t}/comm').read().strip() "
    "for t in __import__('os').listdir('/proc/self/task')]"
)


# What every rank's code starts with in the ranks tests: a free port and a gloo group on loopback.
RANK_PRELUDE = """
import datetime, json, os, socket, sys, time
import torch
import torch.distributed as dist
import gpuexp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
"""


def load_rank_code(kernel, tmp_path, rank_code):
    """Writes the ranks' code as tmp_path/rank_code.py (their reports go in tmp_path/out) and
    imports it in the kernel, with torch.multiprocessing as mp and gpuexp."""
    (tmp_path / "rank_code.py").write_text(rank_code)
    (tmp_path / "out").mkdir(exist_ok=True)
    kernel.run(f"import json, os, stat, sys, time\nsys.path.insert(0, {str(tmp_path)!r})\n"
               "import torch, torch.multiprocessing as mp\nimport gpuexp\nimport rank_code")
    return kernel
