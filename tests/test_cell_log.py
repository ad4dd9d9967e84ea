"""The per-cell memory log, its magics and its sampler thread, in real kernels (host figures)."""

import subprocess
import sys
import textwrap
import time

import pytest
from nbclient.util import run_sync

from conftest import GPU, SAMPLER_RUNNING

MiB = 1 << 20
GPUEXP_THREADS = "[t.name for t in threading.enumerate() if t is not threading.main_thread() and 'gpuexp' in t.name]"
# gpuexp's one Python thread: the live view's, which waits in the core without the GIL.
LIVE_VIEW_THREAD = ["gpuexp-live-view"]

SETUP = """\
import sys, threading, time
import numpy as np
import gpuexp
from gpuexp import CPUExperiment, GPUExperiment
"""


def test_an_experiment_logs_each_cell_and_keeps_the_records(kernel):
    kernel.run(SETUP)
    kernel.run('exp = CPUExperiment("logged")')
    shown = kernel.run("spike = bytearray(300 << 20)\ndel spike\nkept = bytearray(20 << 20)")
    assert "gpuexp · cell [" in shown.text and "host RSS" in shown.text
    assert "peak above start" in shown.html
    record = kernel.value("exp.cells[-1].to_dict()")
    host = record["host"]
    assert 19 * MiB <= host["consumed"] <= 24 * MiB
    assert host["peak_above_start"] >= 290 * MiB  # other memory may be freed before the spike
    assert host["peak_above_start"] <= 330 * MiB
    assert record["wall_s"] > 0
    kernel.run("del exp")
    report = kernel.value("gpuexp.history()[-1].to_dict()")
    # The constructor's cell began before the log was on: the spike cell and the value cell are logged.
    assert [c["execution_count"] for c in report["cells"]] == [3, 4]


def test_a_1_gib_bytearray_peaks_at_1_gib_within_1_percent(kernel):
    kernel.run(SETUP + "%gpuexp log on")
    kernel.run("b = bytearray(1 << 30)\ndel b")
    peak = kernel.value("gpuexp.cells()[-1].to_dict()['host']['peak_above_start']")
    assert abs(peak - (1 << 30)) <= 0.01 * (1 << 30), peak


def test_a_cell_starts_where_the_last_one_ended_unless_gpuexp_read_memory_in_between(kernel):
    kernel.run(SETUP + "%gpuexp log on")
    kernel.run('exp = CPUExperiment("freed after its cell")')
    kernel.run("x = bytearray(64 << 20)")
    # The teardown deletes x once the cell's window has closed: its 64 MiB are no cell's.
    kernel.run("del exp")
    assert "gpuexp · cell" not in kernel.run("y = 1").text
    # Memory moved between two cells by other code (here a timer thread) is the next cell's.
    kernel.run("held = []\nthreading.Timer(0.2, lambda: held.append(bytearray(32 << 20))).start()")
    time.sleep(1.0)
    assert kernel.value("len(held)") == 1
    consumed = kernel.value("gpuexp.cells()[-1].to_dict()['host']['consumed']")
    assert 31 * MiB <= consumed <= 34 * MiB, consumed
    # Cells run while the log was off are no logged cell's either.
    kernel.run("%gpuexp log off")
    kernel.run("unlogged = bytearray(48 << 20)")
    kernel.run("%gpuexp log on")
    assert "gpuexp · cell" not in kernel.run("z = 1").text


def test_unload_ext_removes_the_hooks_and_load_ext_brings_them_back(kernel):
    kernel.run(SETUP + "%gpuexp log on")
    assert "gpuexp · cell" in kernel.run("a = bytearray(8 << 20)").text
    kernel.run("%unload_ext gpuexp")
    assert "gpuexp · cell" not in kernel.run("b = bytearray(8 << 20)").text
    assert "`%gpuexp` not found" in kernel.run("%gpuexp log on", expect_error=True).text, "the magic is gone"
    assert kernel.value("gpuexp._core.cell_log_active()") is False
    kernel.run("%load_ext gpuexp\n%gpuexp log on")
    assert "gpuexp · cell" in kernel.run("c = bytearray(8 << 20)").text


