"""The `gpuexp` command and the monitor without a GPU (CI): exit codes, messages, host-only
timelines, file formats and bad input."""

import builtins
import csv
import gc
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import GPU

GPUEXP = shutil.which("gpuexp") or str(Path(sys.executable).parent / "gpuexp")


def cli(*args, timeout=30):
    return subprocess.run([GPUEXP, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(GPU, reason="checks the machine without an NVIDIA driver")
@pytest.mark.parametrize("args", [["status"], ["status", "--json"], ["watch", "-n", "0.1"], ["watch", "--csv"]])
def test_without_a_driver_the_cli_says_so_and_what_to_do_instead(args):
    from gpuexp.cli import NO_DRIVER_FIX

    said = f"no NVIDIA driver (libnvidia-ml.so.1 not found): {NO_DRIVER_FIX}"
    assert "install the NVIDIA driver" in said and "gpuexp.snapshot()" in said
    done = cli(*args)
    assert done.returncode == 3, done
    assert done.stderr.strip() == f"gpuexp: {said}"
    if "--json" in args:
        # A script reading --json still gets JSON: the error and no devices.
        assert json.loads(done.stdout) == {"error": said, "exit_code": 3, "devices": []}
    else:
        assert done.stdout == ""


@pytest.mark.skipif(GPU, reason="checks the machine without an NVIDIA driver")
def test_without_a_driver_the_core_raises_nvml_unavailable():
    from gpuexp import _core

    assert issubclass(_core.NvmlUnavailable, RuntimeError)
    for open_it in (lambda: _core.GpuStatus(), lambda: _core.Watch(False, "csv", 1.0)):
        with pytest.raises(_core.NvmlUnavailable, match="no NVIDIA driver"):
            open_it()


@pytest.mark.gpu
def test_an_unwritable_log_is_an_os_error_not_a_missing_driver():
    from gpuexp import _core

    view = _core.Watch(False, "csv", 1.0)
    with pytest.raises(OSError, match="--log /nonexistent/dir/w.csv: cannot write there") as raised:
        view.run("/nonexistent/dir/w.csv")
    assert not isinstance(raised.value, RuntimeError)


def test_torch_build_is_read_from_its_files_without_importing_it():
    read = "import sys; from gpuexp import cli; print(*cli.torch_build() or ['none']); print('torch' in sys.modules)"
    found = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True, timeout=60)
    truth = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
                           capture_output=True, text=True, timeout=120)
    build, imported = found.stdout.splitlines()
    assert build == (truth.stdout.strip() if truth.returncode == 0 else "none")
    assert imported == "False"


@pytest.mark.parametrize("build, driver_cuda, says", [
    (("2.5.1+cpu", None), "13.0", "a CPU-only build, so it sees no CUDA device"),
    (("2.11.0+cu130", "13.0"), "12.4", "newer than the driver's CUDA 12.4: it sees no CUDA device. Update the driver"),
])
def test_status_judges_whether_torch_sees_cuda_without_importing_it(monkeypatch, build, driver_cuda, says):
    from gpuexp import cli as command

    monkeypatch.setattr(command, "torch_build", lambda: build)
    judged = command.torch_status(driver_cuda, import_it=False)
    assert judged["sees"] == 0 and says in judged["line"], judged


@pytest.mark.parametrize("args, message", [
    (["watch", "-n", "0"], "between 0.01 and 86400 seconds"),
    (["watch", "-n", "inf"], "between 0.01 and 86400 seconds"),
    (["watch", "-n", "1e-9"], "between 0.01 and 86400 seconds"),
    (["watch", "--csv", "--json"], "not allowed with"),
    (["frobnicate"], "invalid choice"),
    (["watch", "--log", "/nonexistent/dir/watch.csv"], "cannot write there"),
])
def test_bad_arguments_get_usage_errors(args, message):
    done = cli(*args)
    assert done.returncode == 2 and message in done.stderr, done
    # A subcommand's bad value shows that subcommand's usage.
    if args[0] == "watch":
        assert done.stderr.startswith("usage: gpuexp watch"), done.stderr


def test_the_command_says_its_version():
    import gpuexp

    done = cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"gpuexp {gpuexp.__version__}", done


@pytest.mark.parametrize("kind, message, code", [
    ("NvmlUnavailable", "no NVIDIA driver (libnvidia-ml.so.1 not found)", 3),
    ("OSError", "--log run.csv: No space left on device", 1),
    ("BrokenPipeError", "the output closed", 1),
    ("RuntimeError", "GPU is lost", 1),
    ("ValueError", 'style "html": use "live", "csv" or "json"', 2),
])
def test_each_failure_exits_with_its_own_code(monkeypatch, capsys, kind, message, code):
    import gpuexp
    from gpuexp import cli as command

    error = (getattr(gpuexp, kind, None) or getattr(builtins, kind))(message)

    def fail(args):
        raise error

    monkeypatch.setattr(command, "status", fail)
    assert command.main(["status"]) == code
    fix = f": {command.NO_DRIVER_FIX}" if kind == "NvmlUnavailable" else ""
    assert capsys.readouterr().err == f"gpuexp: {message}{fix}\n"


