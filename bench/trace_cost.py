"""What recording where in the code costs a training step: gpuexp's flight recorder, a
`GPUExperiment(trace=True)`, and that cost split by cause, in paired blocks of real steps.

    python bench/trace_cost.py [--models transformer,attention,conv,resnet50,mlp12,gpt2]
                               [--rounds 8] [--steps 20] [--no-split]

Models: the bench's own three (bench/estimate.py: transformer, attention, conv) and issue 29's
three (bench/trace_workloads.py: resnet50 bs 32 SGD, the launch-bound 12-block MLP bs 64 AdamW,
HF GPT-2 from its config bs 8 × 512 AdamW).

Conditions, each a block of `--steps` steps inside an experiment:
- off: `GPUExperiment(trace=False)`, gpuexp's recorder turned off where it has one;
- recorder: gpuexp's flight recorder on, where this gpuexp has the switch (`gpuexp.config(recorder=)`);
  else torch's history started here as the recorder runs it (events, no stacks: `context=None`);
- trace: `GPUExperiment(trace=True)` as it runs by default: Python stacks at alloc and free and
  the module-path hooks on sampled steps only (the first after the opening, then one in N), the
  history without stacks on the others; a line gives how many steps of its last block were
  sampled. Its block's median step is mostly an unsampled one, so it also has a row from the
  mean of every step of the block (the two untimed ones after the opening included) against
  the off block's mean: "trace, mean of all steps", which carries the sampled steps' cost;
- the split by cause (not with --no-split), each alone: history (no stacks), stacks at alloc
  (`context="alloc"`), stacks at alloc and free (`context="all"`, what trace=True records), and
  the module-path hooks with no history.

A round runs one block of each condition, in an order rotated each round; a condition's cost in
a round is its block against that round's off block, and the figure is the median over rounds
(at least 8), with the range. Each step ends synchronised and is timed on its own; a block's time
is its median step (stalls that have nothing to do with the recording hit single steps). Before
each block the garbage of the last one is collected and two steps run untimed; opening and
finishing the experiments are outside the timing. Gates: the recorder at most +1%, trace=True at
most +3% (its median and its mean row both). Exit status 0 when every model meets them, 1 when
not, 2 when it cannot be measured here (no CUDA GPU).
"""

import argparse
import contextlib
import gc
import inspect
import io
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TRACE_MEAN = "trace, mean of all steps"
GATES = {"recorder": 0.01, "trace": 0.03, TRACE_MEAN: 0.03}
SIZES = {"transformer": 16, "attention": 16, "conv": 64}
MAX_ENTRIES = 200_000
CAUSES = ("history", "stacks at alloc", "stacks at alloc+free", "module-path hooks")


def recorder_switch(gpuexp):
    """gpuexp's switch for its flight recorder (`gpuexp.config(recorder=...)`), where this gpuexp has one."""
    try:
        parameters = inspect.signature(gpuexp.config).parameters
    except (AttributeError, TypeError, ValueError):
        return None
    name = next((n for n in ("recorder", "flight_recorder") if n in parameters), None)
    return None if name is None else (lambda on: gpuexp.config(**{name: on}))


@contextlib.contextmanager
def torch_history(torch, context):
    """Torch's allocation history as gpuexp would run it, for the block."""
    torch.cuda.memory._record_memory_history("all", context=context, stacks="python", max_entries=MAX_ENTRIES)
    try:
        yield
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


@contextlib.contextmanager
def module_hooks(gpuexp):
    import gpuexp.module_paths as module_paths

    why = module_paths.install()
    if why:
        raise RuntimeError(f"module paths: {why}")
    try:
        yield
    finally:
        module_paths.uninstall()


def conditions(torch, gpuexp, split):
    """name → (trace=, a context manager around the block's steps)."""
    switch = recorder_switch(gpuexp)
    if switch is not None:
        switch(False)

        @contextlib.contextmanager
        def recorder():
            switch(True)
            try:
                yield
            finally:
                switch(False)
    else:
        def recorder():
            return torch_history(torch, None)

    found = {
        "off": (False, contextlib.nullcontext),
        "recorder": (False, recorder),
        "trace": (True, contextlib.nullcontext),
    }
    if split:
        found.update({
            "history": (False, lambda: torch_history(torch, None)),
            "stacks at alloc": (False, lambda: torch_history(torch, "alloc")),
            "stacks at alloc+free": (False, lambda: torch_history(torch, "all")),
            "module-path hooks": (False, lambda: module_hooks(gpuexp)),
        })
    return found, ("gpuexp's" if switch else "torch's history with context=None (gpuexp has no recorder switch)")


