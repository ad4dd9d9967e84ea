"""Names are never deleted, nor experiments finished, under code that is still running (issue 38,
section 1): a finish on another thread waits for the cell's end, an outer scope leaves a running
inner one open, a second experiment of a cell nests, only the experiment itself finishes its
scope, and an interrupted opening deletes nothing."""

SETUP = """\
import asyncio, threading, time
import gpuexp
from gpuexp import GPUExperiment, CPUExperiment, _core
"""


def history(kernel):
    return kernel.value("[(r.name, r.deleted, r.kept) for r in gpuexp.history()]")


def present(kernel, *names):
    return kernel.value(f"sorted(n for n in {names!r} if n in globals())")


# ---- a finish on another thread ----


def test_a_with_block_exiting_on_another_thread_deletes_nothing_under_the_running_cell(kernel):
    kernel.run(SETUP + "def bg():\n    with GPUExperiment('bg'):\n"
               "        globals()['made_in_bg'] = bytearray(1 << 20)\n        time.sleep(1)\n"
               "threading.Thread(target=bg).start()")
    cell = kernel.run("mine = [1, 2, 3]\ntime.sleep(2.5)\nprint('history', len(gpuexp.history()))\nprint(mine)")
    assert cell.error is None, cell.text
    assert "history 0" in cell.text and "[1, 2, 3]" in cell.text, cell.text
    assert cell.text.index("[1, 2, 3]") < cell.text.index("bg · finished"), "the report comes at the cell's end"
    [(name, deleted, kept)] = history(kernel)
    assert name == "bg" and deleted == ["made_in_bg"], (deleted, kept)
    assert "mine" in kept, kept
    assert present(kernel, "mine", "made_in_bg") == ["mine"]


def test_finish_from_a_timer_returns_none_says_when_and_a_join_does_not_deadlock(kernel):
    kernel.run(SETUP + "exp = GPUExperiment('timed')\nmodel = bytearray(1 << 20)")
    cell = kernel.run(
        "box = []\nt = threading.Timer(0.2, lambda: box.append(exp.finish()))\nt.start()\nt.join(timeout=30)\n"
        "mine = [1, 2, 3]\nprint('alive', t.is_alive(), box, len(gpuexp.history()))\nprint(mine)"
    )
    assert cell.error is None, cell.text
    assert "alive False [None] 0" in cell.text and "[1, 2, 3]" in cell.text, cell.text
    assert "end of the running cell" in cell.text, cell.text
    [(name, deleted, kept)] = history(kernel)
    assert name == "timed" and deleted == ["model"], (deleted, kept)
    assert "mine" in kept and present(kernel, "mine", "model") == ["mine"]


# ---- asyncio tasks ----


def test_an_outer_scope_leaves_a_running_inner_one_open_and_its_names_bound(kernel):
    kernel.run(SETUP + "seen = {}\nasync def t(tag, s):\n    with GPUExperiment('same'):\n"
               "        globals()['made_' + tag] = bytearray(1 << 20)\n        await asyncio.sleep(s)\n"
               "        seen[tag] = 'made_' + tag in globals()")
    cell = kernel.run("await asyncio.gather(t('a', 0.1), t('b', 0.5))")
    assert cell.error is None, cell.text
    assert kernel.value("seen") == {"a": True, "b": True}, "made_b was deleted while b's block still ran"
    done = history(kernel)
    assert [deleted for _, deleted, _ in done] == [["made_a"], ["made_b"]], done
    assert "made_b" in done[0][2], "the outer lists what the running inner scope bound as kept"
    assert kernel.value("list(_core.open_experiments())") == []


def test_an_outer_scope_keeps_a_name_the_running_inner_one_rebound_until_the_inner_exits(kernel):
    # `shared` exists before either opens; b rebinds it while a's block is the outer one.
    kernel.run(SETUP + "shared = 'before'\nseen = {}\nasync def t(tag, s):\n    with GPUExperiment('same'):\n"
               "        if tag == 'b':\n            globals()['shared'] = bytearray(1 << 20)\n"
               "        await asyncio.sleep(s)\n"
               "        seen[tag] = type(globals().get('shared')).__name__")
    cell = kernel.run("await asyncio.gather(t('a', 0.1), t('b', 0.5))")
    assert cell.error is None, cell.text
    assert kernel.value("seen") == {"a": "bytearray", "b": "bytearray"}, "shared was deleted while b's block ran"
    [(outer, outer_rebound, outer_kept), (inner, inner_rebound, _)] = kernel.value(
        "[(r.name, r.rebound, r.kept) for r in gpuexp.history()]"
    )
    assert outer_rebound == [] and "shared" in outer_kept, (outer_rebound, outer_kept)
    assert inner_rebound == ["shared"], "at b's own exit the usual rule deletes what it rebound"
    assert present(kernel, "shared") == []
    assert kernel.value("list(_core.open_experiments())") == []


