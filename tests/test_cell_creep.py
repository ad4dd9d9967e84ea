"""The cell log's creep note in a real kernel, on the CPU (host figures): cells run one after
the other that each end higher, each growing the same list of tensors, are named before
anything fails (issue 39, section 5)."""

SETUP = """\
import torch
import gpuexp
%gpuexp log on
w = torch.randn(512, 512, requires_grad=True)
"""
# Each run keeps an output that requires grad, with the input its graph saves: about 8 MiB.
KEEP = "x = torch.randn(2048, 512)\nouts.append(x @ w)"
NOTES = "gpuexp.cells()[-1].to_dict()['notes']"


def creep_notes(kernel):
    return [n for n in kernel.value(NOTES) if n.startswith("memory creeps")]


def test_a_cell_that_appends_a_tensor_to_a_list_run_three_times_gets_the_note_naming_the_list(kernel):
    kernel.run(SETUP + "outs = []")
    for run in range(2):
        kernel.run(KEEP)
        assert creep_notes(kernel) == [], f"run {run + 1} of 2 is not yet a row"
    shown = kernel.run(KEEP)
    (note,) = creep_notes(kernel)
    assert "`outs`" in note and "now 3 items" in note and "on host" in note, note
    assert "memory creeps" in shown.text, shown
    assert kernel.value("len(outs)") == 3, "the note clears nothing"


def test_a_notebook_function_that_grows_a_list_is_followed_into(kernel):
    kernel.run(SETUP + "kept = []\ndef evaluate():\n    kept.append(torch.randn(2048, 512) @ w)")
    for _ in range(3):
        kernel.run("evaluate()")
    (note,) = creep_notes(kernel)
    assert "`kept`" in note, note


def test_cells_that_end_higher_without_growing_a_holder_get_no_note(kernel):
    kernel.run(SETUP + "outs = []")
    for run in range(3):
        kernel.run(f"big{run} = torch.randn(2048, 512) @ w")  # memory rises; no container grows
    assert creep_notes(kernel) == []
    for _ in range(3):
        kernel.run("outs.append(1)")  # a holder grows; memory does not rise
    assert creep_notes(kernel) == []
