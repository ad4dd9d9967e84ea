"""The leak hunter on host memory (CPU tensors and numpy arrays), in real kernels and scripts."""

import subprocess
import sys

import pytest

MiB = 1 << 20

SETUP = """\
import builtins, sys, weakref
import numpy as np
import gpuexp
"""


def holder_paths(kernel, expression="gpuexp.holders('cpu')"):
    return kernel.value(f"{expression}.paths")


def test_paths_read_as_a_person_writes_them(kernel, tmp_path):
    (tmp_path / "mymod.py").write_text("CACHE = {}\n")
    kernel.run(SETUP + f"sys.path.insert(0, {str(tmp_path)!r})\nimport mymod, torch")
    kernel.run(
        "cache = [np.ones(3 << 20, dtype=np.uint8)]\n"
        "mymod.CACHE['x'] = np.ones(5 << 20, dtype=np.uint8)\n"
        "def make():\n"
        "    buf = np.ones(7 << 20, dtype=np.uint8)\n"
        "    return lambda: buf\n"
        "fn = make()\n"
        "model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))\n"
        "opt = torch.optim.Adam(model.parameters())\n"
        "model(torch.randn(2, 1024)).sum().backward()\n"
        "opt.step()"
    )
    kernel.run("np.ones(9 << 20, dtype=np.uint8)")  # displayed: only Out holds it
    kernel.run(
        "def fail():\n"
        "    held = np.ones(11 << 20, dtype=np.uint8)\n"
        "    raise ValueError('boom')\n"
        "fail()",
        expect_error=True,
    )
    paths = holder_paths(kernel)
    for expected in (
        "cache[0]",
        "mymod.CACHE['x']",
        "fn (closure cell buf)",
        "model.0.weight",
        "model.2.weight.grad",
        "opt.state[model.0.weight]['exp_avg']",
        "Out[3]",
        "last traceback → fail(), line 3 → local held",
    ):
        assert expected in paths, (expected, paths)
    sizes = kernel.value("[h['bytes'] for h in gpuexp.holders('cpu').to_dict()['holders']]")
    assert sizes == sorted(sizes, reverse=True)


def test_each_storage_counts_once_and_small_ones_are_left_out(kernel):
    kernel.run(SETUP + "import torch")
    kernel.run("base = torch.ones(4 << 20)\nview = base[: 1 << 20]\ntiny = torch.ones(10)")
    found = kernel.value("gpuexp.holders('cpu').to_dict()['holders']")
    storages = [h for h in found if h["path"] in ("base", "view")]
    assert len(storages) == 1 and storages[0]["bytes"] == 16 * MiB
    assert all(h["path"] != "tiny" for h in found)
    assert "tiny" in holder_paths(kernel, "gpuexp.holders('cpu', min_bytes=0)")


def test_the_hunter_keeps_nothing_alive(kernel):
    kernel.run(SETUP + "import torch")
    kernel.run("t = torch.ones(8 << 20)\n"
               "a = np.ones(32 << 20, dtype=np.uint8)\n"
               "wt, wa = weakref.ref(t), weakref.ref(a)")
    kernel.run("found = gpuexp.holders('cpu')")
    assert "t" in kernel.value("found.paths") and "a" in kernel.value("found.paths")
    kernel.run("del t, a")
    assert kernel.value("[wt() is None, wa() is None]") == [True, True]


def test_a_finished_experiment_names_what_still_holds_its_memory(kernel):
    kernel.run(SETUP + "cache = []")
    kernel.run('exp = gpuexp.CPUExperiment("leaky")')
    kernel.run("big = np.ones(256 << 20, dtype=np.uint8)\ncache.append(big)")
    shown = kernel.run("del exp")
    assert "still held on host: cache[0] (256.00 MiB)" in shown.text
    report = kernel.value("gpuexp.history()[-1].to_dict()")
    assert report["holders"][0]["holders"][0]["path"] == "cache[0]"
    assert kernel.value("len(cache)") == 1  # named, never deleted: it is user data outside the scope


def test_nothing_is_named_when_everything_came_back(kernel):
    kernel.run(SETUP)
    kernel.run('exp = gpuexp.CPUExperiment("clean")')
    kernel.run("big = np.ones(256 << 20, dtype=np.uint8)")
    shown = kernel.run("del exp")
    assert "still held" not in shown.text
    assert kernel.value("gpuexp.history()[-1].to_dict()['holders']") == []


def test_bad_arguments_get_clear_errors(kernel):
    kernel.run(SETUP)
    assert kernel.run("gpuexp.holders(min_bytes=-1)", expect_error=True).error.startswith("ValueError")
    bad = kernel.run("gpuexp.holders(device='gpu')", expect_error=True)
    assert bad.error.startswith("ValueError") and "device" in bad.error


SCRIPT = """\
import sys
import numpy as np
{imports}
import gpuexp

arr = np.ones(8 << 20, dtype=np.uint8)


def main():
    print(gpuexp.holders("cpu"))
    print("PATHS", gpuexp.holders("cpu").paths)


main()
"""


