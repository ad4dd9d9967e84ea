"""An experiment that Python's garbage collector finds unreachable, or that goes on another
thread, is finished at a safe point, never in the middle of a statement (issue 30, section 1):
at the end of the cell in a notebook, at the next experiment's opening or at exit in a script.
The names bound after one of the user's names last led to it are kept."""

import subprocess
import sys
import textwrap

# The collector runs only where a test calls it (or a teardown does): an automatic collection,
# whose moment depends on what the kernel happened to allocate, once found the cycle a cell early.
SETUP = """\
import gc, threading
import numpy as np
import gpuexp
from gpuexp import GPUExperiment
gc.disable()
"""

RUNNER = """\
class Runner:
    def __init__(self):
        self.exp = GPUExperiment("runner")
        self.me = self  # a cycle: only the collector frees it
r = Runner()
"""


def present(kernel, *names):
    return kernel.value(f"sorted(n for n in {names!r} if n in globals())")


def finished(kernel):
    return kernel.value("[(r.name, r.deleted, r.kept) for r in gpuexp.history()]")


def test_a_runner_found_by_the_collector_finishes_at_the_cells_end_and_keeps_what_came_after(kernel):
    kernel.run(SETUP + RUNNER)
    kernel.run("model_weights = np.ones(4 << 20, dtype=np.uint8)")
    kernel.run("del r")
    kernel.run("between = 1")
    cell = kernel.run(
        "results = {'loss': 0.1}\ngc.collect()\nprint('still here:', results)\nprint('history', len(gpuexp.history()))"
    )
    assert "still here: {'loss': 0.1}" in cell.text and "history 0" in cell.text, cell.text
    assert cell.text.index("history 0") < cell.text.index("runner · finished"), "the report comes at the cell's end"
    assert "garbage collector" in cell.text, cell.text
    assert finished(kernel) == [["runner", ["model_weights"], ["between", "results"]]]
    assert present(kernel, "model_weights", "results", "between") == ["between", "results"]


def test_a_name_rebound_in_the_cell_the_collector_ran_in_is_kept(kernel):
    kernel.run(SETUP + RUNNER)
    kernel.run("results = {'old': 1}\nscratch = np.ones(8)")
    kernel.run("del r")
    cell = kernel.run("results = {'new': 2}\ngc.collect()\nprint(results)")
    assert "{'new': 2}" in cell.text, cell.text
    assert kernel.value("results") == {"new": 2}
    assert finished(kernel) == [["runner", ["scratch"], ["results"]]]


def test_a_class_body_dropped_then_collected_finishes_at_the_cells_end(kernel):
    kernel.run(SETUP)
    kernel.run('class Config:\n    exp = GPUExperiment("config")\n    lr = 3e-4')
    kernel.run("data = np.ones(4 << 20, dtype=np.uint8)")
    kernel.run("del Config")
    cell = kernel.run("results = {'lr': 3e-4}\ngc.collect()\nprint('results', results)")
    assert "results {'lr': 0.0003}" in cell.text and cell.error is None, cell.text
    assert finished(kernel) == [["config", ["data"], ["results"]]]
    assert present(kernel, "data", "results") == ["results"]


def test_an_experiment_the_collector_finds_in_the_cell_it_was_made_in_deletes_nothing(kernel):
    # Never seen at a cell's end: gpuexp can't tell which names came after it was dropped.
    kernel.run(SETUP)
    cell = kernel.run(RUNNER + "made = np.ones(8)\ndel r\ngc.collect()\nprint('made', made.shape)")
    assert "made (8,)" in cell.text, cell.text
    assert finished(kernel) == [["runner", [], ["made"]]]


def test_del_exp_at_a_cells_top_level_still_finishes_there(kernel):
    kernel.run(SETUP + 'exp = GPUExperiment("direct")')
    kernel.run("model = np.ones(8)")
    cell = kernel.run("del exp\nprint('history', len(gpuexp.history()))")
    assert "history 1" in cell.text, cell.text
    assert finished(kernel) == [["direct", ["model"], []]]


def test_an_experiment_dropped_on_another_thread_finishes_at_the_cells_end(kernel):
    kernel.run(SETUP + 'box = [GPUExperiment("threaded")]')
    kernel.run("made = np.ones(8)")
    cell = kernel.run(
        "t = threading.Thread(target=box.clear)\nt.start()\nt.join()\nprint('history', len(gpuexp.history()))"
    )
    assert "history 0" in cell.text and "threaded · finished" in cell.text, cell.text
    assert "another thread" in cell.text, cell.text
    assert finished(kernel) == [["threaded", ["box", "made"], ["t"]]]


def run_script(tmp_path, source):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_in_a_script_the_collected_experiment_waits_for_the_next_opening(tmp_path):
    out = run_script(
        tmp_path,
        """
        import gc, json
        import numpy as np
        import gpuexp
        from gpuexp import CPUExperiment

        exp = CPUExperiment("runner")  # at module level: it judges the module's globals
        cycle = [exp]
        cycle.append(cycle)
        del exp
        arr = np.ones(8)
        del cycle
        results = {"loss": 0.1}
        gc.collect()
        print("after collect", results, len(gpuexp.history()))
        nxt = CPUExperiment("next")
        print(json.dumps([[h.name, h.deleted, h.kept] for h in gpuexp.history()]))
        """,
    )
    assert "after collect {'loss': 0.1} 0" in out, out
    assert out.index("after collect") < out.index("runner · finished") < out.index("next · started"), out
    # A script has no cell ends where gpuexp could have seen it: every name stays.
    assert '[["runner", [], ["arr", "results"]]]' in out, out


def test_in_a_script_the_collected_experiment_finishes_at_exit(tmp_path):
    out = run_script(
        tmp_path,
        """
        import gc
        from gpuexp import CPUExperiment

        class Runner:
            def __init__(self):
                self.exp = CPUExperiment("at exit")
                self.me = self
        r = Runner()
        del r
        gc.collect()
        print("last line")
        """,
    )
    assert out.index("last line") < out.index("at exit · finished"), out


def test_an_experiment_a_teardowns_own_collection_finds_finishes_at_the_same_cells_end(kernel):
    kernel.run(SETUP + RUNNER + "first = r\nr = Runner()\nsecond = r\ndel r")
    # The first is found by the user's collection; the second, dropped after it, by the first's
    # teardown (which collects garbage): both finish as the cell ends, neither in the middle.
    cell = kernel.run("del first\ngc.collect()\ndel second\nprint('history', len(gpuexp.history()))")
    assert "history 0" in cell.text, cell.text
    assert kernel.value("[r.name for r in gpuexp.history()]") == ["runner", "runner"]
