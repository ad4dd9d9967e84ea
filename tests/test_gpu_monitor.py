"""The monitor and the `gpuexp` command on an NVIDIA GPU (`pytest -m gpu`), checked against NVML read directly."""

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import GPU_UUIDS

pytestmark = pytest.mark.gpu

GiB = 1 << 30
GPUEXP = shutil.which("gpuexp") or str(Path(sys.executable).parent / "gpuexp")


class NvmlMemoryV2(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("total", ctypes.c_ulonglong), ("reserved", ctypes.c_ulonglong),
                ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def nvml_used(index=0):
    """Device memory used, read through NVML directly. The v2 query, as nvidia-smi shows it: the
    v1 query's "used" also counts what the driver reserves (about 600 MiB on an H200)."""
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
    nvml.nvmlInit_v2()
    handle = ctypes.c_void_p()
    nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle))
    memory = NvmlMemoryV2(version=ctypes.sizeof(NvmlMemoryV2) | (2 << 24))
    assert nvml.nvmlDeviceGetMemoryInfo_v2(handle, ctypes.byref(memory)) == 0
    nvml.nvmlShutdown()
    return memory.used


def test_the_timeline_matches_nvml_and_shows_a_2_gib_allocation(kernel):
    kernel.run("import time, torch, gpuexp\ntorch.ones(1, device='cuda');")
    kernel.run(
        "mon = gpuexp.Monitor('10ms').start()\n"
        "time.sleep(0.1)\n"
        "t = torch.empty(2 << 30, dtype=torch.uint8, device='cuda')\n"
        "time.sleep(0.2)\n"
        "del t\n"
        "torch.cuda.empty_cache()\n"
        "time.sleep(0.1)\n"
        "mon.stop();"
    )
    samples = kernel.value("mon.samples()")
    process = [s["gpus"][0]["process_used"] for s in samples]
    assert max(process) - process[0] >= 2 * GiB
    assert all(0 <= (s["gpus"][0]["utilization"] or 0) <= 100 for s in samples)
    assert samples[0]["gpus"][0]["uuid"] in GPU_UUIDS
    # Nothing changes between the last sample and now: the figures must agree with NVML's own.
    last = samples[-1]["gpus"][0]["used"]
    assert abs(last - nvml_used(GPU_UUIDS.index(samples[0]["gpus"][0]["uuid"]))) <= 64 << 20


def test_status_lists_every_gpu_and_the_processes_on_them(kernel):
    kernel.run("import os, torch\nt = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')")
    kernel_pid = kernel.value("os.getpid()")
    done = subprocess.run([GPUEXP, "status", "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert [d["uuid"] for d in status["devices"]] == GPU_UUIDS and status["order"] == "nvml"
    pids = [p["pid"] for d in status["devices"] for p in d["processes"]]
    assert kernel_pid in pids
    assert "sees" in status["torch"]
    text = subprocess.run([GPUEXP, "status"], capture_output=True, text=True, timeout=60)
    assert text.returncode == 0 and "NVML order" in text.stdout and f"pid {kernel_pid}" in text.stdout


def test_cuda_order_honours_cuda_visible_devices():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=GPU_UUIDS[-1])
    done = subprocess.run([GPUEXP, "status", "--json", "--cuda-order"],
                          capture_output=True, text=True, env=env, timeout=60)
    status = json.loads(done.stdout)
    assert [(d["index"], d["uuid"]) for d in status["devices"]] == [(0, GPU_UUIDS[-1])]


def test_watch_logs_csv_and_stops_cleanly_on_ctrl_c(tmp_path):
    import signal
    import time

    log = tmp_path / "watch.csv"
    watch = subprocess.Popen([GPUEXP, "watch", "-n", "0.2", "--csv", "--log", str(log)],
                             stdout=subprocess.PIPE, text=True)
    time.sleep(1.5)
    watch.send_signal(signal.SIGINT)
    out, _ = watch.communicate(timeout=10)
    assert watch.returncode == 0
    rows = log.read_text().splitlines()
    assert rows[0].startswith("timestamp,index,name") and len(rows) >= 1 + 5 * len(GPU_UUIDS)
    assert out.splitlines() == rows


def test_watch_json_rows_match_nvml_and_the_live_view_lists_every_gpu():
    import signal
    import time

    watch = subprocess.Popen([GPUEXP, "watch", "-n", "0.2", "--json"], stdout=subprocess.PIPE, text=True)
    time.sleep(1.2)
    watch.send_signal(signal.SIGINT)
    out, _ = watch.communicate(timeout=10)
    assert watch.returncode == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) >= 3 * len(GPU_UUIDS)
    last = {row["index"]: row for row in rows}
    for index, row in last.items():
        assert 0 <= row["utilization"] <= 100 and row["memory_total"] > row["memory_used"] >= 0
        # Nothing else allocates meanwhile: the last refresh agrees with NVML read now.
        assert abs(row["memory_used"] - nvml_used(index)) <= 64 << 20
    live = subprocess.Popen([GPUEXP, "watch", "-n", "0.2"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.6)
    live.send_signal(signal.SIGINT)
    text, _ = live.communicate(timeout=10)
    assert live.returncode == 0 and "gpuexp watch ·" in text and "NVML order" in text
    assert all(uuid in text for uuid in GPU_UUIDS)
