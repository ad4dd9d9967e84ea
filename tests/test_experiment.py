"""Experiment scopes in a real IPython kernel, on the host (these run everywhere, CI included)."""

import re

import pytest

from conftest import GPU, SAMPLER_RUNNING

MiB = 1 << 20

SETUP = """\
import builtins, sys, weakref
import numpy as np
import gpuexp
from gpuexp import CPUExperiment, GPUExperiment
"""


def names_present(kernel, *names):
    return kernel.value(f"sorted(n for n in {names!r} if n in globals())")


def last_report(kernel):
    return kernel.value("gpuexp.history()[-1].to_dict()")


def test_del_exp_deletes_what_the_scope_created_and_nothing_else(kernel):
    kernel.run(SETUP + "data = np.zeros(10)\nitems = [1, 2]")
    kernel.run('exp = GPUExperiment("bs=64")')
    kernel.run("model = np.ones(32 << 20, dtype=np.uint8)\n_scratch = 1\nalias = items\nview = data")
    shown = kernel.run("del exp")
    assert names_present(kernel, "data", "items", "model", "_scratch", "alias", "view") == ["data", "items"]
    report = last_report(kernel)
    assert report["deleted"] == ["_scratch", "alias", "model", "view"]
    assert report["rebound"] == [] and report["kept"] == []
    assert "deleted: _scratch, alias, model, view" in shown.text
    assert "host RSS" in shown.text and "host RSS" in shown.html


def test_a_measuring_experiment_deletes_nothing_and_still_measures(kernel):
    kernel.run(SETUP + "data = np.zeros(10)")
    kernel.run('exp = GPUExperiment("measured", delete=False)')
    kernel.run("model = np.ones(64 << 20, dtype=np.uint8)\ndata = 1")
    kernel.run("exp.finish()")
    assert names_present(kernel, "data", "model", "exp") == ["data", "exp", "model"]
    report = last_report(kernel)
    assert report["deleted"] == [] and report["rebound"] == [], report
    assert report["host"]["rss"]["consumed"] > 60 * MiB, report["host"]
    cell = kernel.run('GPUExperiment(delete="no")', expect_error=True)
    assert "delete must be True or False" in cell.error


def test_rebound_names_are_deleted_and_listed_apart(kernel):
    kernel.run(SETUP + "x = np.zeros(3)\ny = 'unchanged'")
    kernel.run('exp = GPUExperiment("rebind")')
    kernel.run("x = np.ones(4)")
    shown = kernel.run("del exp")
    assert names_present(kernel, "x", "y") == ["y"]
    assert last_report(kernel)["rebound"] == ["x"]
    assert "rebound (deleted): x" in shown.text


def test_modules_and_kept_names_survive(kernel):
    kernel.run(SETUP)
    kernel.run('exp = GPUExperiment("keep")')
    kernel.run("import json as js\nbest = np.ones(8)\nrest = np.ones(8)\nexp.keep('best')")
    kernel.run("del exp")
    assert names_present(kernel, "js", "best", "rest") == ["best", "js"]
    report = last_report(kernel)
    assert report["kept"] == ["best", "js"] and report["deleted"] == ["rest"]


def test_keep_of_a_missing_name_says_which_names_exist(kernel):
    kernel.run(SETUP)
    kernel.run('exp = GPUExperiment("typo")')
    kernel.run("model = 1")
    failed = kernel.run("exp.keep('modle')", expect_error=True)
    assert failed.error.startswith("ValueError")
    assert "'modle'" in failed.error or '"modle"' in failed.error
    assert "model" in failed.error.split("created so far:")[1]


