"""What `GPUExperiment(trace=True)` costs a training step: paired blocks of steps with the trace
off and on, for the models of bench/estimate.py.

    python bench/trace_cost.py [--models transformer,attention,conv] [--pairs 15] [--steps 40]

Each pair runs a block of `--steps` real training steps in an experiment without the trace and a
block in one with it (in alternating order). Each step ends synchronised and is timed on its
own; a block's time is its median step. Stalls that have nothing to do with the trace (a garbage
collection, the host's other tenants, the GPU's clock) hit single steps and swung whole blocks by
±10% on a shared H100 host, while the trace's own cost is in every step. Before each block the
garbage of the last one is collected and two steps run untimed; the experiments' opening and
finishing are outside the timing, and their reports are not printed. The figure is the median
over pairs of (on − off) / off. Target: at most +3%. Exit status 0 when every model meets it, 1
when not, 2 when it cannot be measured here (no CUDA GPU).
"""

import argparse
import contextlib
import gc
import io
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TARGET = 0.03
SIZES = {"transformer": 16, "attention": 16, "conv": 64, "mlp": 4096}


def timed_block(torch, gpuexp, step, batch_size, steps, trace):
    """The median step of `steps` (each ends synchronised: bench/batch_size.py's make_step)."""
    gc.collect()
    times = []
    with contextlib.redirect_stdout(io.StringIO()):
        with gpuexp.GPUExperiment(f"trace={trace}", trace=trace, cell_log=False) as exp:
            for _ in range(2):
                step(batch_size)
            for _ in range(steps):
                started = time.perf_counter()
                step(batch_size)
                times.append(time.perf_counter() - started)
    return statistics.median(times), exp


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="transformer,attention,conv")
    parser.add_argument("--pairs", type=int, default=15)
    # Blocks of 40 steps (about 0.6 s): in blocks of 10, one stall (a GC pass, the GPU's clock)
    # swung a pair by 20% on an H100.
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to measure")
        return 2
    import batch_size as workloads_of
    import estimate as models_of
    import gpuexp

    device = torch.device("cuda", 0)
    workloads = models_of.make_workloads(torch)
    failed = False
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.pairs} pairs of {args.steps} steps")
    for name in args.models.split(","):
        workload = workloads[name]
        model, optimizer = workloads_of.fresh(torch, workload, device)
        step = workloads_of.make_step(torch, model, optimizer, workload, device)
        batch_size = SIZES[name]
        for _ in range(3):
            step(batch_size)
        shares, events = [], None
        for pair in range(args.pairs):
            order = (False, True) if pair % 2 == 0 else (True, False)
            seconds = {}
            for trace in order:
                seconds[trace], exp = timed_block(torch, gpuexp, step, batch_size, args.steps, trace)
                if trace and events is None:
                    events = exp.data.to_dict()["trace"][0]["peak"]["completeness"]["events"]
            shares.append(seconds[True] / seconds[False] - 1)
        median = statistics.median(shares)
        verdict = "PASS" if median <= TARGET else "FAIL"
        failed |= median > TARGET
        per_step = f", {events // args.steps} events a step" if events else ""
        print(f"{name:12} bs {batch_size:5}: trace on {median:+.2%} (pairs {min(shares):+.2%} … {max(shares):+.2%})"
              f"{per_step}  {verdict}")
        del model, optimizer, step
        torch.cuda.empty_cache()
    print("PASS: the trace costs at most 3% of a step" if not failed else "FAIL: a model is over 3%")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