@pytest.mark.parametrize("imports", ["", "import torch"])
def test_in_a_script_called_from_a_function_the_scripts_globals_are_found(tmp_path, imports):
    """A script's globals are `__main__`'s, whichever other name torch's multiprocessing gives
    that module (`__mp_main__`)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(imports=imports))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    if imports:
        assert "__mp_main__" in subprocess.run(
            [sys.executable, "-c", "import sys, torch; print(sorted(sys.modules))"], capture_output=True, text=True,
        ).stdout, "torch no longer adds the alias: this case tests nothing new"
    paths = next(line for line in done.stdout.splitlines() if line.startswith("PATHS "))
    assert paths == "PATHS ['__main__.arr']", done.stdout
    assert "│ __main__.arr ┆ 8.00 MiB ┆ ndarray [8388608] cpu │" in done.stdout, done.stdout


def test_an_empty_result_says_where_it_looked_and_that_nothing_was_found(kernel):
    kernel.run(SETUP)
    shown = kernel.run("gpuexp.holders('cpu', min_bytes=1 << 40)")
    said = "nothing found: no tensor or array of 1.00 TiB or more in host memory is reachable from your names"
    assert said in shown.text, shown.text
    assert "any module's globals (a script's own as __main__)" in shown.text, shown.text


def test_a_tensor_inside_a_numpy_object_array_is_named_by_its_index(kernel):
    # Issue 44, section 3: an object array gives the collector no referents.
    kernel.run(SETUP + "import torch")
    kernel.run(
        "arr = np.empty(2, dtype=object)\n"
        "arr[0] = torch.ones(1 << 22)\n"
        "grid = np.empty((2, 2), dtype=object)\n"
        "grid[1, 0] = torch.ones(3 << 20)"
    )
    paths = holder_paths(kernel)
    assert "arr[0]" in paths, paths
    assert "grid.flat[2]" in paths, paths
    assert not any("no reachable referrer" in p for p in paths), paths


def test_a_tensor_in_a_pandas_column_is_named_as_the_user_indexes_it(kernel):
    # Issue 44, section 3: pandas keeps an object column in an object array, behind its blocks.
    kernel.run(SETUP + "import torch, pandas as pd")
    kernel.run(
        "df = pd.DataFrame({'emb': [None] * 5, 'n': range(5), 7: [None] * 5})\n"
        "df.at[3, 'emb'] = torch.ones(1 << 22)\n"
        "df.at[1, 7] = torch.ones(3 << 20)\n"
        "s = pd.Series([None, torch.ones(5 << 20)], index=['a', 'b'])\n"
        "d = {3: torch.ones(6 << 20)}"
    )
    paths = holder_paths(kernel)
    for expected in ("df['emb'][3]", "df[7][1]", "s['b']", "d[3]"):
        assert expected in paths, (expected, paths)
    assert not any("no reachable referrer" in p for p in paths), paths
    assert kernel.value("hasattr(df, '_item_cache') and len(df._item_cache)") in (False, 0), "the hunt indexed df"


def test_the_hunter_never_imports_pandas(kernel):
    kernel.run(SETUP + "import torch\narr = np.empty(2, dtype=object)\narr[0] = torch.ones(1 << 22)")
    assert "arr[0]" in holder_paths(kernel)
    assert kernel.value("'pandas' in sys.modules") is False


def test_a_container_read_in_part_is_said_in_the_table_and_the_leak_hunters_line(kernel):
    kernel.run(SETUP + "import torch, pandas as pd\ncache = []")
    kernel.run("big = np.empty(150_000, dtype=object)\nbig[0] = torch.ones(1 << 20)\n"
               "big[120_000] = torch.ones(2 << 20)")
    table = kernel.run("print(gpuexp.holders('cpu'))").text
    assert "big[0]" in table and "8.00 MiB ┆ live tensors only C++" in table, table
    assert "read in part: big (the first 100,000 of 150,000 elements)" in table, table
    kernel.run("del big")
    kernel.run('exp = gpuexp.CPUExperiment("partly read")')
    kernel.run(
        "col = pd.Series([None] * 150_000)\ncol[120_000] = torch.ones(24 << 20)\n"
        "cache.append(col)\ndel col"
    )
    shown = kernel.run("del exp").text
    assert "96.00 MiB with no reachable referrer" in shown, shown
    assert "read in part: cache[0] (the first 100,000 of 150,000 elements)" in shown, shown
    [held] = kernel.value("gpuexp.history()[-1].to_dict()['holders']")
    assert held["partly_read"] == [{"path": "cache[0]", "elements": 150_000, "read": 100_000}], held


def test_a_list_of_outputs_that_keep_their_graphs_is_one_row_named_by_the_list(kernel):
    # An evaluation loop without torch.no_grad() that keeps each output: every output keeps its
    # forward's saved tensors alive, each under the 1 MiB listed alone, 20 of them well over it.
    kernel.run(SETUP + "import torch")
    kernel.run(
        "model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))\n"
        "outs = []\n"
        "for _ in range(20):\n"
        "    outs.append(model(torch.randn(256, 256)))"
    )
    rows = kernel.value("gpuexp.holders('cpu').to_dict()['holders']")
    by_path = {row["path"]: row for row in rows}
    assert "outs" in by_path, [row["path"] for row in rows]
    assert not any(path.startswith("outs[") for path in by_path), "its elements are rolled into it"
    outs = by_path["outs"]
    assert outs["kind"] == "a list of 20 tensors that require grad, each keeping its graph"
    assert outs["bytes"] == 20 * 256 * 256 * 4, "the outputs' own storages"
    # Each graph saved its input and the ReLU's output (256 KiB each); the weights are the model's.
    assert outs["saved_for_backward"] >= 20 * 2 * 256 * 256 * 4, outs
    assert kernel.value("len(outs)") == 20, "the hunt keeps and deletes nothing"