def test_displayed_and_raised_objects_are_freed(kernel):
    """Out, _, _N, the stored exception and IPython's kept traceback all let go."""
    kernel.run(SETUP)
    kernel.run('exp = GPUExperiment("hidden")')
    kernel.run("a = np.ones(64 << 20, dtype=np.uint8)\nbuiltins.shown = weakref.ref(a)\na[:3]")
    kernel.run(
        "def fail():\n"
        "    held = np.ones(64 << 20, dtype=np.uint8)\n"
        "    builtins.held = weakref.ref(held)\n"
        "    raise ValueError('boom')\n"
        "fail()",
        expect_error=True,
    )
    kernel.run("del exp")
    assert kernel.value("[builtins.shown() is None, builtins.held() is None]") == [True, True]
    assert kernel.value("[len(Out), _ == '', hasattr(sys, 'last_value')]") == [0, True, False]
    cleared = last_report(kernel)["cleared"]
    assert "last exception" in cleared and "last traceback" in cleared
    assert any(label.startswith("Out[") for label in cleared)


def test_hidden_references_from_before_the_scope_are_kept(kernel):
    kernel.run(SETUP + "before = np.arange(3)")
    kernel.run("before")
    kernel.run('exp = GPUExperiment("old outputs")')
    kernel.run("del exp")
    assert kernel.value("[list(Out), isinstance(Out[2], np.ndarray)]") == [[2], True]


def test_del_exp_finishes_even_when_out_holds_the_experiment(kernel):
    kernel.run(SETUP)
    kernel.run('exp = GPUExperiment("displayed")')
    kernel.run("big = np.ones(16 << 20, dtype=np.uint8)")
    kernel.run("exp")
    shown = kernel.run("del exp")
    assert "displayed · finished" in shown.text
    assert names_present(kernel, "big") == []
    assert kernel.value("[r.name for r in gpuexp.history()]") == ["displayed"]


def test_finish_twice_returns_the_same_report_and_deletes_nothing_more(kernel):
    kernel.run(SETUP)
    kernel.run('exp = CPUExperiment("twice")')
    kernel.run("a = 1")
    kernel.run("first = exp.finish().to_json()")
    kernel.run("later = 2\nsecond = exp.finish().to_json()")
    assert names_present(kernel, "a", "later", "exp") == ["exp", "later"]
    assert kernel.value("first == second")
    assert kernel.value("len(gpuexp.history())") == 1


def test_with_block_finishes_at_its_end(kernel):
    kernel.run(SETUP)
    shown = kernel.run('with CPUExperiment("block") as exp:\n    block = np.ones(64 << 20, dtype=np.uint8)')
    assert "block · finished" in shown.text
    assert names_present(kernel, "block", "exp") == ["exp"]
    assert last_report(kernel)["host"]["rss"]["reclaimed"] > 60 * MiB


def test_host_figures_of_a_512_mib_array(kernel):
    kernel.run(SETUP)
    kernel.run('exp = CPUExperiment("512")')
    kernel.run("arr = np.ones(512 << 20, dtype=np.uint8)")
    live = kernel.value("exp.data.to_dict()")
    assert live["finished"] is False and live["host"]["rss"]["reclaimed"] is None
    kernel.run("del exp")
    rss = last_report(kernel)["host"]["rss"]
    assert 510 * MiB <= rss["consumed"] <= 530 * MiB
    assert 505 * MiB <= rss["reclaimed"] <= rss["consumed"]
    assert rss["peak"] >= rss["start"] + 512 * MiB
    assert rss["consumed"] == rss["before_teardown"] - rss["start"]
    assert rss["reclaimed"] == rss["before_teardown"] - rss["end"]


def test_nested_scopes_delete_their_own_names_and_keep_their_own_peaks(kernel):
    kernel.run(SETUP)
    kernel.run('outer = CPUExperiment("outer")')
    kernel.run("a = np.ones(32 << 20, dtype=np.uint8)\nspike = np.ones(400 << 20, dtype=np.uint8)\ndel spike")
    kernel.run('inner = CPUExperiment("inner")')
    kernel.run("b = np.ones(64 << 20, dtype=np.uint8)")
    kernel.run("del inner")
    assert names_present(kernel, "a", "b") == ["a"]
    inner = last_report(kernel)
    kernel.run("del outer")
    assert names_present(kernel, "a", "b", "outer", "inner") == []
    outer = last_report(kernel)
    assert inner["deleted"] == ["b"] and outer["deleted"] == ["a"]
    # The 400 MiB spike happened in the outer scope before the inner one opened.
    assert outer["host"]["rss"]["peak"] >= outer["host"]["rss"]["start"] + 400 * MiB
    assert inner["host"]["rss"]["peak"] < inner["host"]["rss"]["start"] + 200 * MiB


