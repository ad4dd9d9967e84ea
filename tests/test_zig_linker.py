"""rust/zig-linker finds the ziglang beside maturin, and without any links natively with a
warning (issue 21, section 5). `make wheel-check` proves the manylinux_2_17 wheel itself."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

LINKER = Path(__file__).resolve().parent.parent / "rust" / "zig-linker"
SYSTEM_PATH = "/usr/bin:/bin"


def executable(path, text):
    path.write_text(text)
    path.chmod(0o755)


def clean_env(path):
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHON_SYS_EXECUTABLE", "VIRTUAL_ENV")}
    env["PATH"] = path
    return env


def test_the_python_beside_maturin_runs_zig_when_the_venv_is_not_activated(tmp_path):
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    # A process named maturin, as `.venv/bin/maturin build` is, with the venv's Python beside it.
    shutil.copy(os.path.realpath("/bin/sh"), venv_bin / "maturin")
    executable(venv_bin / "python3", f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    decoy = tmp_path / "path"
    decoy.mkdir()
    executable(decoy / "python3", "#!/bin/sh\nexit 1\n")  # the first python3 on PATH: no ziglang
    found = subprocess.run(
        [str(venv_bin / "maturin"), "-c", f"{LINKER} --print-zig; true"],
        env=clean_env(f"{decoy}:{SYSTEM_PATH}"), capture_output=True, text=True, timeout=60,
    )
    assert found.stdout.strip() == str(venv_bin / "python3"), (found.stdout, found.stderr)


def test_without_ziglang_it_links_natively_and_says_the_wheel_needs_this_glibc(tmp_path):
    path = tmp_path / "path"
    path.mkdir()
    executable(path / "python3", "#!/bin/sh\nexit 1\n")
    calls = tmp_path / "cc-args"
    executable(path / "cc", f'#!/bin/sh\necho "$@" > {calls}\n')
    linked = subprocess.run(
        [str(LINKER), "-o", "libx.so", "x.o"], env=clean_env(f"{path}:{SYSTEM_PATH}"),
        capture_output=True, text=True, timeout=60,
    )
    assert linked.returncode == 0, linked.stderr
    assert calls.read_text().split() == ["-o", "libx.so", "x.o"], "rustc's arguments go to cc unchanged"
    assert "warning" in linked.stderr and "natively" in linked.stderr and "glibc" in linked.stderr, linked.stderr
    assert "manylinux_2_17" in linked.stderr
