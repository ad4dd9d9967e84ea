"""python/gpuexp/_core.pyi types the native module gpuexp._core: these tests fail when the two
disagree, which happens whenever rust/src/bindings/ adds, removes or changes a function, class,
method or argument, or changes a doc comment (the stub's docstrings are copied from the module's
by docs/stub.py)."""

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STUB = ROOT / "python" / "gpuexp" / "_core.pyi"
FIX = "update python/gpuexp/_core.pyi"


@pytest.fixture
def core():
    import gpuexp._core

    return gpuexp._core


def public(names):
    return {name for name in names if not name.startswith("_")}


def stub_names():
    """The names the stub declares at its top level."""
    names = set()
    for node in ast.parse(STUB.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return public(names)


def test_the_stub_declares_exactly_the_modules_names(core):
    runtime, stub = public(dir(core)), stub_names()
    assert runtime == stub, (
        f"{FIX}: gpuexp._core has {sorted(runtime - stub)} that the stub lacks, "
        f"and the stub declares {sorted(stub - runtime)} that gpuexp._core lacks"
    )


def stubtest(source, tmp_path):
    """mypy.stubtest of the stub under `source` (a folder holding gpuexp/) against the built module."""
    allowlist = tmp_path / "allowlist.txt"
    # PyO3 lists every name it adds in __all__; the stub's own declarations say the same.
    allowlist.write_text("gpuexp._core.__all__\n")
    # Only the stub is checked: the package's Python modules it imports are read, not judged.
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\nfollow_imports = silent\nignore_missing_imports = True\n")
    env = dict(os.environ, MYPYPATH=str(source))
    return subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "gpuexp._core", "--allowlist", str(allowlist),
         "--mypy-config-file", str(config)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
    )


def test_stubtest_finds_that_the_stub_and_the_module_agree(tmp_path):
    done = stubtest(ROOT / "python", tmp_path)
    assert done.returncode == 0, (
        f"{FIX}: mypy.stubtest finds that it and the built gpuexp._core (make build) differ:\n"
        f"{done.stdout}{done.stderr}"
    )


def test_stubtest_reads_this_stub_and_sees_a_difference(tmp_path):
    package = tmp_path / "src" / "gpuexp"
    shutil.copytree(ROOT / "python" / "gpuexp", package, ignore=shutil.ignore_patterns("__pycache__"))
    stub = package / "_core.pyi"
    text = stub.read_text(encoding="utf-8")
    name = next(node.name for node in ast.parse(text).body if isinstance(node, ast.FunctionDef))
    stub.write_text(text.replace(f"\ndef {name}(", f"\ndef {name}_renamed("), encoding="utf-8")
    done = stubtest(tmp_path / "src", tmp_path)
    assert done.returncode != 0
    assert f"gpuexp._core.{name} is not present in stub" in done.stdout, done.stdout


def test_the_installed_package_ships_the_stub(core):
    installed = Path(core.__file__).parent
    assert (installed / "py.typed").is_file(), "the wheel lacks gpuexp/py.typed: type checkers would skip the stub"
    shipped = installed / "_core.pyi"
    assert shipped.is_file(), "the wheel lacks gpuexp/_core.pyi"
    assert shipped.read_text(encoding="utf-8") == STUB.read_text(encoding="utf-8"), (
        "the installed gpuexp has another _core.pyi than python/gpuexp/_core.pyi: run make build"
    )


def stub_writer():
    spec = importlib.util.spec_from_file_location("stub", ROOT / "docs" / "stub.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_stubs_docstrings_are_the_modules(core):
    writer, text = stub_writer(), STUB.read_text(encoding="utf-8")
    differ = writer.differences(text, core)
    assert not differ, (
        f"the docstrings of {differ} in _core.pyi are not the doc comments in rust/src/bindings/ "
        "(the built module's __doc__): run python docs/stub.py after make build"
    )
    assert writer.rewritten(text, core) == text, "run python docs/stub.py: it writes the stub otherwise"


def test_a_docstring_written_in_the_stub_alone_is_found(core):
    writer, text = stub_writer(), STUB.read_text(encoding="utf-8")
    metric = next(node for node in ast.parse(text).body if isinstance(node, ast.ClassDef) and node.name == "Metric")
    peak = next(member for member in metric.body if isinstance(member, ast.FunctionDef) and member.name == "peak")
    written = ast.get_docstring(peak, clean=False)
    assert written, "Metric.peak has no docstring in the stub"
    changed = text.replace(written, "Typed into the stub by hand.", 1)
    assert writer.differences(changed, core) == ["Metric.peak"]
    assert writer.rewritten(changed, core) == text
