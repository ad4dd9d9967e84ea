"""What `make demo` and `make test` install (issue 38, section 6): each package bounded, the
demo's set apart from the tests', the versions these tests run with inside the bounds, and a
Python too old for torch refused before anything is installed."""

import re
import shlex
import shutil
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
MAKEFILE = (ROOT / "Makefile").read_text(encoding="utf-8")


def packages(variable):
    """The requirements a Makefile variable lists (its continuation lines joined)."""
    value = re.search(rf"^{variable} := ((?:.*\\\n)*.*)$", MAKEFILE, re.M)
    assert value, f"the Makefile has no {variable}"
    return [Requirement(word) for word in shlex.split(value.group(1).replace("\\\n", " "))]


def test_every_package_a_make_command_installs_is_bounded_both_ways():
    for variable in ("DEMO_PACKAGES", "TEST_PACKAGES"):
        for requirement in packages(variable):
            operators = {spec.operator for spec in requirement.specifier}
            assert operators == {">=", "<"}, f"{variable}: {requirement} needs a >= and a < bound"


def test_the_demo_installs_what_it_runs_and_the_tests_add_the_rest():
    demo = {r.name for r in packages("DEMO_PACKAGES")}
    tests = {r.name for r in packages("TEST_PACKAGES")}
    assert {"torch", "numpy", "nbclient", "ipykernel", "maturin"} <= demo, demo
    assert not demo & tests, f"listed twice: {demo & tests}"
    assert {"pytest", "ruff", "selenium", "lightning", "transformers"} <= tests, tests
    recipe = re.search(r"^\$\(DEMO_DEPS\):.*\n((?:\t.*\n)+)", MAKEFILE, re.M).group(1)
    assert "$(TEST_PACKAGES)" not in recipe, "make demo installs only what it needs"
    assert re.search(r"^build: \$\(DEMO_DEPS\)$", MAKEFILE, re.M), "the build (make demo's) needs the demo's set only"
    assert "$(DEPS)" in re.search(r"^test-python:(.*)$", MAKEFILE, re.M).group(1)


def test_the_versions_these_tests_run_with_are_inside_the_bounds():
    outside = []
    for requirement in packages("DEMO_PACKAGES") + packages("TEST_PACKAGES"):
        try:
            installed = version(requirement.name)
        except PackageNotFoundError:
            continue  # this environment was not set up by make (the GPU machine's, say)
        if not requirement.specifier.contains(installed, prereleases=True):
            outside.append(f"{requirement.name} {installed} (wants {requirement.specifier})")
    assert not outside, f"the bounds exclude what the tests ran with: {outside}"


def test_a_python_older_than_torchs_is_refused_with_the_fix(tmp_path):
    fake = tmp_path / "python3.9"
    fake.write_text('#!/bin/sh\ncase "$*" in *version_info*) exit 1;; *platform*) echo 3.9.18; exit 0;; esac\n'
                    f'echo "ran: $*" >> {tmp_path / "ran"}\n')
    fake.chmod(0o755)
    venv = tmp_path / "venv"
    done = subprocess.run(
        [shutil.which("make"), "-s", "-C", str(ROOT), f"{venv}/.demo-deps-installed", f"PYTHON={fake}", f"VENV={venv}"],
        capture_output=True, text=True, timeout=60,
    )
    said = done.stdout + done.stderr
    assert done.returncode != 0, said
    assert "is CPython 3.9.18; the set-up needs 3.10 or newer" in said and "make PYTHON=python3.11" in said, said
    assert not (tmp_path / "ran").exists() and not venv.exists(), "nothing was set up"
