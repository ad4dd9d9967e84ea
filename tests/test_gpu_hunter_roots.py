"""The leak hunter on an NVIDIA GPU names 1 GiB held where no plain container holds it: an
lru_cache, a running thread, an autograd graph, a NumPy object array, a pandas column
(`pytest -m gpu`)."""

import pytest

pytestmark = pytest.mark.gpu

GiB = 1 << 30
MiB = 1 << 20

SETUP = """\
import functools, threading
import torch
import gpuexp
torch.ones(1, device="cuda");
"""


def finish(kernel, body):
    """Runs `body` inside an experiment, then finishes it: the report's text."""
    kernel.run('exp = gpuexp.GPUExperiment("held")')
    kernel.run(body)
    return kernel.run("del exp").text


def test_an_lru_cache_entry_is_named_by_its_call(kernel):
    kernel.run(
        SETUP + "@functools.lru_cache(maxsize=4)\n"
        "def table(n):\n"
        "    return torch.empty(n, dtype=torch.uint8, device='cuda')"
    )
    shown = finish(kernel, "table(1 << 30);")
    assert "still held on cuda:0: table (lru_cache entry for (1073741824,)) (1.00 GiB)" in shown, shown
    assert "still held on cuda:0: ;" not in shown


def test_a_running_threads_local_is_named(kernel):
    kernel.run(SETUP + "stop, ready = threading.Event(), threading.Event()")
    shown = finish(
        kernel,
        "def worker():\n"
        "    buf = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')\n"
        "    ready.set(); stop.wait()\n"
        "threading.Thread(target=worker, name='prefetcher', daemon=True).start()\n"
        "ready.wait()",
    )
    kernel.run("stop.set()")
    assert 'still held on cuda:0: thread "prefetcher": worker(), line 3: buf (1.00 GiB)' in shown, shown


def test_an_autograd_graphs_saved_tensors_are_charged_to_its_tensor(kernel):
    kernel.run(SETUP + "preds = []\nmodel = torch.nn.Sequential(torch.nn.Linear(8192, 8192), torch.nn.ReLU()).cuda()")
    shown = finish(
        kernel,
        "for _ in range(4):\n"
        "    preds.append(model(torch.randn(8192, 8192, device='cuda')))",  # 256 MiB each, no no_grad
    )
    held = kernel.value("gpuexp.history()[-1].to_dict()['holders'][0]")
    by_path = {h["path"]: h for h in held["holders"]}
    for i in range(4):
        # Linear saved its input (256 MiB); ReLU saved its result, which is preds[i] itself.
        assert by_path[f"preds[{i}]"]["bytes"] == 256 * MiB, held
        assert by_path[f"preds[{i}]"]["saved_for_backward"] >= 256 * MiB, held
    assert "preds[0] (256.00 MiB, and 256.00 MiB saved for its backward)" in shown, shown
    assert held["unreachable"] < 256 * MiB, held


def test_a_numpy_object_array_and_a_pandas_column_are_named_as_the_user_indexes_them(kernel):
    # Issue 44, section 3: neither gives the collector referents; both existed before the experiment.
    kernel.run(SETUP + "import numpy as np, pandas as pd\n"
               "arr = np.empty(2, dtype=object)\ndf = pd.DataFrame({'emb': [None] * 5, 'n': range(5)})")
    shown = finish(
        kernel,
        "arr[0] = torch.empty(256 << 20, dtype=torch.uint8, device='cuda')\n"
        "df.at[3, 'emb'] = torch.empty(512 << 20, dtype=torch.uint8, device='cuda')",
    )
    assert "still held on cuda:0: df['emb'][3] (512.00 MiB), arr[0] (256.00 MiB)" in shown, shown
    assert "no reachable referrer" not in shown, shown
    held = kernel.value("gpuexp.history()[-1].to_dict()['holders'][0]")
    assert (held["device"], held["partly_read"]) == ("cuda:0", []), held


def test_a_tensor_past_what_the_walk_reads_of_a_large_array_is_said_to_be_read_in_part(kernel):
    kernel.run(SETUP + "import numpy as np\nbig = np.empty(150_000, dtype=object)")
    shown = finish(kernel, "big[120_000] = torch.empty(256 << 20, dtype=torch.uint8, device='cuda')")
    assert "still held on cuda:0: 256.00 MiB with no reachable referrer; read in part: big (the first 100,000 of " \
           "150,000 elements)" in shown, shown
    held = kernel.value("gpuexp.history()[-1].to_dict()['holders'][0]")
    assert held["partly_read"] == [{"path": "big", "elements": 150_000, "read": 100_000}], held
