"""What one full gpuexp snapshot costs, next to the raw calls it is made of.

    CUDA_VISIBLE_DEVICES=0 python bench/snapshot_cost.py [--json PATH] [--calls N] [--repeats R]

Run on a GPU machine (torch with CUDA, nvidia-ml-py, psutil, gpuexp installed). Each figure is
the median over R repeats of a loop of N calls (after a warm-up), with the garbage collector
paused during the loops as timeit does. The target: a full snapshot (host + one GPU, torch's
CUDA initialised) under 50 µs. Exit status: 0 when the target is met, 1 when not, 2 when it
cannot be measured here (no CUDA GPU, gpuexp not installed, gpuexp sees no GPU).
"""

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time

from machine import cpu_model

TARGET_US = 50.0
SNAPSHOT = "gpuexp._core.snapshot(True)"
# The raw readings a full snapshot of one GPU is made of (the host part's /proc/self/status
# read is timed as the snapshot does it: pread on a file kept open).
PARTS = (
    "pynvml nvmlDeviceGetMemoryInfo",
    "pynvml nvmlDeviceGetComputeRunningProcesses",
    "torch._C._cuda_memoryStats(0)",
    "/proc/self/status os.pread (fd kept open)",
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--calls", type=int, default=5000, help="calls per timed loop (default 5000)")
    parser.add_argument("--repeats", type=int, default=7, help="timed loops per call; the median is shown (default 7)")
    parser.add_argument("--cycles", type=int, default=200, help="GPUExperiment open+finish cycles (default 200)")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.repeats < 1 or args.cycles < 1:
        parser.error("--calls, --repeats and --cycles must be at least 1")
    return args


def fail(message):
    print(f"snapshot_cost: {message}", file=sys.stderr)
    return 2


def time_call(fn, calls, repeats):
    """Median and minimum µs per call over `repeats` loops of `calls` calls."""
    for _ in range(max(50, calls // 10)):
        fn()
    per_call = []
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            start = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            per_call.append((time.perf_counter_ns() - start) / calls / 1000)
    finally:
        if gc_was_enabled:
            gc.enable()
    return statistics.median(per_call), min(per_call)


def nvml_calls(nvml_index, notes):
    """The pynvml calls, or none (with a note) where pynvml is missing."""
    try:
        import pynvml
    except ImportError:
        notes.append("pynvml (nvidia-ml-py) is not installed: NVML rows are missing")
        return {}, None
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index)
    driver = pynvml.nvmlSystemGetDriverVersion()
    driver = driver.decode() if isinstance(driver, bytes) else driver
    memory_v2 = getattr(pynvml, "nvmlMemory_v2", None)
    try:
        if memory_v2 is None:
            raise TypeError("no nvmlMemory_v2")
        pynvml.nvmlDeviceGetMemoryInfo(handle, version=memory_v2)
        memory = lambda: pynvml.nvmlDeviceGetMemoryInfo(handle, version=memory_v2)  # noqa: E731
        label = "(v2)"
    except (TypeError, pynvml.NVMLError) as why:
        notes.append(f"nvmlDeviceGetMemoryInfo v2 not usable ({why}); timed the v1 call")
        memory = lambda: pynvml.nvmlDeviceGetMemoryInfo(handle)  # noqa: E731
        label = "(v1)"
    calls = {
        PARTS[0]: (memory, label),
        PARTS[1]: (lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(handle), ""),
    }
    return calls, driver


def host_calls(notes):
    status = os.open("/proc/self/status", os.O_RDONLY)

    def read_status():
        with open("/proc/self/status", "rb") as f:
            return f.read()

    calls = {
        "/proc/self/status open+read": (read_status, ""),
        PARTS[3]: (lambda: os.pread(status, 4096, 0), ""),
    }
    try:
        import psutil
    except ImportError:
        notes.append("psutil is not installed: psutil rows are missing")
        return calls
    process = psutil.Process()
    calls["psutil.Process().memory_info()"] = (lambda: psutil.Process().memory_info(), "")
    calls["psutil.Process() kept: .memory_info()"] = (process.memory_info, "")
    calls["psutil.virtual_memory()"] = (psutil.virtual_memory, "")
    return calls


def experiment_cycle_us(gpuexp, cycles):
    """Mean µs of GPUExperiment(...) + finish(), in a function so no name is deleted."""

    def cycle():
        exp = gpuexp.GPUExperiment("bench cycle")
        exp.finish()

    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        for _ in range(5):
            cycle()
        start = time.perf_counter_ns()
        for _ in range(cycles):
            cycle()
        elapsed = time.perf_counter_ns() - start
    return elapsed / cycles / 1000


def gc_collect_us(runs=20):
    """Mean µs of one full gc.collect(), a step of every finish()."""
    start = time.perf_counter_ns()
    for _ in range(runs):
        gc.collect()
    return (time.perf_counter_ns() - start) / runs / 1000


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
    try:
        import torch
    except ImportError as why:
        return fail(f"torch is not importable ({why}); run this on the GPU machine")
    if not torch.cuda.is_available():
        return fail(
            "no CUDA GPU: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}). "
            "This bench measures a snapshot of one GPU; run it on the GPU machine."
        )
    torch.zeros(1, device="cuda")  # creates the CUDA context and torch's allocator state
    torch.cuda.synchronize()
    try:
        import gpuexp
        import gpuexp._core as core
    except ImportError as why:
        return fail(f"gpuexp is not importable ({why}); install its wheel first (make build / make gpu-wheel)")

    first = core.snapshot(True)
    if not first.gpus:
        return fail("gpuexp's snapshot shows no GPU, so there is nothing to measure: " + "; ".join(first.notes))
    gpu = first.gpus[0]
    notes = list(first.notes)
    if gpu.get("torch") is None:
        notes.append("the snapshot has no torch figures for cuda:0")

    calls = {
        SNAPSHOT: (lambda: core.snapshot(True), ""),
        "gpuexp._core.snapshot(False) (host only)": (lambda: core.snapshot(False), ""),
    }
    nvml, driver = nvml_calls(gpu["nvml_index"], notes)
    calls.update(nvml)
    calls.update(
        {
            PARTS[2]: (lambda: torch._C._cuda_memoryStats(0), ""),
            "torch.cuda.memory_stats(0)": (lambda: torch.cuda.memory_stats(0), ""),
            "torch.cuda.memory_allocated(0)": (lambda: torch.cuda.memory_allocated(0), ""),
            "torch.cuda.is_initialized()": (torch.cuda.is_initialized, ""),
        }
    )
    calls.update(host_calls(notes))
    calls["empty Python call (loop overhead)"] = (lambda: None, "")

    machine = {
        "gpu": torch.cuda.get_device_name(0),
        "gpus_visible": torch.cuda.device_count(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "driver": driver,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "gpuexp": getattr(gpuexp, "__version__", "?"),
        "host_peak_exact": core.host_peak_exact(),
    }
    results = {}
    for name, (fn, label) in calls.items():
        median, best = time_call(fn, args.calls, args.repeats)
        results[name] = {"label": f"{name} {label}".strip(), "us_median": median, "us_min": best}
    full = results[SNAPSHOT]["us_median"]
    for row in results.values():
        row["ratio_to_snapshot"] = row["us_median"] / full
    cycle_us = experiment_cycle_us(gpuexp, args.cycles)
    collect_us = gc_collect_us()

    parts = [p for p in PARTS if p in results]
    parts_sum = sum(results[p]["us_median"] for p in parts)
    passed = full < TARGET_US

    print("# gpuexp snapshot cost\n")
    for key, value in machine.items():
        print(f"- {key}: {value}")
    print(f"- timing: median of {args.repeats} loops of {args.calls} calls, after a warm-up; gc paused\n")
    print("| call | µs per call (median) | ratio to full snapshot |")
    print("|---|---:|---:|")
    for row in results.values():
        print(f"| `{row['label']}` | {row['us_median']:.2f} | {row['ratio_to_snapshot']:.2f} |")
    print(f"| `GPUExperiment(...) + finish()` (mean of {args.cycles}) | {cycle_us:.1f} | {cycle_us / full:.1f} |")
    print(f"| `gc.collect()`, a step of finish() (mean of 20) | {collect_us:.1f} | {collect_us / full:.1f} |")
    print()
    print(f"Sum of the raw calls a snapshot is made of ({' + '.join(parts)}): {parts_sum:.2f} µs")
    print(f"Full snapshot: {full:.2f} µs, so {full - parts_sum:+.2f} µs beyond those calls")
    if len(parts) < len(PARTS):
        print(f"(the sum misses {', '.join(p for p in PARTS if p not in parts)})")
    for note in notes:
        print(f"note: {note}")
    verdict = "PASS" if passed else "FAIL"
    print(f"\n{verdict}: full snapshot of 1 GPU with torch initialised: {full:.2f} µs (target < {TARGET_US:.0f} µs)")

    if args.json:
        out = {
            "machine": machine,
            "calls_per_loop": args.calls,
            "repeats": args.repeats,
            "results": results,
            "experiment_cycle_us_mean": cycle_us,
            "experiment_cycles": args.cycles,
            "gc_collect_us_mean": collect_us,
            "snapshot_parts": parts,
            "snapshot_parts_sum_us": parts_sum,
            "snapshot_us": full,
            "target_us": TARGET_US,
            "pass": passed,
            "notes": notes,
        }
        directory = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(directory, exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
