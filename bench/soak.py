"""Soak: many experiment cycles in one real kernel, with the cell log sampling every 1 ms, a Monitor
running and interrupts thrown in. Measures the kernel's RSS growth per cycle beyond what the stored
reports account for, checks that nothing hangs (every cell has a deadline) and that no gpuexp thread
is left at the end. With --gpu each cycle allocates torch tensors on cuda:0 and torch's allocated
bytes must be back at the baseline after every cycle.

    python bench/soak.py --cycles 1000            # CPU
    python bench/soak.py --cycles 200 --gpu       # on the GPU machine
"""

import argparse
import json
import sys
import time

import nbformat
from nbclient import NotebookClient
from nbclient.util import run_sync

from machine import cpu_model

SETUP = """\
import json, os, threading, numpy as np
import gpuexp
from gpuexp import CPUExperiment, GPUExperiment
gpuexp.config(sample_interval_ms=1)
mon = gpuexp.Monitor("50ms").start()
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def history_bytes():
    return sum(len(r.to_json()) for r in gpuexp.history())
"""

GPU_SETUP = """\
import torch
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
baseline = torch.cuda.memory_allocated(0)
"""


class Driver:
    def __init__(self, timeout):
        self.nb = nbformat.v4.new_notebook()
        self.client = NotebookClient(self.nb, timeout=timeout, kernel_name="python3", allow_errors=True)
        self.setup = self.client.setup_kernel()
        self.setup.__enter__()

    def run(self, source):
        cell = nbformat.v4.new_code_cell(source)
        self.nb.cells.append(cell)
        node = self.client.execute_cell(cell, len(self.nb.cells) - 1)
        errors = [o for o in node.outputs if o.output_type == "error"]
        return errors[0].ename if errors else None

    def value(self, expression):
        mark = "@@soak@@"
        self.run(f"print({mark!r} + json.dumps({expression}))")
        cell = self.nb.cells[-1]
        text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        return json.loads(next(line for line in text.splitlines() if line.startswith(mark))[len(mark) :])

    def interrupt_during(self, source, after_s):
        """Runs `source`, interrupts the kernel `after_s` in; returns the reply's error name or None."""
        kc, km = self.client.kc, self.client.km
        msg_id = kc.execute(source)
        time.sleep(after_s)
        run_sync(km.interrupt_kernel)()
        while True:
            reply = run_sync(kc.get_shell_msg)(timeout=60)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply["content"].get("ename")

    def close(self):
        self.setup.__exit__(None, None, None)


def soak(cycles, gpu, interrupt_every):
    driver = Driver(timeout=120)
    started = time.perf_counter()
    driver.run(SETUP + (GPU_SETUP if gpu else ""))
    kind = "GPUExperiment" if gpu else "CPUExperiment"
    driver.run(f"exp = {kind}('warm-up')\nx = np.ones(1 << 20)\ndel exp")  # first-use allocations
    rss_start, reports_start = driver.value("[rss(), history_bytes()]")
    interrupts, not_back = 0, []
    halfway = None
    for cycle in range(cycles):
        if cycle == cycles // 2:
            halfway = driver.value("[rss(), history_bytes()]")
        driver.run(f"exp = {kind}('cycle-{cycle}')")
        work = "x = np.ones(2 << 20)\ny = [bytearray(4096) for _ in range(64)]"
        if gpu:
            work += "\nt = torch.randn(1024, 1024, device='cuda') @ torch.randn(1024, 1024, device='cuda')"
        driver.run(work)
        if interrupt_every and cycle % interrupt_every == interrupt_every - 1:
            driver.run(
                "class Slow:\n    def __del__(self): __import__('time').sleep(0.02)\nslow = [Slow() for _ in range(20)]"
            )
            driver.interrupt_during("del exp", after_s=0.1)
            interrupts += 1
            time.sleep(0.1)
        else:
            driver.run("del exp")
        if gpu:
            back = driver.value("torch.cuda.memory_allocated(0) - baseline")
            if back != 0:
                not_back.append((cycle, back))
    rss_end, reports_end, count = driver.value("[rss(), history_bytes(), len(gpuexp.history())]")
    driver.run("mon.stop()\ngpuexp._core.shutdown()")
    threads = driver.value(
        "[t.name for t in threading.enumerate() if t is not threading.main_thread() "
        "and 'gpuexp' in t.name] + [open(f'/proc/self/task/{t}/comm').read().strip() "
        "for t in os.listdir('/proc/self/task') if 'gpuexp' in open(f'/proc/self/task/{t}/comm').read()]"
    )
    elapsed = time.perf_counter() - started
    driver.close()
    growth = (rss_end - rss_start) - (reports_end - reports_start)
    # The second half alone: what keeps growing once first-use allocations (CUDA, libraries) are made.
    late = (rss_end - halfway[0]) - (reports_end - halfway[1])
    return {
        "machine": cpu_model(),
        "cycles": cycles,
        "gpu": gpu,
        "interrupts": interrupts,
        "reports_stored": count,
        "rss_growth_bytes": rss_end - rss_start,
        "report_bytes": reports_end - reports_start,
        "growth_per_cycle_beyond_reports_bytes": growth / cycles,
        "second_half_growth_per_cycle_beyond_reports_bytes": late / (cycles - cycles // 2),
        "gpuexp_threads_left": threads,
        "torch_allocated_not_back": not_back,
        "seconds": round(elapsed, 1),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--interrupt-every", type=int, default=50)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    result = soak(args.cycles, args.gpu, args.interrupt_every)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    ok = (
        result["reports_stored"] == args.cycles + 1
        and not result["gpuexp_threads_left"]
        and not result["torch_allocated_not_back"]
    )
    print("soak:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
