"""gpuexp in plain Python: scripts, and the wheel on every CPython it claims to support."""

import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def run_script(tmp_path, source, python=sys.executable):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    done = subprocess.run([python, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_module_level_experiment_deletes_the_module_globals_it_created(tmp_path):
    out = run_script(
        tmp_path,
        """
        import json
        import numpy as np
        from gpuexp import CPUExperiment
        before = np.zeros(4)
        exp = CPUExperiment("script")
        arr = np.ones(128 << 20, dtype=np.uint8)
        del exp
        import gpuexp
        print(json.dumps({"names": sorted(n for n in ("before", "arr") if n in globals()),
                          "report": gpuexp.history()[-1].to_dict()}))
        """,
    )
    assert "script · finished" in out  # the report is printed as a text table
    result = json.loads(out.strip().splitlines()[-1])
    assert result["names"] == ["before"]
    assert result["report"]["deleted"] == ["arr"]
    assert result["report"]["host"]["rss"]["reclaimed"] >= 120 * MiB


def test_inside_a_function_the_experiment_measures_but_deletes_nothing(tmp_path):
    out = run_script(
        tmp_path,
        """
        import json
        import numpy as np
        from gpuexp import CPUExperiment

        def work():
            with CPUExperiment("in a function") as exp:
                arr = np.ones(64 << 20, dtype=np.uint8)
            return exp.finish(), arr

        report, arr = work()
        print(json.dumps({"deleted": report.deleted, "consumed": report.host.rss.consumed, "alive": arr.nbytes}))
        """,
    )
    result = json.loads(out.strip().splitlines()[-1])
    assert result["deleted"] == [] and result["alive"] == 64 * MiB
    assert result["consumed"] >= 60 * MiB


def _interpreters():
    """CPython 3.9+ on PATH or installed by pyenv (as on the CI image), one per minor version."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = {}
    for minor in range(9, 15):
        installed = sorted(glob.glob(str(pyenv / f"3.{minor}.*" / "bin" / "python3")))
        candidates = [shutil.which(f"python3.{minor}"), *installed]
        for path in filter(None, candidates):
            if subprocess.run([path, "-c", "pass"], capture_output=True).returncode == 0:
                found[minor] = pytest.param(path, id=f"3.{minor}")
                break
    return list(found.values())


@pytest.mark.parametrize("python", _interpreters())
def test_the_abi3_wheel_imports_without_torch_or_driver(tmp_path, python):
    wheels = glob.glob(str(ROOT / "dist" / "gpuexp-*-cp39-abi3-*.whl"))
    if not wheels:
        pytest.skip("no wheel in dist/: run `make build` first")
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    # Unpacking the wheel is what an install does for a pure-layout wheel; no pip or network needed.
    shutil.unpack_archive(wheels[0], site, format="zip")
    out = run_script(
        tmp_path,
        """
        import sys
        import gpuexp
        snapshot = gpuexp.snapshot()
        assert "host RSS" in str(snapshot)
        with gpuexp.GPUExperiment("abi3"):
            x = bytearray(8 << 20)
        assert "torch" not in sys.modules
        print("ok", sys.version_info[:2])
        """,
        python=str(venv / "bin" / "python"),
    )
    assert out.strip().splitlines()[-1].startswith("ok")


def test_the_wheel_is_for_glibc_2_17_and_newer():
    """pip refuses a wheel tagged for a newer glibc than the machine's (issue 15): make build
    links with zig for manylinux2014, and auditwheel confirms the symbols allow it."""
    wheels = glob.glob(str(ROOT / "dist" / "gpuexp-*-cp39-abi3-*.whl"))
    if not wheels:
        pytest.skip("no wheel in dist/: run `make build` first")
    tag = f"manylinux_2_17_{platform.machine()}"
    assert tag in Path(wheels[0]).name, f"{Path(wheels[0]).name}: build it with make build (maturin --zig)"
    shown = subprocess.run([sys.executable, "-m", "auditwheel", "show", wheels[0]],
                           capture_output=True, text=True, timeout=120)
    assert f'is consistent with the following platform tag: "{tag}"' in " ".join(shown.stdout.split()), shown