def timed_block(gpuexp, step, batch_size, steps, trace, around):
    """The median step of `steps` (each ends synchronised), the mean of every step of the block
    (the two untimed ones included) and the experiment."""
    gc.collect()
    times = []
    with contextlib.redirect_stdout(io.StringIO()):
        with around(), gpuexp.GPUExperiment(f"trace={trace}", trace=trace, cell_log=False) as exp:
            for _ in range(2 + steps):
                started = time.perf_counter()
                step(batch_size)
                times.append(time.perf_counter() - started)
    return statistics.median(times[2:]), statistics.mean(times), exp


def make_model(torch, name, device):
    """(step, batch size) of one of the bench's models."""
    import trace_workloads

    if name in trace_workloads.MAKERS:
        return trace_workloads.MAKERS[name](torch, device)
    import batch_size as workloads_of
    import estimate as models_of

    workload = models_of.make_workloads(torch)[name]
    model, optimizer = workloads_of.fresh(torch, workload, device)
    return workloads_of.make_step(torch, model, optimizer, workload, device), SIZES[name]


def sampled_steps(exp):
    """"K of N steps" that recorded stacks in a traced experiment, from its report."""
    sampling = exp.data.to_dict()["trace"][0]["peak"].get("sampling")
    if sampling is None:
        return "no step marks (this gpuexp does not sample stacks)"
    return f"{sampling['with_stacks']} of {sampling['steps']} steps"


def measure(torch, gpuexp, step, batch_size, found, rounds, steps):
    """Per condition other than off: its cost in each round; the trace's events a step; how many
    steps its last block sampled."""
    names = list(found)
    shares = {name: [] for name in names if name != "off"}
    if "trace" in found:
        shares[TRACE_MEAN] = []
    events, sampled = None, None
    for round_ in range(rounds):
        shift = round_ % len(names)
        order = names[shift:] + names[:shift]
        if round_ % 2:
            order.reverse()
        seconds, means = {}, {}
        for name in order:
            trace, around = found[name]
            seconds[name], means[name], exp = timed_block(gpuexp, step, batch_size, steps, trace, around)
            if trace and events is None:
                events = exp.data.to_dict()["trace"][0]["peak"]["completeness"]["events"] // (steps + 2)
            if trace:
                sampled = sampled_steps(exp)
        for name in shares:
            if name == TRACE_MEAN:
                shares[name].append(means["trace"] / means["off"] - 1)
            else:
                shares[name].append(seconds[name] / seconds["off"] - 1)
    return shares, events, seconds["off"], sampled


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="transformer,attention,conv,resnet50,mlp12,gpt2")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-split", action="store_true", help="only the recorder and trace=True")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to measure")
        return 2
    import gpuexp

    device = torch.device("cuda", 0)
    found, recorder = conditions(torch, gpuexp, not args.no_split)
    failed = []
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.rounds} rounds of {args.steps} steps; "
          f"recorder: {recorder}")
    for name in args.models.split(","):
        try:
            step, batch_size = make_model(torch, name, device)
        except ImportError as missing:
            print(f"{name:12} skipped: {missing}")
            continue
        for _ in range(3):
            step(batch_size)
        try:
            shares, events, off, sampled = measure(torch, gpuexp, step, batch_size, found, args.rounds, args.steps)
        except Exception as error:  # noqa: BLE001 - one model's failure is reported, the others still run
            print(f"{name:12} failed: {type(error).__name__}: {error}")
            failed.append(f"{name} (failed)")
            continue
        cells = []
        for condition, values in shares.items():
            median = statistics.median(values)
            gate = GATES.get(condition)
            verdict = "" if gate is None else (" PASS" if median <= gate else " FAIL")
            if gate is not None and median > gate:
                failed.append(f"{name} {condition}")
            cells.append(f"{condition} {median:+.2%} ({min(values):+.2%} … {max(values):+.2%}){verdict}")
        per_step = f", {events} events a step" if events else ""
        if sampled is not None:
            cells.append(f"trace=True recorded Python stacks on {sampled} of its last block")
        print(f"{name:12} bs {batch_size:4}, {off * 1e3:.1f} ms a step{per_step}:\n    " + "\n    ".join(cells))
        del step
        gc.collect()
        torch.cuda.empty_cache()
    if failed:
        print(f"FAIL: over the gate (recorder +1%, trace +3%): {', '.join(failed)}")
        return 1
    print("PASS: the recorder costs at most 1% and trace=True at most 3% of a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
