"""The shipped notebooks run headless in a real kernel, as `make demo` runs them."""

import subprocess
import sys
from pathlib import Path

from conftest import GPU

ROOT = Path(__file__).resolve().parent.parent


def test_quickstart_runs_whole_and_shows_its_reports():
    done = subprocess.run(
        [sys.executable, str(ROOT / "notebooks" / "run.py"), str(ROOT / "notebooks" / "quickstart.ipynb")],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "gpuexp · bs=64 · started" in out
    assert "gpuexp · bs=64 · finished" in out and "deleted: " in out
    assert "True False" in out  # `data` survived, `model` did not
    assert "gpuexp · numpy only · finished" in out


def test_batch_size_notebook_runs_whole_here_or_says_why_it_skips():
    done = subprocess.run(
        [sys.executable, str(ROOT / "notebooks" / "run.py"), str(ROOT / "notebooks" / "batch_size.ipynb")],
        capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    if GPU:
        assert "CUDA out of memory on cuda:0 · rescued" in done.stdout
        assert "gpuexp · batch size " in done.stdout and "verdict:" in done.stdout
        assert "gpuexp · compare · 3 experiments" in done.stdout
    else:
        # The output lines, not the sources.
        assert done.stdout.splitlines().count("skipped: this cell needs a CUDA GPU") == 8