def test_finishing_an_outer_scope_finishes_the_inner_first(kernel):
    kernel.run(SETUP)
    kernel.run('outer = CPUExperiment("outer")')
    kernel.run('inner = CPUExperiment("inner")')
    kernel.run("x = 1")
    shown = kernel.run("outer.finish()")
    assert shown.text.index("inner · finished") < shown.text.index("outer · finished")
    assert kernel.value("[r.name for r in gpuexp.history()]") == ["inner", "outer"]


def test_rerunning_the_constructor_cell_finishes_the_old_experiment_first(kernel):
    kernel.run(SETUP)
    constructor = 'exp = GPUExperiment("same")'
    kernel.run(constructor)
    kernel.run("big = np.ones(256 << 20, dtype=np.uint8)")
    shown = kernel.run(constructor)
    assert "same · finished" in shown.text
    assert names_present(kernel, "big") == []
    kernel.run("small = 1")
    kernel.run("del exp")
    first, second = kernel.value("[r.to_dict() for r in gpuexp.history()]")
    assert second["host"]["rss"]["start"] < first["host"]["rss"]["before_teardown"] - 200 * MiB
    assert second["host"]["rss"]["consumed"] > -16 * MiB


def test_rebinding_the_name_to_a_new_experiment_finishes_the_old_one(kernel):
    kernel.run(SETUP)
    kernel.run('exp = GPUExperiment("bs=32")')
    kernel.run("x = np.ones(8)")
    kernel.run('exp = GPUExperiment("bs=64")')
    assert kernel.value("[r.name for r in gpuexp.history()]") == ["bs=32"]
    assert names_present(kernel, "x") == []
    kernel.run("del exp")
    assert kernel.value("[r.name for r in gpuexp.history()]") == ["bs=32", "bs=64"]


def test_rebinding_in_a_loop_finishes_each_experiment_before_the_next(kernel):
    kernel.run(SETUP)
    kernel.run(
        "for bs in (1, 2, 3):\n"
        "    exp = CPUExperiment(f'bs={bs}')\n"
        "    batch = np.ones(bs << 20, dtype=np.uint8)\n"
        "del exp"
    )
    reports = kernel.value("[r.to_dict() for r in gpuexp.history()]")
    assert [r["name"] for r in reports] == ["bs=1", "bs=2", "bs=3"]
    assert [r["deleted"] for r in reports] == [["batch"]] * 3
    # The loop variable was rebound while the earlier experiments were open, but the loop still
    # uses it: it is kept, not deleted from under the loop.
    assert [r["kept"] for r in reports] == [["bs"], ["bs"], []]
    assert names_present(kernel, "batch", "exp", "bs") == ["bs"]


def test_rerunning_an_edited_cell_keeps_the_names_it_binds_above_the_constructor(kernel):
    kernel.run(SETUP)
    kernel.run('bs = 64\nexp = GPUExperiment(f"bs={bs}")')
    kernel.run("batch = np.ones(bs << 20, dtype=np.uint8)")
    kernel.run('bs = 128\nexp = GPUExperiment(f"bs={bs}")')
    assert kernel.value("bs") == 128
    assert names_present(kernel, "batch") == []
    first = kernel.value("gpuexp.history()[0].to_dict()")
    assert first["kept"] == ["bs"] and first["deleted"] == ["batch"]


def test_default_names_count_up(kernel):
    kernel.run(SETUP)
    kernel.run("e1 = CPUExperiment()\ne2 = CPUExperiment()")
    assert kernel.value("[e1.name, e2.name]") == ["exp-1", "exp-2"]


