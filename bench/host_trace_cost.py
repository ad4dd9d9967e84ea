"""What host tracing (`trace="host"`: Python's tracemalloc) costs, in a script.

    python bench/host_trace_cost.py [--json PATH] [--repeats R] [--cold]

Each figure is a ratio against a baseline taken in the same run, blocks alternated so that a
busy machine's drift falls on both alike:
  (a) a tiny MLP's Adam step on the CPU (torch imported and one step run first, so that torch's
      lazy imports are done): the median of R steps inside `CPUExperiment(trace="host")`
      against R steps in no experiment;
  (b) a loop that makes many small objects (100,000 dicts kept in a list), the same way;
  (a1), (b1): the same under a tracemalloc started with 1 frame before the experiment, which
      gpuexp then shares (its own default keeps more, to find your line under a library's);
  (c) the finish of a host-traced experiment whose code made 500,000 small strings, so that
      about half a million traces are compared: its time, against the loop that made them;
  (d) with --cold, the case of a fresh kernel: a new interpreter imports torch and runs 5 Adam
      steps, untraced and inside trace="host" (torch's lazy imports make most of the traces).

Only public tools: gpuexp's experiments, torch and tracemalloc. The reports gpuexp prints are
swallowed. Prints a table; --json writes the figures with the machine.
"""

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpuexp  # noqa: E402
from machine import cpu_model  # noqa: E402

MLP_STEP = """
import torch
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.Adam(model.parameters())
x = torch.randn(16, 32)

def step():
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
"""


def small_objects():
    return [{"i": i, "name": str(i)} for i in range(100_000)]


def timed(work, repeats):
    """The median of `repeats` runs of `work`, in seconds."""
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        work()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def quietly(call):
    with contextlib.redirect_stdout(io.StringIO()):
        return call()


def traced(work, repeats, frames=None):
    """`work`'s median inside a host-traced experiment; `frames`: a tracemalloc the caller starts
    first with that many frames, which gpuexp shares."""
    if frames:
        tracemalloc.start(frames)
    exp = quietly(lambda: gpuexp.CPUExperiment("bench", trace="host", cell_log=False))
    try:
        return timed(work, repeats)
    finally:
        quietly(exp.finish)
        if frames:
            tracemalloc.stop()


def ratios(work, repeats, rounds):
    """Median ratios, traced (gpuexp's frames, then 1 frame) against untraced, over alternated rounds."""
    default, one = [], []
    for _ in range(rounds):
        base = timed(work, repeats)
        default.append(traced(work, repeats) / base)
        base = timed(work, repeats)
        one.append(traced(work, repeats, frames=1) / base)
    return statistics.median(default), statistics.median(one)


def finish_at(traces):
    """Seconds to make `traces` small strings inside a host-traced experiment, and to finish it."""
    exp = quietly(lambda: gpuexp.CPUExperiment("bench", trace="host", cell_log=False))
    began = time.perf_counter()
    words = [str(i) for i in range(traces)]
    made = time.perf_counter() - began
    began = time.perf_counter()
    report = quietly(exp.finish)
    finished = time.perf_counter() - began
    del words
    counted = sum(row["blocks"] for row in report.to_dict()["host_trace"]["sites"])
    return made, finished, counted


# In a function: at a script's top level, the experiment's teardown would delete the globals
# made after it opened.
COLD = """
import contextlib, io, sys, time

def cold():
    began = time.perf_counter()
    if sys.argv[1] == "host":
        import gpuexp
        with contextlib.redirect_stdout(io.StringIO()):
            exp = gpuexp.CPUExperiment("cold", trace="host", cell_log=False)
    namespace = {}
    exec(sys.argv[2], namespace)
    for _ in range(5):
        namespace["step"]()
    trained = time.perf_counter() - began
    began = time.perf_counter()
    if sys.argv[1] == "host":
        with contextlib.redirect_stdout(io.StringIO()):
            exp.finish()
    print(trained, time.perf_counter() - began)

cold()
"""


def cold(mode):
    out = subprocess.run([sys.executable, "-c", COLD, mode, MLP_STEP], capture_output=True, text=True, check=True)
    trained, finished = map(float, out.stdout.split())
    return trained, finished


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cold", action="store_true")
    args = parser.parse_args()

    namespace = {}
    exec(MLP_STEP, namespace)  # noqa: S102 (the bench's own code)
    step = namespace["step"]
    step()  # torch's lazy imports, outside every measurement
    results = {"machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                           "load": os.getloadavg()[0]}}
    results["mlp_step"] = dict(zip(("gpuexp_frames", "one_frame"), ratios(step, args.repeats, args.rounds)))
    results["small_objects"] = dict(zip(("gpuexp_frames", "one_frame"),
                                        ratios(small_objects, max(3, args.repeats // 5), args.rounds)))
    made, finished, counted = finish_at(500_000)
    results["finish"] = {"traces": counted, "making_s": made, "finish_s": finished}
    if args.cold:
        untraced, _ = cold("none")
        host, finished = cold("host")
        results["cold"] = {"untraced_s": untraced, "traced_s": host, "ratio": host / untraced, "finish_s": finished}

    print(f"machine: {results['machine']}")
    for name in ("mlp_step", "small_objects"):
        row = results[name]
        print(f"{name:>14}: x{row['gpuexp_frames']:.2f} with trace='host', x{row['one_frame']:.2f} with 1 frame")
    row = results["finish"]
    print(f"{'finish':>14}: {row['finish_s']:.2f} s for {row['traces']} traces (making them: {row['making_s']:.2f} s)")
    if "cold" in results:
        row = results["cold"]
        print(f"{'cold':>14}: import + 5 steps {row['untraced_s']:.2f} s untraced, {row['traced_s']:.2f} s traced "
              f"(x{row['ratio']:.1f}), finish {row['finish_s']:.2f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
