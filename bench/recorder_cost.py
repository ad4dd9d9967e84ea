"""What the flight recorder costs a launch-bound step (issue 29): torch's allocation history
without stacks (`context=None`, as gpuexp's recorder starts it) plus gpuexp's optimizer step
hook, against neither, in paired blocks of 30 steps in alternating order; and the host memory
of a full ring buffer (RSS growth while 200,000 events are recorded).

    python bench/recorder_cost.py   # on a GPU machine
"""

import statistics
import time

import torch

from gpuexp import steps

MAX_ENTRIES = 200_000
PAIRS = 8
STEPS = 30


def mlp():
    def block():
        return torch.nn.Sequential(torch.nn.LayerNorm(1024), torch.nn.Linear(1024, 2048), torch.nn.GELU(),
                                   torch.nn.Linear(2048, 1024))
    blocks = torch.nn.ModuleList([block() for _ in range(12)]).cuda()
    opt = torch.optim.AdamW(blocks.parameters())
    x = torch.randn(64, 1024, device="cuda")

    def step():
        h = x
        for b in blocks:
            h = h + b(h)
        h.sum().backward()
        opt.step()
        opt.zero_grad()
    return step


def recorder(on):
    if on:
        torch.cuda.memory._record_memory_history("all", context=None, stacks="python", max_entries=MAX_ENTRIES)
        steps.install()
    else:
        steps.uninstall()
        torch.cuda.memory._record_memory_history(enabled=None)


def block(step, on):
    recorder(on)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    recorder(False)
    return statistics.median(times)


def rss():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


def main():
    step = mlp()
    for _ in range(5):
        step()
    costs = []
    for pair in range(PAIRS):
        order = (False, True) if pair % 2 == 0 else (True, False)
        timed = {on: block(step, on) for on in order}
        costs.append(timed[True] / timed[False] - 1)
    print(f"{torch.cuda.get_device_name()}: launch-bound MLP step {timed[False] * 1e3:.2f} ms; "
          f"recorder cost, median of {PAIRS} pairs: {statistics.median(costs) * 100:+.2f}% "
          f"(pairs {', '.join(f'{c * 100:+.1f}%' for c in costs)})")
    before = rss()
    recorder(True)
    step()
    per_step = len(torch.cuda.memory._snapshot()["device_traces"][0])
    for _ in range(MAX_ENTRIES // per_step + 2):
        step()
    torch.cuda.synchronize()
    grown = rss() - before
    recorder(False)
    print(f"ring buffer of {MAX_ENTRIES} events without stacks ({per_step} a step): RSS +{grown / 2**20:.1f} MiB, "
          f"{grown / MAX_ENTRIES:.0f} bytes an event")

if __name__ == "__main__":
    main()
