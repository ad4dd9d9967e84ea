"""How long `gpuexp.holders()` takes in a process with a million live objects.

    python bench/holders_cost.py [--objects N] [--repeats R] [--json PATH]

Builds N small live objects (dicts, lists and instances, as a notebook's data and libraries
leave behind), a model with an optimizer, a few tensors held in containers, an lru_cache, a
running thread and autograd graphs, and then times
holders() for the GPU (when CUDA is available: the walk stops once every tensor is found) and
for the host (numpy arrays are not known in advance, so that walk visits everything
reachable). Target: about a second. Plain Python, no kernel: the walk is the same.
"""

import argparse
import functools
import json
import platform
import statistics
import sys
import threading
import time


class Record:
    def __init__(self, i):
        self.i = i
        self.tags = [i]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    import gc

    import numpy as np
    import torch

    import gpuexp

    # In the module's globals, as a notebook's data sits in its namespace: that is what the walk starts from.
    notebook = globals()
    third = args.objects // 3
    notebook["junk"] = {"dicts": [{"i": i} for i in range(third)], "records": [Record(i) for i in range(third)]}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    notebook["model"] = model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).to(device)
    notebook["opt"] = opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 1024, device=device)).sum().backward()
    opt.step()
    notebook["cache"] = [torch.ones(1 << 20, device=device) for _ in range(4)]
    notebook["arrays"] = {"a": np.ones(16 << 20, dtype=np.uint8)}
    # Holders that are no plain container: a cache kept in C, a running thread, autograd graphs.
    notebook["table"] = functools.lru_cache(maxsize=8)(lambda n: torch.ones(n, device=device))
    notebook["table"](1 << 20)
    notebook["preds"] = [model(torch.randn(64, 1024, device=device)) for _ in range(4)]
    stop, ready = threading.Event(), threading.Event()

    def prefetch():
        batch = torch.ones(1 << 20, device=device)  # noqa: F841 (held by the frame, as a prefetcher does)
        ready.set()
        stop.wait()

    threading.Thread(target=prefetch, daemon=True).start()
    ready.wait()
    live = len(gc.get_objects())
    namespace = gpuexp.ipython.ModuleNamespace(notebook)

    def timed(memory):
        samples, found = [], None
        for _ in range(args.repeats):
            started = time.perf_counter()
            found = gpuexp._core.holders(memory, 1 << 20, adapter=namespace)
            samples.append(time.perf_counter() - started)
        return statistics.median(samples), found

    results = {"objects_tracked_by_gc": live, "python": platform.python_version(), "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None}
    rows = []
    for label, memory in ([("cuda:0", 0)] if device == "cuda" else []) + [("host", None)]:
        seconds, found = timed(memory)
        summary = found.to_dict()
        results[label] = {"seconds": seconds, "visited": summary["objects_visited"], "holders": len(summary["holders"])}
        rows.append(f"| {label} | {seconds:.3f} | {summary['objects_visited']:,} | {len(summary['holders'])} |")
    print(f"# holders() with {live:,} live objects tracked by the collector "
          f"({platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"torch {torch.__version__}, {results['gpu'] or 'no GPU'})\n")
    print("| memory | seconds (median) | objects visited | holders ≥ 1 MiB |")
    print("|---|---:|---:|---:|")
    print("\n".join(rows))
    stop.set()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