# ---- a second experiment in the same cell ----


def test_a_second_experiment_of_a_cell_nests_in_the_first(kernel):
    kernel.run(SETUP + "baseline = GPUExperiment('baseline')\nweights = bytearray(8 << 20)\n"
               "exp = CPUExperiment('bs=64')")
    assert history(kernel) == [], "baseline must not finish as bs=64 opens"
    kernel.run("del exp")
    kernel.run("del baseline")
    assert [[n, d] for n, d, _ in history(kernel)] == [["bs=64", []], ["baseline", ["weights"]]]


def test_two_experiments_on_one_line_and_one_bound_to_two_names(kernel):
    kernel.run(SETUP + "a = GPUExperiment('a'); b = GPUExperiment('b')")
    assert history(kernel) == []
    kernel.run("c = d = GPUExperiment('cd')")
    assert kernel.value("c is d") and history(kernel) == []
    kernel.run("a = GPUExperiment('a2'); b = GPUExperiment('b2')")  # a re-run after editing the names
    # a2 replaces a, and the experiments opened inside a (b, cd) finish first.
    assert [n for n, _, _ in history(kernel)] == ["cd", "b", "a"]
    assert kernel.value("[a.name, b.name]") == ["a2", "b2"] and kernel.value("len(_core.open_experiments())") == 2


def test_rerunning_an_edited_constructor_still_replaces(kernel):
    kernel.run(SETUP + "exp = GPUExperiment('bs=64')\nx = bytearray(1 << 20)")
    kernel.run("exp = GPUExperiment('bs=128')")
    assert history(kernel) == [["bs=64", ["x"], []]]


# ---- only the owner finishes ----


def test_a_rebuilt_copy_neither_finishes_nor_drops_the_experiment(kernel):
    kernel.run(SETUP + "import copyreg\nexp = GPUExperiment('real')\nmade = 1")
    cell = kernel.run("exp.__reduce__()", expect_error=True)
    assert cell.error.startswith("TypeError") and "can't be copied or pickled" in cell.error, cell.error
    kernel.run("clone = copyreg._reconstructor(GPUExperiment, object, None)\n"
               "clone.__dict__.update(exp.__dict__)")
    cell = kernel.run("clone.finish()", expect_error=True)
    assert cell.error.startswith("RuntimeError") and "real" in cell.error, cell.error
    kernel.run("del clone")
    assert history(kernel) == [] and kernel.value("'made' in globals()")
    kernel.run("exp.finish()")
    assert history(kernel) == [["real", ["made"], []]]


def test_reinitialising_an_open_experiment_is_refused_and_changes_nothing(kernel):
    kernel.run(SETUP + "exp = GPUExperiment('first')")
    cell = kernel.run("exp.__init__('other')", expect_error=True)
    assert cell.error.startswith("RuntimeError") and "first" in cell.error, cell.error
    assert kernel.value("exp.name") == "first"
    assert kernel.value("len(_core.open_experiments())") == 1
    kernel.run("exp.finish()")
    assert [n for n, _, _ in history(kernel)] == ["first"]


# ---- an interrupted opening ----


def test_an_interrupted_opening_deletes_nothing_and_leaves_the_caught_interrupt_to_python(kernel):
    kernel.run(SETUP + "import _thread\nfrom gpuexp import ipython\nkept_before = 1\nreal_show = ipython.show\n"
               "def interrupting(obj):\n    if 'started' in str(obj):\n        _thread.interrupt_main()\n"
               "    real_show(obj)\nipython.show = interrupting")
    cell = kernel.run(
        "try:\n    exp = GPUExperiment('cut')\n    time.sleep(1)\nexcept KeyboardInterrupt as k:\n"
        "    caught = type(k).__name__\nipython.show = real_show\nprint('open', len(_core.open_experiments()))"
    )
    assert cell.error is None, cell.text
    assert "open 0" in cell.text, cell.text
    assert kernel.value("caught") == "KeyboardInterrupt"
    [(name, deleted, kept)] = history(kernel)
    assert name == "cut" and deleted == [], (deleted, kept)
    notes = kernel.value("gpuexp.history()[0].notes")
    assert any("opening was interrupted" in note for note in notes), notes
    assert present(kernel, "kept_before", "exp") == ["kept_before"]
