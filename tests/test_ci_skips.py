"""Issue 38, section 6: the suite's own setup that a fresh machine depends on. Under CI a skip
fails unless CI's machine can't have what it needs; the docs tests run after their deps; the
module-paths test's warning filter matches torch's literal text."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_pytest(tmp_path, source, ci):
    (tmp_path / "test_planted.py").write_text(source)
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "tests"), **({"GPUEXP_CI": "1"} if ci else {})}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)


PLANTED = """\
import pytest
def test_missing_dependency():
    pytest.skip("the docs build needs mkdocs")
@pytest.mark.skip(reason="needs two GPUs")
def test_two_gpus():
    pass
"""


def test_a_skip_fails_under_ci_except_for_a_gpu(tmp_path):
    outside = run_pytest(tmp_path, PLANTED, ci=False)
    assert "2 skipped" in outside.stdout, outside.stdout
    under = run_pytest(tmp_path, PLANTED, ci=True)
    assert "1 failed" in under.stdout and "1 skipped" in under.stdout, under.stdout
    assert "the docs build needs mkdocs" in under.stdout, under.stdout
    assert "GPUEXP_CI=1" in (ROOT / ".ci" / "run").read_text()


def test_the_docs_tests_run_after_the_docs_deps():
    makefile = (ROOT / "Makefile").read_text()
    prerequisites = re.search(r"^test-python:(.*)$", makefile, re.M).group(1).split()
    assert "$(DOCS_DEPS)" in prerequisites, prerequisites


def test_the_module_paths_warning_filter_matches_torchs_text():
    source = (ROOT / "tests" / "test_module_paths.py").read_text()
    pattern = re.search(r'filterwarnings\(r?"ignore:([^"]*)"\)', source).group(1)
    warning = ("Using `torch.compile(module)` when there are global hooks on modules (e.g., from "
               "`register_module_forward_hook`); this will cause the hooks to fire an extra time")
    assert re.match(pattern, warning), pattern
