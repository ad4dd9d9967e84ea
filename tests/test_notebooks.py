"""The shipped notebooks run headless in a real kernel, as `make demo` runs them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import GPU

ROOT = Path(__file__).resolve().parent.parent


def run_notebook(name, timeout):
    """What notebooks/run.py prints for notebooks/`name`, run whole in a real kernel."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "notebooks" / "run.py"), str(ROOT / "notebooks" / name)],
        capture_output=True, text=True, timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_quickstart_runs_whole_and_shows_its_reports():
    out = run_notebook("quickstart.ipynb", timeout=600)
    assert "gpuexp · bs=64 · started" in out
    assert "gpuexp · bs=64 · finished" in out and "deleted: " in out
    assert "True False" in out  # `data` survived, `model` did not
    assert "gpuexp · numpy only · finished" in out


def test_the_demo_explains_itself_without_noise():
    """run.py prints the markdown between the cells (why less than 100% comes back), no
    warning from the kernel's start, a note repeated under every table once, and how to open
    the notebook in JupyterLab with this environment's kernel."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "notebooks" / "run.py"), "notebooks/quickstart.ipynb"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    lines = out.splitlines()
    assert lines[:2] == ["gpuexp quickstart", "================="], out[:500]
    assert "Expect less than 100% back on the first experiment of a kernel: the first backward pass, optimizer" in lines
    assert lines.index("Finish it") < lines.index("In [5]: del exp")
    assert "without encryption" not in out + done.stderr and "WARNING" not in out + done.stderr
    notes = [line for line in lines if line.startswith("note: ")]
    assert len(notes) == len(set(notes)), notes
    if not GPU:
        assert notes.count("note: no NVIDIA driver (libnvidia-ml.so.1 not found): GPU rows are not shown") == 1
    said, command = lines[-1].split(": ", 1)
    jupyter, rest = command.split(" ", 1)
    assert (said, rest) == ("To open it in JupyterLab and run it cell by cell", "lab notebooks/quickstart.ipynb")
    assert (ROOT / jupyter).resolve() == (Path(sys.executable).parent / "jupyter").resolve()


def test_batch_size_notebook_runs_whole_here_or_says_why_it_skips():
    out = run_notebook("batch_size.ipynb", timeout=900)
    if GPU:
        assert "CUDA out of memory on cuda:0 · rescued" in out
        assert "gpuexp · batch size " in out and "verdict:" in out
        assert "gpuexp · compare · 3 experiments" in out
    else:
        # The output lines, not the sources.
        assert out.splitlines().count("skipped: this cell needs a CUDA GPU") == 8


@pytest.mark.parametrize("notebook, model", [("hf_trainer_batch_size", "GPT2LMHeadModel"),
                                             ("lightning_batch_size", "Classifier")])
def test_example_notebooks_run_whole_at_tiny_size(notebook, model):
    """At real size they run on the GPU machine (docs/integrations.md says how)."""
    path = ROOT / "notebooks" / "examples" / f"{notebook}.ipynb"
    done = subprocess.run(
        [sys.executable, str(ROOT / "notebooks" / "run.py"), str(path)],
        capture_output=True, text=True, timeout=900, env={**os.environ, "GPUEXP_EXAMPLE_SIZE": "tiny"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for batch_size in ((2, 4, 8) if model == "GPT2LMHeadModel" else (4, 8, 16)):
        assert f"gpuexp · {model} bs={batch_size} · finished" in out, out[-3000:]
        assert f"batch size {batch_size}: logged {{" in out and "'gpuexp/host_rss_peak_mib': " in out, out[-3000:]
    assert "gpuexp · compare · 3 experiments" in out, out[-3000:]
    assert out.splitlines().count("skipped: only at real size on a GPU") == 1
    if not GPU:
        assert out.splitlines().count("skipped: this cell needs a CUDA GPU") == 2


def test_fit_notebook_says_what_to_change_here_and_checks_it_on_a_gpu():
    out = run_notebook("fit.ipynb", timeout=900)
    assert "with checkpointed(model, [" in out or "gpuexp.checkpointed(model, [" in out, out[-3000:]
    assert "blocks." in out
    if GPU:
        assert "everything as it was: True | nothing left allocated: True" in out, out[-3000:]
        assert "gpuexp · bs=64 checkpointed · finished" in out
    else:
        assert out.splitlines().count("skipped: this cell needs a CUDA GPU") == 2