def test_a_bug_in_the_command_keeps_its_traceback(monkeypatch):
    from gpuexp import cli as command

    monkeypatch.setattr(command, "watch", lambda args: {}["missing"])
    with pytest.raises(KeyError):
        command.main(["watch"])


def test_help_lists_the_commands():
    done = cli("--help")
    assert done.returncode == 0 and "status" in done.stdout and "watch" in done.stdout


def record(tmp_path, name, seconds=0.3, interval="20ms"):
    import gpuexp

    path = tmp_path / name
    gc.collect()  # earlier tests' garbage, freed during the timeline, would hide part of the rise
    with gpuexp.Monitor(interval, path) as mon:
        buffer = bytearray(128 << 20)
        time.sleep(seconds)
        del buffer
    return mon, path


def test_a_host_timeline_in_json_lines(tmp_path):
    mon, path = record(tmp_path, "run.jsonl")
    samples = mon.samples()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == len(samples) >= 10
    assert lines[0].keys() >= {"t", "time", "cpu_percent", "rss", "available", "gpus"}
    rss = [s["rss"] for s in samples]
    assert max(rss) - min(rss) >= 120 << 20, rss
    times = [s["t"] for s in samples]
    assert times == sorted(times)
    if not GPU:
        assert all(s["gpus"] == [] for s in samples)


def test_a_host_timeline_in_csv_and_pandas(tmp_path):
    mon, path = record(tmp_path, "run.csv")
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == len(mon.samples()) and {"t", "rss", "cpu_percent"} <= rows[0].keys()
    pandas = pytest.importorskip("pandas")
    frame = mon.to_pandas()
    assert isinstance(frame, pandas.DataFrame) and len(frame) == len(rows)


def test_the_plot_is_a_figure_and_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    mon, _ = record(tmp_path, "run.jsonl")
    figure = mon.plot(tmp_path / "timeline.png")
    assert figure.axes and (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_intervals_are_read_as_people_write_them():
    import gpuexp

    for written, seconds in ((0.25, 0.25), (2, 2.0), ("100ms", 0.1), (" 1.5 s ", 1.5), ("1sec", 1.0), ("2min", 120.0)):
        assert gpuexp.Monitor(written).interval == pytest.approx(seconds), written
    with pytest.raises(ValueError, match=r"""interval="fast": write a time such as "100ms", "1s" or a number"""):
        gpuexp.Monitor("fast")


def test_bad_monitor_input_is_refused_before_any_thread(tmp_path):
    import gpuexp

    for interval in (0, -1, "fast", "0ms", float("nan"), float("inf"), True, None):
        with pytest.raises(ValueError, match="interval"):
            gpuexp.Monitor(interval)
    with pytest.raises(OSError, match="cannot write"):
        gpuexp.Monitor("10ms", tmp_path / "missing" / "t.jsonl").start()
    with pytest.raises(ValueError, match=".jsonl"):
        gpuexp.Monitor("10ms", tmp_path / "t.txt").start()
    import threading

    assert not [t for t in threading.enumerate() if "gpuexp" in t.name]


def test_the_monitor_runs_in_a_kernel_without_taking_the_gil(kernel):
    kernel.run("import gpuexp, time\nmon = gpuexp.Monitor('5ms').start()")
    kernel.run("t = time.perf_counter()\nn = 0\nwhile time.perf_counter() - t < 0.3:\n    n += 1\nmon.stop()")
    assert kernel.value("len(mon.samples())") >= 40


def test_an_experiment_with_a_timeline_plots_it(kernel, tmp_path):
    pytest.importorskip("matplotlib")
    kernel.run("import time, gpuexp")
    kernel.run("exp = gpuexp.CPUExperiment('timed', monitor='10ms')")
    kernel.run("buf = bytearray(128 << 20)\ntime.sleep(0.2)")
    kernel.run("del exp")
    report = kernel.value("gpuexp.history()[-1].to_dict()")
    assert len(report["monitor"]) >= 10
    rss = [s["rss"] for s in report["monitor"]]
    assert max(rss) - min(rss) >= 120 << 20, rss
    path = tmp_path / "timed.png"
    kernel.run(f"gpuexp.history()[-1].plot({str(path)!r});")
    assert path.read_bytes()[:4] == b"\x89PNG"
    untimed = kernel.run("gpuexp.CPUExperiment('plain').finish().plot()", expect_error=True)
    assert "monitor=True" in untimed.error


def _in_forked_child(monitor, queue):
    count = len(monitor.samples())  # the samples' lock is never inherited held
    monitor.stop()  # the parent's thread is not here: it is let go, never joined
    queue.put((count, monitor._native is None))


def test_a_forked_child_of_a_running_monitor_reads_and_stops_it_without_hanging():
    import multiprocessing

    import gpuexp

    forked = multiprocessing.get_context("fork")
    with gpuexp.Monitor("1ms") as mon:
        time.sleep(0.05)
        for _ in range(20):  # forks at different moments of the thread's rounds
            queue = forked.Queue()
            child = forked.Process(target=_in_forked_child, args=(mon, queue))
            child.start()
            count, stopped = queue.get(timeout=20)
            child.join(20)
            assert child.exitcode == 0 and count > 0 and stopped
        assert mon._native.running, "the parent's monitor kept recording"
    assert len(mon.samples()) > 20