def test_cell_log_false_and_log_off_print_nothing(kernel):
    kernel.run(SETUP)
    kernel.run('exp = CPUExperiment("quiet", cell_log=False)')
    quiet = kernel.run("x = bytearray(8 << 20)")
    assert "gpuexp · cell" not in quiet.text
    assert kernel.value("len(exp.cells)") == 0
    kernel.run("%gpuexp log on")
    assert "gpuexp · cell" in kernel.run("y = bytearray(8 << 20)").text
    kernel.run("%gpuexp log off")
    assert "gpuexp · cell" not in kernel.run("z = 1").text


def test_nested_experiments_and_cells_keep_their_own_peaks(kernel):
    kernel.run(SETUP)
    kernel.run('outer = CPUExperiment("outer")')
    kernel.run("a = bytearray(400 << 20)\ndel a")
    kernel.run('inner = CPUExperiment("inner")')
    kernel.run("b = bytearray(100 << 20)\ndel b")
    kernel.run("c = bytearray(50 << 20)\ndel c")
    last_cell = kernel.value("gpuexp.cells()[-1].to_dict()['host']")
    kernel.run("del inner")
    kernel.run("del outer")
    outer, inner = (kernel.value(f"gpuexp.history()[{i}].to_dict()['host']['rss']") for i in (1, 0))
    assert 48 * MiB <= last_cell["peak_above_start"] <= 60 * MiB
    assert 95 * MiB <= inner["peak"] - inner["start"] <= 115 * MiB
    assert outer["peak"] - outer["start"] >= 390 * MiB


def test_a_failing_cell_and_an_interrupted_cell_are_logged(kernel):
    kernel.run(SETUP + "%gpuexp log on")
    failed = kernel.run("buf = bytearray(10 << 20)\nraise ValueError('boom')", expect_error=True)
    assert "ValueError" in failed.error and "gpuexp · cell [" in failed.text
    interrupted = kernel.run("more = bytearray(4 << 20)\nraise KeyboardInterrupt", expect_error=True)
    assert "KeyboardInterrupt" in interrupted.error and "gpuexp · cell [" in interrupted.text
    # The sampler runs while the log is on wherever there is a GPU to sample, and only there.
    assert kernel.value(SAMPLER_RUNNING) is GPU
    assert kernel.value(GPUEXP_THREADS) == LIVE_VIEW_THREAD


def test_cell_magic_runs_one_cell_as_an_experiment(kernel):
    kernel.run(SETUP)
    shown = kernel.run("%%gpuexp one cell\nbig = np.ones(64 << 20, dtype=np.uint8)")
    assert "one cell · finished" in shown.text and "deleted: big" in shown.text
    assert kernel.value("'big' in globals()") is False
    assert "host RSS" in kernel.run("%gpuexp status").text
    bad = kernel.run("%gpuexp bogus")
    assert "unknown command" in bad.text and "%gpuexp log all" in bad.text


def test_config_checks_the_sample_interval(kernel):
    kernel.run(SETUP)
    assert kernel.value("gpuexp.config()['sample_interval_ms']") == 1.0
    assert kernel.value("gpuexp.config(sample_interval_ms=5)['sample_interval_ms']") == 5.0
    for bad in ("0", "-1", "float('nan')", "10**9"):
        failed = kernel.run(f"gpuexp.config(sample_interval_ms={bad})", expect_error=True)
        assert failed.error.startswith("ValueError") and "sample_interval_ms" in failed.error, failed.error
    wrong_type = kernel.run("gpuexp.config(sample_interval_ms='1ms')", expect_error=True)
    assert wrong_type.error.startswith("TypeError")


