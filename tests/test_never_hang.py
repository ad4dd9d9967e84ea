"""The kernel never hangs or breaks, whatever the user's environment and namespace hold: a FIFO
named as a monitor's file, a ranks store that is missing or is no store, an unusable temporary
directory, objects that raise when inspected, and lazy modules. Each case runs in a real kernel."""

import os
import socket
import time

import pytest

from kernel import Kernel
from test_interrupts import run_and_interrupt


@pytest.fixture
def quick_kernels():
    """Kernels that give up on a cell after 60 s, so a hang fails the test instead of stalling it."""
    started = []

    def start(**env):
        k = Kernel(env=env, timeout=60)
        started.append(k)
        return k

    yield start
    for k in started:
        k.shutdown()


def seconds_to_run(kernel, source, expect_error=False):
    started = time.perf_counter()
    cell = kernel.run(source, expect_error=expect_error)
    return cell, time.perf_counter() - started


# ---- a monitor's file -------------------------------------------------------------------------


def test_a_monitor_refuses_a_fifo_at_once_and_the_kernel_stays_responsive(quick_kernels, tmp_path):
    kernel = quick_kernels()
    fifo = tmp_path / "timeline.jsonl"
    os.mkfifo(fifo)
    kernel.run("import gpuexp")
    refused, took = seconds_to_run(kernel, f"gpuexp.Monitor(path={str(fifo)!r})", expect_error=True)
    assert refused.error.startswith("ValueError") and "FIFO" in refused.error and str(fifo) in refused.error
    assert took < 5, took
    # A FIFO that appears after the monitor was made (its check passed) is refused at start().
    later = tmp_path / "later.jsonl"
    kernel.run(f"mon = gpuexp.Monitor(path={str(later)!r})")
    os.mkfifo(later)
    refused, took = seconds_to_run(kernel, "mon.start()", expect_error=True)
    assert refused.error.startswith("ValueError") and "FIFO" in refused.error, refused.error
    assert took < 5, took
    assert kernel.value("mon._native is None")
    # A regular file still records.
    good = tmp_path / "good.jsonl"
    kernel.run(f"with gpuexp.Monitor('10ms', path={str(good)!r}) as ok:\n    __import__('time').sleep(0.1)")
    assert len(good.read_text().splitlines()) >= 3


# ---- the ranks store --------------------------------------------------------------------------

RANK_ENV = {"RANK": "0", "WORLD_SIZE": "1"}
OPEN_AND_FINISH = (
    "started = time.perf_counter()\n"
    "with gpuexp.CPUExperiment('{name}'):\n"
    "    x = 1\n"
    "took = time.perf_counter() - started"
)


def store_notes(kernel):
    return kernel.value("[n for n in gpuexp.history()[-1].notes if 'gpuexp.ranks()' in n]")


def test_a_missing_store_directory_fails_fast_with_one_note(quick_kernels):
    kernel = quick_kernels(GPUEXP_RANKS_STORE="file:///nonexistent/dir", **RANK_ENV)
    kernel.run("import time\nimport torch, gpuexp")
    kernel.run(OPEN_AND_FINISH.format(name="first"))
    assert kernel.value("took") < 5, "torch's FileStore would retry for 300 s"
    notes = store_notes(kernel)
    assert len(notes) == 1 and "file:///nonexistent/dir" in notes[0] and "create it" in notes[0], notes
    kernel.run(OPEN_AND_FINISH.format(name="second"))
    assert kernel.value("took") < 1
    assert "not tried again" in store_notes(kernel)[0]


