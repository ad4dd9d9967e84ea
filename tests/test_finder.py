"""The batch-size finder's and limit='s errors where there is no CUDA GPU (CI)."""

import pytest

from conftest import GPU

SETUP = "import gpuexp\n"


@pytest.mark.skipif(GPU, reason="checks a machine without a CUDA GPU")
def test_the_finder_says_it_needs_a_cuda_gpu(kernel):
    kernel.run(SETUP + "import torch")
    failed = kernel.run("gpuexp.find_batch_size(lambda bs: None)", expect_error=True)
    assert failed.error.startswith("RuntimeError") and "CUDA GPU" in failed.error


def test_bad_limits_get_clear_errors(kernel):
    kernel.run(SETUP)
    for bad, expected in (("'24 parsecs'", "24GiB"), ("-5", "24GiB"), ("True", "24GiB")):
        failed = kernel.run(f"gpuexp.GPUExperiment('x', limit={bad})", expect_error=True)
        assert failed.error.startswith("ValueError") and expected in failed.error, failed.error
    no_torch = kernel.run("gpuexp.GPUExperiment('x', limit='1GiB')", expect_error=True)
    assert "import torch first" in no_torch.error
    cpu = kernel.run("gpuexp.CPUExperiment('x', limit='1GiB')", expect_error=True)
    assert cpu.error.startswith("TypeError")


def test_the_search_can_be_driven_without_a_gpu(kernel):
    """The search itself is plain bookkeeping: fed a linear model of a step, it finds the size in 5 trials."""
    kernel.run(SETUP)
    kernel.run(
        "search = gpuexp._core.BatchSizeResult(8, 4096, 24 << 30, margin=0.0)\n"
        "while (trial := search.next_trial()) is not None:\n"
        "    bs, role = trial\n"
        "    peak = (2 << 30) + bs * (90 << 20)\n"
        "    search.record(bs, role, (peak, peak), 0.1)"
    )
    assert kernel.value("[search.batch_size, search.trials]") == [250, 5]
    assert "gpuexp · batch size 250 · 5 trials" in kernel.run("print(search)").text
