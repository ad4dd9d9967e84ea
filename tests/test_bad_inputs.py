"""Inputs a new user gets wrong, in a real kernel: each is refused with an error that names the fix,
or shown as what it is (never an empty table that reads as "nothing")."""

import re

import pytest

from conftest import GPU

SETUP = "import gpuexp\nfrom gpuexp import CPUExperiment, GPUExperiment\n"


@pytest.mark.skipif(GPU, reason="checks a machine without a GPU")
def test_holders_of_a_gpu_that_is_not_there_is_an_error_naming_the_gpus_that_are(kernel):
    kernel.run(SETUP)
    missing = kernel.run("gpuexp.holders(device='cuda:9')", expect_error=True)
    assert missing.error.startswith("ValueError") and "cuda:9" in missing.error, missing.error
    assert "no GPU that NVML can see" in missing.error and "device='cpu'" in missing.error


def test_a_bad_device_names_the_keyword_it_was_given_as(kernel):
    kernel.run(SETUP)
    bad = kernel.run("gpuexp.holders(device='cuda:x')", expect_error=True)
    assert bad.error.startswith("ValueError") and "device='cuda:x'" in bad.error and "devices=" not in bad.error


@pytest.mark.skipif(GPU, reason="checks torch without CUDA")
def test_a_limit_is_refused_when_torch_has_no_cuda(kernel):
    kernel.run(SETUP + "import torch")
    refused = kernel.run("exp = GPUExperiment('capped', limit='24GiB')", expect_error=True)
    assert refused.error.startswith("ValueError") and "torch sees no CUDA GPU" in refused.error, refused.error
    assert kernel.value("[r.name for r in gpuexp.history()]") == []


def test_every_json_time_is_rfc3339(kernel):
    kernel.run(SETUP)
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)"
    assert re.fullmatch(stamp, kernel.value("gpuexp.snapshot().to_dict()['taken_at']"))
    kernel.run("exp = CPUExperiment('timed', cell_log=False, monitor='10ms')\nimport time; time.sleep(0.05)")
    kernel.run("exp.finish()")
    report = kernel.value("gpuexp.history()[-1].to_dict()")
    assert re.fullmatch(stamp, report["started_at"]) and re.fullmatch(stamp, report["finished_at"])
    assert report["monitor"] and all(re.fullmatch(stamp, s["time"]) for s in report["monitor"])


def test_an_experiment_that_did_nothing_shows_no_loss(kernel):
    kernel.run(SETUP)
    kernel.run("exp = CPUExperiment('idle', cell_log=False)")
    shown = kernel.run("del exp").text
    row = next(line for line in shown.splitlines() if "host RSS" in line)
    assert "%" not in row and not re.search(r"-\d", row), row
    report = kernel.value("gpuexp.history()[-1].to_dict()['host']['rss']")
    assert report["consumed"] == report["before_teardown"] - report["start"]  # JSON keeps the exact bytes


def test_keep_of_a_missing_name_does_not_list_the_experiment_itself(kernel):
    kernel.run(SETUP)
    kernel.run("exp = CPUExperiment('k', cell_log=False)\nmodel = [1, 2, 3]")
    missing = kernel.run("exp.keep('modle')", expect_error=True)
    created = missing.error.split("created so far:")[1]
    assert "model" in created and "exp" not in created.split(".")[0], missing.error


def test_a_monitor_path_that_cannot_be_written_is_refused_when_the_monitor_is_made(tmp_path):
    import gpuexp

    with pytest.raises(OSError, match="cannot write there"):
        gpuexp.Monitor("10ms", "/nonexistent/dir/samples.csv")
    with pytest.raises(ValueError, match=".jsonl"):
        gpuexp.Monitor("10ms", tmp_path / "samples.txt")
    assert not (tmp_path / "samples.txt").exists()
    gpuexp.Monitor("10ms", tmp_path / "samples.csv")  # fine, and nothing is written before start()
    assert not (tmp_path / "samples.csv").exists()