def test_sampler_thread_starts_stops_and_never_deadlocks_with_the_gil(tmp_path):
    """Many Python threads open and finish scopes (each starting and joining the sampler) while
    others run pure Python and read snapshots: a lock order that could deadlock with the GIL hangs
    here, and the timeout catches it."""
    script = tmp_path / "stress.py"
    script.write_text(textwrap.dedent("""
        import os, threading, time
        os.environ["GPUEXP_HOST_PEAK"] = "sampled"   # the sampler thread then runs with every scope
        import gpuexp
        from gpuexp import _core
        def sampler_running():
            return eval(SAMPLER_RUNNING_EXPR)
        stop = time.monotonic() + 3
        def scopes():
            while time.monotonic() < stop:
                with gpuexp.CPUExperiment("stress", cell_log=False):
                    _core.snapshot(False)
        def configure():
            while time.monotonic() < stop:
                gpuexp.config(sample_interval_ms=0.2)
                gpuexp.config(sample_interval_ms=1)
        def python_work():
            n = 0
            while time.monotonic() < stop:
                n += sum(range(1000))
        threads = [threading.Thread(target=f) for f in (scopes, scopes, configure, python_work, python_work)]
        import contextlib, io
        with contextlib.redirect_stdout(io.StringIO()):
            for t in threads: t.start()
            for t in threads: t.join()
            # The threads' finishes wait for the main thread (issue 38): its next opening runs them.
            with gpuexp.CPUExperiment("settle", cell_log=False):
                pass
        assert not sampler_running()
        assert [t.name for t in threading.enumerate()] == ["MainThread"]
        names = []
        for task in os.listdir("/proc/self/task"):
            try:  # a thread may exit while we list: gone is not stuck
                names.append(open(f"/proc/self/task/{task}/comm").read().strip())
            except FileNotFoundError:
                pass
        assert "gpuexp-sampler" not in names, names
        print("ok")
    """).replace("SAMPLER_RUNNING_EXPR", repr(SAMPLER_RUNNING)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-2000:]


def test_the_sampler_is_joined_at_exit_and_after_fork(tmp_path):
    script = tmp_path / "lifecycle.py"
    script.write_text(textwrap.dedent("""
        import os
        os.environ["GPUEXP_HOST_PEAK"] = "sampled"
        import gpuexp
        def sampler_running():
            return eval(SAMPLER_RUNNING_EXPR)
        exp = gpuexp.CPUExperiment("left open", cell_log=False)
        assert sampler_running()
        pid = os.fork()
        if pid == 0:
            # The child has no sampler thread and must not think it has one.
            code = 0 if not sampler_running() else 3
            with gpuexp.CPUExperiment("child", cell_log=False):
                code = code or (0 if sampler_running() else 4)
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0, status
        assert sampler_running()
        print("exiting with the sampler running")
    """).replace("SAMPLER_RUNNING_EXPR", repr(SAMPLER_RUNNING)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "exiting with the sampler running" in done.stdout


def test_a_kernel_restart_leaves_no_stuck_process(make_kernel):
    kernel = make_kernel(GPUEXP_HOST_PEAK="sampled")
    kernel.run(SETUP + "exp = CPUExperiment('across a restart')")
    assert kernel.value(SAMPLER_RUNNING) is True
    old_pid = kernel.value("__import__('os').getpid()")
    started = time.monotonic()
    run_sync(kernel.client.km.restart_kernel)(now=False)
    # A kernel that does not exit by itself is killed after shutdown_wait_time: it must not come to that.
    assert time.monotonic() - started < kernel.client.km.shutdown_wait_time
    run_sync(kernel.client.kc.wait_for_ready)(timeout=60)
    assert kernel.value("__import__('os').getpid()") != old_pid
    with pytest.raises(ProcessLookupError):
        __import__("os").kill(old_pid, 0)


def test_a_cell_interrupted_by_the_kernel_manager_is_logged_and_the_log_goes_on(kernel):
    kernel.run(SETUP + "%gpuexp log on")
    kc, km = kernel.client.kc, kernel.client.km
    msg_id = kc.execute("buf = bytearray(16 << 20)\ntime.sleep(30)")
    time.sleep(1.5)
    run_sync(km.interrupt_kernel)()
    while True:
        reply = run_sync(kc.get_shell_msg)(timeout=30)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    interrupted = reply["content"]["execution_count"]
    record = kernel.value(f"[c.to_dict() for c in gpuexp.cells() if c.execution_count == {interrupted}]")
    assert len(record) == 1 and record[0]["wall_s"] >= 1.0
    assert record[0]["host"]["consumed"] >= 15 * MiB
    assert "gpuexp · cell [" in kernel.run("after = bytearray(4 << 20)").text
    assert kernel.value(GPUEXP_THREADS) == LIVE_VIEW_THREAD
