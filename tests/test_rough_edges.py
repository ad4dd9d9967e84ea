"""Smaller rough edges (issue 21, section 5), one test each, in a real IPython kernel."""

from kernel import error_of, module_kernel

SETUP = """\
import copy, json, math, os, pickle, sys
import numpy as np
import gpuexp
from gpuexp import GPUExperiment
"""


shared = module_kernel(SETUP)


# ---- %%gpuexp -------------------------------------------------------------------------------


def test_a_gpuexp_cell_traceback_shows_the_users_line(kernel):
    kernel.run(SETUP)
    failed = kernel.run('%%gpuexp tb\nx = 1\nraise ValueError("boom in the body")', expect_error=True)
    assert failed.error == "ValueError: boom in the body"
    assert 'raise ValueError("boom in the body")' in failed.text, failed.text
    assert "<string>" not in failed.text
    assert "line 3" in failed.text, "the body keeps the cell's line numbers"
    assert kernel.value("gpuexp.history()[-1].name") == "tb", "the experiment still finished"


def test_a_quoted_gpuexp_name_keeps_its_params(kernel):
    kernel.run(SETUP)
    kernel.run('%%gpuexp "bs=64, lr=3e-4"\ny = 2')
    report = kernel.value("gpuexp.history()[-1].to_dict()")
    assert report["name"] == "bs=64, lr=3e-4"
    assert report["params"] == {"bs": 64, "lr": 3e-4}


# ---- config ---------------------------------------------------------------------------------


def test_a_bool_option_given_a_str_names_the_option(shared):
    for option in ("oom_rescue", "cell_log_all_gpus"):
        error = error_of(shared, f"gpuexp.config({option}='yes')")
        assert error.startswith("TypeError") and option in error and "True or False" in error, error


def test_a_min_change_past_what_a_machine_has_is_a_clear_value_error(shared):
    for value in ("2**70", "'9999999GiB'"):
        error = error_of(shared, f"gpuexp.config(cell_log_min_change={value})")
        assert error.startswith("ValueError") and "cell_log_min_change" in error and "1PiB" in error, error
    assert shared.value("gpuexp.config()['cell_log_min_change']") == 1 << 20, "unchanged"


def test_zero_is_taken_as_a_string_wherever_it_is_taken_as_a_number(shared):
    assert shared.value("gpuexp.config(cell_log_min_change='0')['cell_log_min_change']") == 0
    assert shared.value("gpuexp.config(cell_log_min_change=0)['cell_log_min_change']") == 0
    shared.run("gpuexp.config(cell_log_min_change='1MiB')")
    for value in ("0", "'0'"):  # a limit of 0 is refused either way, with the same words
        error = error_of(shared, f"GPUExperiment('zero', limit={value})")
        assert error.startswith("ValueError") and "more than 0" in error, error


# ---- keep() ---------------------------------------------------------------------------------


def test_keep_of_a_non_name_and_of_out_say_what_to_pass(kernel):
    kernel.run(SETUP + 'exp = GPUExperiment("keep")')
    error = error_of(kernel, "exp.keep(1)")
    assert error.startswith("TypeError") and "keep()" in error and "exp.keep('model'" in error, error
    error = error_of(kernel, "exp.keep('Out')")
    assert "IPython's own" in error and "output cache" in error and "no variable" not in error, error


# ---- compare() ------------------------------------------------------------------------------


def test_compare_of_a_number_or_a_dict_names_the_fix(shared):
    error = error_of(shared, "gpuexp.compare(42)")
    assert error.startswith("TypeError") and "compare([exp1, exp2])" in error, error
    error = error_of(shared, "gpuexp.compare({'a': 1})")
    assert error.startswith("TypeError") and "list(runs.values())" in error, error


