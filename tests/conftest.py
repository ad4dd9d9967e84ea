import ctypes

import pytest

from kernel import Kernel


def _nvidia_gpu_present():
    """True when the NVIDIA driver answers and lists a GPU (no torch, no CUDA context)."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    if nvml.nvmlInit_v2() != 0:
        return False
    count = ctypes.c_uint(0)
    ok = nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0
    nvml.nvmlShutdown()
    return ok and count.value > 0


GPU = _nvidia_gpu_present()


def pytest_collection_modifyitems(config, items):
    if GPU:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and driver (run `pytest -m gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