@pytest.fixture
def silent_listener():
    """An address that accepts connections and never answers: no TCPStore."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    yield f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


def test_an_address_that_is_no_tcp_store_costs_seconds_and_one_note(quick_kernels, silent_listener):
    kernel = quick_kernels(GPUEXP_RANKS_STORE=silent_listener, **RANK_ENV)
    kernel.run("import time\nimport torch, gpuexp")
    cell = kernel.run(OPEN_AND_FINISH.format(name="first"))
    assert kernel.value("took") < 15, "torch's client waited 67 s here"
    assert "c10d" not in cell.text and "TCPStore" not in cell.text.replace("not a TCPStore", ""), cell.text
    notes = store_notes(kernel)
    assert len(notes) == 1 and "answers but is not a TCPStore" in notes[0], notes
    kernel.run(OPEN_AND_FINISH.format(name="second"))
    assert kernel.value("took") < 1


def test_ctrl_c_is_never_held_while_a_store_is_checked(quick_kernels, silent_listener):
    kernel = quick_kernels(GPUEXP_RANKS_STORE=silent_listener, **RANK_ENV)
    kernel.run("import time\nimport torch, gpuexp")
    started = time.perf_counter()
    status, ename, _ = run_and_interrupt(kernel, OPEN_AND_FINISH.format(name="waits"), after_s=1.0)
    took = time.perf_counter() - started
    assert (status, ename) == ("error", "KeyboardInterrupt")
    assert took < 4, f"the interrupt waited for the store check's 5 s: {took:.1f} s"
    # Nothing opened, and the store is tried again (an interrupt says nothing about it).
    assert kernel.value("len(gpuexp.history())") == 0
    kernel.run(OPEN_AND_FINISH.format(name="after"))
    assert "answers but is not a TCPStore" in store_notes(kernel)[0]


# ---- the kernel's own store directory ---------------------------------------------------------


def test_an_unusable_tmpdir_never_breaks_the_import(quick_kernels):
    kernel = quick_kernels(TMPDIR="/nonexistent/tmp", XDG_RUNTIME_DIR="")
    imported = kernel.run("import os\nimport gpuexp")
    said = imported.text
    assert said.count("ranks launched from this kernel won't reach it") == 1, said
    assert "/nonexistent/tmp" in said and "set TMPDIR" in said and "GPUEXP_RANKS_STORE" in said, said
    assert kernel.value("'GPUEXP_RANKS_STORE' in os.environ") is False
    kernel.run("with gpuexp.CPUExperiment('works'):\n    x = 1")
    assert kernel.value("gpuexp.history()[-1].name") == "works"


def test_a_runtime_directory_that_is_not_private_never_breaks_the_import(quick_kernels, tmp_path):
    (tmp_path / "gpuexp").mkdir(mode=0o755)
    os.chmod(tmp_path / "gpuexp", 0o755)
    kernel = quick_kernels(XDG_RUNTIME_DIR=str(tmp_path))
    said = kernel.run("import os\nimport gpuexp").text
    assert said.count("not a private directory") == 1 and "set TMPDIR" in said, said
    assert kernel.value("'GPUEXP_RANKS_STORE' in os.environ") is False


# ---- the namespace walk -----------------------------------------------------------------------

HOSTILE = """
import weakref
import numpy, torch
import gpuexp

class Thing:
    pass

class BadClass:
    @property
    def __class__(self):
        raise ValueError("BadClass.__class__ raised")

class BadDict:
    @property
    def __dict__(self):
        raise ValueError("BadDict.__dict__ raised")

dead = Thing()
proxy = weakref.proxy(dead)
inner = Thing()
held = {"proxy": weakref.proxy(inner)}
del dead, inner
bad_class = BadClass()
bad_dict = BadDict()
Out = 5
"""
SKIPPED = "in the namespace could not be inspected and"


def test_objects_that_raise_when_inspected_are_skipped_and_counted(kernel):
    kernel.run(HOSTILE)
    for _cell in range(2):  # every later cell too
        kernel.run("with gpuexp.CPUExperiment('hostile'):\n    made = torch.zeros(1 << 20)")
        notes = kernel.value("gpuexp.history()[-1].notes")
        skipped = [n for n in notes if SKIPPED in n]
        # BadDict and the two dead proxies (`proxy`, `held["proxy"]`: any use raises); BadClass is
        # inspected through its type, not its __class__, so it does not raise into the walk.
        assert len(skipped) == 1 and skipped[0].startswith("3 objects in the namespace"), notes
        assert "made" in kernel.value("gpuexp.history()[-1].to_dict()['deleted']")
        explained = kernel.run("print(gpuexp.explain('cpu'))").text
        assert SKIPPED in explained, explained
        found = kernel.run("print(gpuexp.holders('cpu'))").text
        assert SKIPPED in found and "gpuexp · holders · host" in found, found


def test_out_rebound_by_the_user_is_not_ipythons_output_cache(kernel):
    kernel.run("import numpy, gpuexp\nOut = 5\ncache = get_ipython().history_manager.output_hist")
    kernel.run("exp = gpuexp.CPUExperiment('out')")
    kernel.run("numpy.ones(4)")  # IPython caches the result in its own output cache, whatever `Out` names
    assert kernel.value("len(cache)") == 1
    kernel.run("gpuexp.explain('cpu')")
    kernel.run("gpuexp.holders('cpu')")
    kernel.run("del exp")
    cleared = kernel.value("gpuexp.history()[-1].to_dict()")
    assert kernel.value("len(cache)") == 0, cleared
    assert kernel.value("Out") == 5


LAZY = """
import importlib.util, sys
sys.path.insert(0, {where!r})
spec = importlib.util.find_spec("side_effect")
spec.loader = importlib.util.LazyLoader(spec.loader)
lazy = importlib.util.module_from_spec(spec)
sys.modules["side_effect"] = lazy
spec.loader.exec_module(lazy)
holder = {{"module": lazy}}
"""


def test_a_lazy_module_is_never_imported_by_a_look(kernel, tmp_path):
    marker = tmp_path / "imported"
    (tmp_path / "side_effect.py").write_text(f"open({str(marker)!r}, 'w').close()\nvalue = 42\n")
    kernel.run("import numpy, torch, gpuexp")
    kernel.run(LAZY.format(where=str(tmp_path)))
    kernel.run("exp = gpuexp.CPUExperiment('lazy')")
    kernel.run("gpuexp.explain('cpu')")
    kernel.run("gpuexp.holders('cpu')")
    kernel.run("exp.finish()")
    assert not marker.exists(), "opening an experiment, explain or holders imported the lazy module"
    assert kernel.value("lazy.value") == 42 and marker.exists(), "the module loads when the user uses it"