def test_a_comparison_without_pandas_or_matplotlib_says_what_to_install(kernel):
    kernel.run(SETUP)
    kernel.run('with GPUExperiment("bs=1"):\n    pass\nwith GPUExperiment("bs=2"):\n    pass')
    # None in sys.modules: importing it fails as a missing module does.
    kernel.run("sys.modules['pandas'] = None\nsys.modules['matplotlib'] = None\nc = gpuexp.compare()")
    error = error_of(kernel, "c.to_pandas()")
    assert error == "ModuleNotFoundError: to_pandas() needs pandas: pip install pandas", error
    error = error_of(kernel, "c.plot()")
    assert error == "ModuleNotFoundError: plot() needs matplotlib: pip install matplotlib", error


# ---- save_history() -------------------------------------------------------------------------


def test_save_history_takes_paths_only(shared):
    error = error_of(shared, "gpuexp.save_history(2)")
    assert error.startswith("TypeError") and "file path" in error, error
    assert shared.value("os.fstat(2).st_mode > 0"), "the kernel's stderr is still open"


# ---- the OOM rescue -------------------------------------------------------------------------

RAISES = """\
def fails():
    big = np.ones(1 << 20)
    raise {error}
fails()
"""


def test_an_error_that_only_mentions_cuda_oom_is_left_for_debug(kernel):
    kernel.run(SETUP + "import torch")
    failed = kernel.run(RAISES.format(error='RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")'),
                        expect_error=True)
    assert "out-of-memory" not in failed.text.lower() and "rescue" not in failed.text.lower(), failed.text
    # %debug's frames: the failed call's locals are still there.
    kernel.run("tb = sys.last_traceback\nwhile tb.tb_next is not None:\n    tb = tb.tb_next")
    assert kernel.value("tb.tb_frame.f_code.co_name") == "fails"
    assert kernel.value("tb.tb_frame.f_locals['big'].size") == 1 << 20


def test_a_real_torch_out_of_memory_error_is_still_rescued(kernel):
    kernel.run(SETUP + "import torch")
    failed = kernel.run(RAISES.format(error='torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")'),
                        expect_error=True)
    assert failed.error.startswith("OutOfMemoryError")
    assert "2.00 GiB" in failed.text and "frames of the failed call" in failed.text, failed.text


# ---- a forked child -------------------------------------------------------------------------


def test_a_forked_child_finishing_the_parents_experiment_gets_a_clear_error(kernel, tmp_path):
    out = tmp_path / "child.txt"
    kernel.run(SETUP + 'exp = GPUExperiment("parent")')
    kernel.run(
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    try:\n"
        "        exp.finish()\n"
        "        result = 'finished'\n"
        "    except Exception as error:\n"
        "        result = f'{type(error).__name__}: {error}'\n"
        f"    open({str(out)!r}, 'w').write(result)\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)"
    )
    said = out.read_text()
    assert said.startswith("RuntimeError: this experiment belongs to process"), said
    assert "KeyError" not in said
    assert kernel.value("gpuexp._core.is_open(exp._id)"), "the parent's experiment is untouched"


# ---- Report is data -------------------------------------------------------------------------


def test_a_report_pickles_and_copies(kernel):
    kernel.run(SETUP + 'exp = GPUExperiment("data", params={"bs": 8})')
    kernel.run("a = np.ones(4 << 20, dtype=np.uint8)")
    kernel.run("report = exp.finish()")
    kernel.run("back = pickle.loads(pickle.dumps(report))\ncopied = copy.deepcopy({'r': report})['r']")
    assert kernel.value("str(back) == str(report) and back.to_dict() == report.to_dict()")
    assert kernel.value("len(back.to_dict()['cells']) == len(report.to_dict()['cells']) > 0")
    assert kernel.value("copied is report and copy.copy(report) is report")


# ---- params ---------------------------------------------------------------------------------


def test_params_refuse_nan_and_keep_numpy_bools_as_bools(shared):
    error = error_of(shared, "GPUExperiment('nan', params={'lr': math.nan})")
    assert error.startswith("ValueError") and "finite" in error and "'lr'" not in error or "lr" in error, error
    shared.run("with GPUExperiment('np bool', params={'flag': np.bool_(True), 'n': np.int64(3)}):\n    pass")
    assert shared.value("gpuexp.history()[-1].to_dict()['params']") == {"flag": True, "n": 3}
