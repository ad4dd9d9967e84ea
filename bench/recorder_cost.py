"""What the flight recorder costs (issue 29), measured three ways on a GPU machine:

1. **Per event and per operator**, in tight loops that take the noise of a whole step away:
   an allocation and its free (`torch.empty` of 1 KiB on the GPU, dropped at once), and an
   in-place operator that allocates nothing (`add_` on a small tensor), each timed with torch's
   history off, on as the recorder runs it (`context=None`, no stacks) and off again after a
   recording stopped (pytorch #153571: hooks that outlived `_record_memory_history(None)`). The
   loops run in rounds, the conditions interleaved, and the figure is the median round.
2. **Per step, interleaved step by step**, inside an open experiment, gpuexp's own recorder
   (`gpuexp.config(flight_recorder=)`) switched on and off between single steps of each workload
   (bench/trace_workloads.py), order alternating, the cost the median of the paired steps' ratio
   with a bootstrap 95% interval (blocks of steps drift with the host; neighbouring steps do
   not), in its two phases: the first steps of a cell, with torch's history (no stacks) and the
   optimizer step hook, and every later step, with a level read at most four times a second.
   The gate (+1%) is on the later steps: a cell's first `HISTORY_STEPS` steps pay the history's
   cost.
And the host memory of a full ring buffer (RSS growth while `MAX_ENTRIES` events are recorded).

    python bench/recorder_cost.py [--models mlp12,resnet50,gpt2] [--pairs 150]

Exit status 0 when every model's later steps cost at most +1%, 1 when not, 2 without a GPU.
"""

import argparse
import contextlib
import io
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MAX_ENTRIES = 200_000
GATE = 0.01
LOOP = 20_000
ROUNDS = 15


def history(torch, on):
    if on:
        torch.cuda.memory._record_memory_history("all", context=None, stacks="python", max_entries=MAX_ENTRIES)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


def loop_seconds(torch, kind, small):
    torch.cuda.synchronize()
    started = time.perf_counter()
    if kind == "alloc":
        for _ in range(LOOP):
            torch.empty(256, device="cuda")
    else:
        for _ in range(LOOP):
            small.add_(1.0)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / LOOP


def per_event_costs(torch):
    """ns added to an allocation+free and to an operator, while recording and after it stopped."""
    small = torch.zeros(16, device="cuda")
    for kind in ("alloc", "op"):
        loop_seconds(torch, kind, small)
    never = {kind: statistics.median(loop_seconds(torch, kind, small) for _ in range(ROUNDS))
             for kind in ("alloc", "op")}
    rounds = {(kind, state): [] for kind in ("alloc", "op") for state in ("off", "on")}
    for round_ in range(ROUNDS):
        for state in (("off", "on") if round_ % 2 else ("on", "off")):
            history(torch, state == "on")
            for kind in ("alloc", "op"):
                rounds[kind, state].append(loop_seconds(torch, kind, small))
            history(torch, False)
    median = {key: statistics.median(values) for key, values in rounds.items()}
    return {
        kind: {
            "never recorded ns": never[kind] * 1e9,
            "recording adds ns": (median[kind, "on"] - median[kind, "off"]) * 1e9,
            "after a recording adds ns": (median[kind, "off"] - never[kind]) * 1e9,
        }
        for kind in ("alloc", "op")
    }


def bootstrap_median(values, draws=2000):
    medians = sorted(statistics.median(random.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws)]


def interleaved_cost(gpuexp, step, batch_size, pairs, phase):
    """Median ratio of neighbouring steps with gpuexp's recorder on (in `phase`: "history" for a
    cell's first steps, "levels" after them) and off, and its 95% interval."""
    from gpuexp import _core

    ratios, off_times = [], []
    for pair in range(pairs):
        timed = {}
        for on in ((True, False) if pair % 2 else (False, True)):
            gpuexp.config(flight_recorder=on)
            if on:
                _core.arm_recorder()  # as at a cell's start
                # The history's steps but the last, untimed: the timed one is the last with it.
                untimed = _core.RECORDER_HISTORY_STEPS - (1 if phase == "history" else 0)
                for _ in range(untimed):
                    step(batch_size)
            else:
                step(batch_size)  # one untimed step in the new state: the switch's own work settles
            started = time.perf_counter()
            step(batch_size)
            timed[on] = time.perf_counter() - started
        gpuexp.config(flight_recorder=False)
        ratios.append(timed[True] / timed[False] - 1)
        off_times.append(timed[False])
    return statistics.median(ratios), bootstrap_median(ratios), statistics.median(off_times)


def step_counts(torch, step, batch_size):
    """(allocator events, operators) of one step."""
    history(torch, True)
    step(batch_size)
    events = len(torch.cuda.memory._snapshot()["device_traces"][0])
    history(torch, False)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        operators = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.operators += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step(batch_size)
    return events, Count.operators


def ring_buffer_bytes(torch, step, batch_size, events_a_step):
    def rss():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))

    before = rss()
    history(torch, True)
    for _ in range(MAX_ENTRIES // max(events_a_step, 1) + 2):
        step(batch_size)
    grown = rss() - before
    history(torch, False)
    return grown


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp12,resnet50,gpt2")
    parser.add_argument("--pairs", type=int, default=150)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to measure")
        return 2
    import gpuexp
    import trace_workloads

    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    costs = per_event_costs(torch)
    for kind, figures in costs.items():
        print(f"  {kind:5}: " + ", ".join(f"{name} {value:+.0f}" if "adds" in name else f"{name} {value:.0f}"
                                        for name, value in figures.items()))
    failed = []
    grown = None
    for name in args.models.split(","):
        try:
            step, batch_size = trace_workloads.MAKERS[name](torch, torch.device("cuda", 0))
        except ImportError as missing:
            print(f"{name:10} skipped: {missing}")
            continue
        for _ in range(3):
            step(batch_size)
        events, operators = step_counts(torch, step, batch_size)
        with contextlib.redirect_stdout(io.StringIO()), gpuexp.GPUExperiment(f"recorder on {name}", trace=False):
            measured = {phase: interleaved_cost(gpuexp, step, batch_size, args.pairs, phase)
                        for phase in ("history", "levels")}
        median, (low, high), seconds = measured["levels"]
        verdict = "PASS" if median <= GATE else "FAIL"
        if median > GATE:
            failed.append(name)
        first, (first_low, first_high), _ = measured["history"]
        print(f"{name:10} {seconds * 1e3:6.2f} ms a step, {events} events, {operators} operators "
              f"({args.pairs} interleaved pairs each):\n"
              f"    a cell's first {gpuexp._core.RECORDER_HISTORY_STEPS} steps (torch's history, no stacks): "
              f"{first:+.2%} (95% {first_low:+.2%} … {first_high:+.2%})\n"
              f"    every later step (a level at most 4 times a second): {median:+.2%} "
              f"(95% {low:+.2%} … {high:+.2%}) {verdict}")
        if grown is None:
            grown = ring_buffer_bytes(torch, step, batch_size, events)
            print(f"ring buffer of {MAX_ENTRIES} events without stacks: RSS +{grown / 2**20:.1f} MiB, "
                  f"{grown / MAX_ENTRIES:.0f} bytes an event")
        del step
        torch.cuda.empty_cache()
    if failed:
        print(f"FAIL: the recorder costs more than +1% on {', '.join(failed)}")
        return 1
    print("PASS: the recorder costs at most +1% of a step on every model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
