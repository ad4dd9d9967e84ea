"""The leak hunter finds holders that are not plain containers: caches kept in C, running
threads, suspended generators and tasks, and autograd graphs. CPU tensors, in real kernels."""

import re

MiB = 1 << 20

SETUP = """\
import asyncio, functools, threading, weakref
import torch
import gpuexp
"""


def holders(kernel):
    return kernel.value("gpuexp.holders('cpu').to_dict()['holders']")


def test_lru_cache_results_are_named_by_the_call_that_made_them(kernel):
    kernel.run(SETUP)
    kernel.run(
        "@functools.lru_cache(maxsize=8)\n"
        "def table(n):\n"
        "    return torch.ones(n, dtype=torch.uint8)\n"
        "@functools.cache\n"
        "def rows(n, scale=1):\n"
        "    return [torch.ones(n, dtype=torch.uint8)]\n"
        "table(3 << 20); table(5 << 20); rows(7 << 20, scale=2);"
    )
    found = {h["path"]: h["bytes"] for h in holders(kernel)}
    assert found.get("table (lru_cache entry for (3145728,))") == 3 * MiB, found
    assert found.get("table (lru_cache entry for (5242880,))") == 5 * MiB, found
    assert found.get("rows (lru_cache entry for (7340032, scale=2))[0]") == 7 * MiB, found


def test_a_running_threads_local_is_named_by_thread_function_and_line(kernel):
    kernel.run(SETUP)
    kernel.run(
        "stop, ready = threading.Event(), threading.Event()\n"
        "def worker():\n"
        "    buf = torch.ones(24 << 20, dtype=torch.uint8)\n"
        "    ready.set(); stop.wait()\n"
        "prefetcher = threading.Thread(target=worker, name='prefetcher', daemon=True)\n"
        "prefetcher.start(); ready.wait()"
    )
    found = {h["path"]: h["bytes"] for h in holders(kernel)}
    kernel.run("stop.set(); prefetcher.join()")
    assert found.get('thread "prefetcher": worker(), line 4: buf') == 24 * MiB, found


def test_suspended_generators_and_pending_tasks_are_walked(kernel):
    kernel.run(SETUP)
    kernel.run(
        "def stream():\n"
        "    held = torch.ones(12 << 20, dtype=torch.uint8)\n"
        "    yield 1\n"
        "g = stream(); next(g)\n"
        "async def fetch():\n"
        "    pending = torch.ones(20 << 20, dtype=torch.uint8)\n"
        "    await asyncio.sleep(3600)\n"
        "asyncio.get_event_loop().create_task(fetch(), name='fetcher');\n"  # no name keeps the task
    )
    found = {h["path"]: h["bytes"] for h in holders(kernel)}
    assert found.get("g → stream(), line 3 → local held") == 12 * MiB, found
    assert found.get('task "fetcher": fetch(), line 7: pending') == 20 * MiB, found


def test_a_graphs_saved_tensors_are_charged_to_the_tensor_whose_grad_fn_holds_them(kernel):
    kernel.run(SETUP + "preds = []")
    kernel.run(
        "model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))\n"
        "for _ in range(2):\n"
        "    x = torch.randn(4096, 1024)\n"
        "    preds.append(model(x))\n"
        "weak = weakref.ref(x)\n"
        "del x"
    )
    found = {h["path"]: h for h in holders(kernel)}
    # Each forward saved its input (16 MiB), the first layer's output (16 MiB) and ReLU's
    # result (16 MiB); the weights the graph reaches are the model's, named from `model`.
    for i in range(2):
        pred = found[f"preds[{i}]"]
        assert pred["bytes"] == 16 * MiB and pred["saved_for_backward"] >= 32 * MiB, found
    assert "model.0.weight" in found and found["model.0.weight"]["saved_for_backward"] == 0
    text = kernel.run("print(gpuexp.holders('cpu'))").text
    assert re.search(r"tensor \[4096, 1024\] cpu, and \d+\.\d\d MiB saved for its backward", text), text
    # The hunt kept nothing: dropping the predictions frees their graphs.
    kernel.run("preds.clear()\nimport gc; gc.collect()")
    assert kernel.value("weak() is None")


def test_a_finished_experiment_names_a_thread_that_still_holds_its_memory(kernel):
    kernel.run(SETUP + "import numpy as np\nstop, ready = threading.Event(), threading.Event()")
    kernel.run('exp = gpuexp.CPUExperiment("prefetch")')
    kernel.run(
        "def worker():\n"
        "    batch = np.ones(256 << 20, dtype=np.uint8)\n"
        "    ready.set(); stop.wait()\n"
        "threading.Thread(target=worker, name='loader', daemon=True).start()\n"
        "ready.wait()"
    )
    shown = kernel.run("del exp").text
    kernel.run("stop.set()")
    assert "still held on host: thread \"loader\": worker(), line 3: batch (256.00 MiB)" in shown, shown
    assert "still held on host: ;" not in shown


def test_an_object_that_raises_when_inspected_is_skipped_and_counted(kernel):
    kernel.run(SETUP)
    kernel.run(
        "class Hostile:\n"
        "    @property\n"
        "    def __dict__(self):\n"
        "        raise RuntimeError('no')\n"
        "bad = Hostile()\n"
        "kept = [torch.ones(4 << 20, dtype=torch.uint8)]"
    )
    found = kernel.value("gpuexp.holders('cpu').to_dict()")
    assert "kept[0]" in [h["path"] for h in found["holders"]]
    assert found["skipped"] >= 1


def test_saved_tensor_hooks_never_run_so_a_checkpoint_is_not_recomputed(kernel):
    kernel.run(SETUP + "import torch.utils.checkpoint as checkpoint\nunpacked = []")
    kernel.run(
        "layer = torch.nn.Linear(1024, 1024)\n"
        "runs = []\n"
        "def segment(a):\n"
        "    runs.append(1)\n"
        "    return layer(a).relu()\n"
        "out = checkpoint.checkpoint(segment, torch.randn(4096, 1024, requires_grad=True), use_reentrant=False)\n"
        "def pack(t):\n"
        "    return t\n"
        "def unpack(t):\n"
        "    unpacked.append(1)\n"
        "    return t\n"
        "with torch.autograd.graph.saved_tensors_hooks(pack, unpack):\n"
        "    hooked = torch.randn(4096, 1024, requires_grad=True).exp()"
    )
    found = {h["path"]: h for h in holders(kernel)}
    assert kernel.value("[len(runs), len(unpacked)]") == [1, 0]
    # What the hook packed is walked as it is: exp saved its result, which `hooked` names itself.
    assert found["hooked"]["bytes"] == 16 * MiB, found


def test_interpreter_hooks_are_roots_signal_handlers_and_weakref_finalizers(kernel):
    kernel.run(SETUP + "import signal")
    kernel.run(
        "def install():\n"
        "    buf = torch.ones(6 << 20, dtype=torch.uint8)\n"
        "    def on_usr1(signum, frame):\n"
        "        return buf\n"
        "    return signal.signal(signal.SIGUSR1, on_usr1)\n"
        "previous = install()\n"
        "class Resource:\n"
        "    pass\n"
        "resource = Resource()\n"
        "weakref.finalize(resource, print, torch.ones(10 << 20, dtype=torch.uint8));"
    )
    found = {h["path"]: h["bytes"] for h in holders(kernel)}
    kernel.run("signal.signal(signal.SIGUSR1, previous)")
    assert found.get("signal handler SIGUSR1 (closure cell buf)") == 6 * MiB, found
    assert found.get("weakref.finalize._registry[<finalize>].args[0]") == 10 * MiB, found