def test_history_json_has_the_documented_schema(kernel, tmp_path):
    path = tmp_path / "history.json"
    kernel.run(SETUP)
    kernel.run('exp = GPUExperiment("schema")')
    kernel.run("x = np.ones(8)")
    kernel.run("del exp")
    kernel.run(f"gpuexp.save_history({str(path)!r})")
    import json

    (report,) = json.loads(path.read_text())
    keys = ("name", "started_at", "finished_at", "duration_s", "deleted", "rebound", "kept", "cleared", "host", "gpus")
    for key in keys:
        assert key in report, key
    assert set(report["host"]["rss"]) == {"start", "before_teardown", "end", "peak", "consumed", "reclaimed"}
    assert {"available", "total", "cgroup_limit"} <= set(report["host"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", report["started_at"])
    assert report["duration_s"] >= 0


def test_text_and_html_tables_show_the_same_figures(kernel):
    kernel.run(SETUP)
    kernel.run('exp = CPUExperiment("units")')
    kernel.run("x = np.ones(3 << 20, dtype=np.uint8)")
    shown = kernel.run("del exp")
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", shown.html)
    figures = [c for c in cells if re.search(r"\d", c)]
    assert figures and all(f in shown.text for f in figures)
    assert all(re.fullmatch(r"[+-]?\d+(\.\d\d)? (B|KiB|MiB|GiB|TiB)|\d+\.\d%", f) for f in figures), figures


def test_gpuexp_never_imports_torch(kernel):
    kernel.run(SETUP)
    kernel.run('exp = GPUExperiment("no torch")\ngpuexp.snapshot()')
    kernel.run("del exp")
    assert kernel.value("'torch' in sys.modules") is False


def test_torch_cpu_tensors_are_measured_and_freed(kernel):
    kernel.run(SETUP + "import torch")
    kernel.run('exp = GPUExperiment("torch cpu")')
    kernel.run("t = torch.ones(64 << 20)\nbuiltins.t = weakref.ref(t)")
    kernel.run("del exp")
    assert kernel.value("builtins.t() is None")
    rss = last_report(kernel)["host"]["rss"]
    assert rss["consumed"] >= 250 * MiB and rss["reclaimed"] >= 250 * MiB
    assert kernel.value("torch.cuda.is_initialized()") is False


@pytest.mark.skipif(GPU, reason="checks the machine without an NVIDIA driver")
def test_without_a_driver_gpu_experiment_says_so_and_shows_host_rows(kernel):
    kernel.run(SETUP)
    started = kernel.run('exp = GPUExperiment("no driver")')
    assert started.text.count("no NVIDIA driver") == 1
    assert "host RSS" in started.text and "Traceback" not in started.text
    finished = kernel.run("del exp")
    assert "host RSS" in finished.text and "cuda:" not in finished.text
    assert last_report(kernel)["gpus"] == []


def test_bad_input_gets_a_clear_error(kernel):
    kernel.run(SETUP)
    bad_devices = kernel.run('GPUExperiment("x", devices="gpu zero")', expect_error=True)
    assert bad_devices.error.startswith("ValueError") and "devices=[0, 1]" in bad_devices.error
    bad_name = kernel.run("GPUExperiment(64)", expect_error=True)
    assert bad_name.error.startswith("TypeError") and "'bs=64'" in bad_name.error


def test_sampled_host_peak_when_the_kernel_peak_cannot_be_reset(make_kernel):
    kernel = make_kernel(GPUEXP_HOST_PEAK="sampled")
    kernel.run(SETUP + "import time")
    kernel.run('exp = CPUExperiment("sampled")')
    assert kernel.value("[gpuexp.config()['host_peak'], " + SAMPLER_RUNNING + "]") == ["sampled", True]
    kernel.run("spike = np.ones(300 << 20, dtype=np.uint8)\ntime.sleep(0.05)\ndel spike")
    kernel.run("del exp")
    rss = last_report(kernel)["host"]["rss"]
    assert rss["peak"] >= rss["start"] + 290 * MiB
    assert kernel.value(SAMPLER_RUNNING) is False
