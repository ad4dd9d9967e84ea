"""An experiment a trainer's callback opens is the callback's (issue 30, section 1): it never
replaces or finishes the user's experiment of the same name, and the user's never finish it.
Real kernels, on the CPU, with the tiny models of test_integrations."""

import pytest

pytest.importorskip("pytorch_lightning")
pytest.importorskip("transformers")

from test_integrations import LIGHTNING, TRANSFORMERS  # noqa: E402 (after the skips)

USERS = """\
import numpy as np
from gpuexp import GPUExperiment
exp = GPUExperiment({name!r})
"""


def users_names_survive(kernel, *names):
    return kernel.value(f"[n for n in {names!r} if n not in globals()]") == []


def test_a_lightning_run_named_like_the_users_experiment_leaves_it_open_with_its_names(kernel, tmp_path):
    kernel.run(LIGHTNING)
    kernel.run(USERS.format(name="baseline"))
    kernel.run("model = Tiny()\nnotes = ['lr 0.1 diverged']\nweights = np.ones(8)")
    kernel.run(f"trainer = fit(model, {str(tmp_path)!r}, name='baseline')")
    assert users_names_survive(kernel, "model", "notes", "weights", "trainer", "exp")
    assert kernel.value("gpuexp._core.is_open(exp._id)"), "the callback's run must not finish the user's experiment"
    runs = kernel.value("[(r.name, r.deleted) for r in gpuexp.history()]")
    assert runs == [["baseline", []]], "only the run finished, and it deleted nothing"
    # The user's experiment still finishes as before, with the names it made.
    kernel.run("del exp")
    assert "model" in kernel.value("gpuexp.history()[-1].deleted")


def test_the_default_run_name_colliding_with_the_users_experiment_is_harmless(kernel, tmp_path):
    kernel.run(LIGHTNING)
    kernel.run(USERS.format(name="Tiny bs=16"))  # the callback's default name for this run
    kernel.run("model = Tiny()")
    kernel.run(f"trainer = fit(model, {str(tmp_path)!r})")
    assert users_names_survive(kernel, "model", "trainer", "exp")
    assert kernel.value("gpuexp._core.is_open(exp._id)")
    assert kernel.value("[r.name for r in gpuexp.history()]") == ["Tiny bs=16"]


def test_an_experiment_the_user_opens_during_the_run_neither_ends_it_nor_is_ended_by_it(kernel, tmp_path):
    kernel.run(LIGHTNING)
    # The user's step opens an experiment named like the run once, and keeps it past the run.
    kernel.run(
        "import builtins\n"
        "class Opening(Tiny):\n"
        "    def training_step(self, batch, batch_idx):\n"
        "        if not hasattr(builtins, 'inside'):\n"
        "            builtins.inside = gpuexp.GPUExperiment('Opening bs=16', delete=False)\n"
        "            builtins.run_open_after = gpuexp._core.runs_in_flight()\n"
        "        return super().training_step(batch, batch_idx)\n"
    )
    kernel.run(f"trainer = fit(Opening(), {str(tmp_path)!r})")
    assert kernel.value("builtins.run_open_after") != [], "the user's experiment must not finish the run"
    assert kernel.value("gpuexp._core.is_open(builtins.inside._id)"), "the run's end must not finish the user's"
    report = kernel.value("gpuexp.history()[-1].to_dict()")
    assert report["name"] == "Opening bs=16" and report["params"]["model"] == "Opening", report


def test_an_hf_run_named_like_the_users_experiment_leaves_it_open_with_its_names(kernel, tmp_path):
    kernel.run(TRANSFORMERS)
    kernel.run(USERS.format(name="GPT2LMHeadModel bs=8"))  # the callback's default name for this run
    kernel.run(f"notes = ['tiny GPT-2']\ntrainer = trainer_for({str(tmp_path)!r})")
    kernel.run("trainer.train()")
    assert users_names_survive(kernel, "notes", "trainer", "exp")
    assert kernel.value("gpuexp._core.is_open(exp._id)")
    assert kernel.value("[r.name for r in gpuexp.history()]") == ["GPT2LMHeadModel bs=8"]
