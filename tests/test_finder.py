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


def test_the_arguments_are_checked_before_the_gpu(kernel):
    """Bad arguments name their fix even on a machine without a GPU (the search's own logic is
    covered by the Rust tests in rust/src/finder/tests.rs)."""
    kernel.run(SETUP)
    not_callable = kernel.run("gpuexp.find_batch_size(None)", expect_error=True)
    assert not_callable.error.startswith("TypeError") and "find_batch_size(train_step)" in not_callable.error
    for call, expected in (
        ("start=0", "start must be a positive int"),
        ("start=64, max=8", "max at least start"),
        ("multiple_of=0", "multiple_of must be at least 1"),
        ("margin=1.5", "margin must be a share below 1"),
    ):
        failed = kernel.run(f"gpuexp.find_batch_size(lambda bs: None, {call})", expect_error=True)
        assert failed.error.startswith("ValueError") and expected in failed.error, (call, failed.error)
