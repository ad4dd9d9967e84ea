"""Issue 38 section 5, in a real IPython kernel: what a report says of the namespace after a
`%reset` inside the experiment, of dead weak proxies, and of a `_` the user bound."""

SETUP = """\
import weakref
import numpy as np
import gpuexp
from gpuexp import GPUExperiment
"""


def last_report(kernel):
    return kernel.value("gpuexp.history()[-1].to_dict()")


def test_a_reset_inside_an_experiment_is_said_and_ipythons_names_are_not_left(kernel):
    kernel.run(SETUP)
    shown = kernel.run("with GPUExperiment('reset inside'):\n    made = np.ones(8)\n    %reset -f\n")
    assert "left, looks like IPython's" not in shown.text, shown.text
    kernel.run("import gpuexp")
    report = last_report(kernel)
    assert report["left"] == [], report
    assert any(note.startswith("the namespace was reset while the experiment was open (by IPython's %reset")
               for note in report["notes"]), report["notes"]
    assert "namespace was reset" in shown.text, shown.text
    kernel.run("with gpuexp.CPUExperiment('after'):\n    pass")
    report = last_report(kernel)
    assert report["left"] == [] and not any("reset" in note for note in report["notes"]), report


def test_three_names_bound_to_dead_weak_proxies_count_three(kernel):
    # weakref.proxy gives one proxy for one referent: three names, one object, three skipped entries.
    kernel.run(SETUP + "class C:\n    pass\nobj = C()\np1 = weakref.proxy(obj)\np2 = weakref.proxy(obj)\n"
               "p3 = weakref.proxy(obj)\ndel obj")
    assert kernel.value("p1 is p2 is p3")
    kernel.run("GPUExperiment('x').finish()")
    skipped = [n for n in last_report(kernel)["notes"] if "could not be inspected" in n]
    assert len(skipped) == 1 and skipped[0].startswith("3 objects in the namespace"), skipped
    kernel.run("del p1, p2, p3\nq = [weakref.proxy(C()) for _ in range(3)]")  # three proxies, one name
    kernel.run("GPUExperiment('y').finish()")
    skipped = [n for n in last_report(kernel)["notes"] if "could not be inspected" in n]
    assert len(skipped) == 1 and skipped[0].startswith("3 objects in the namespace"), skipped


def test_an_underscore_the_user_bound_is_cleared_or_left_never_both(kernel):
    kernel.run(SETUP)
    kernel.run("exp = GPUExperiment('underscore')")
    kernel.run("for _ in range(3):\n    pass")  # IPython no longer updates a `_` the user bound
    kernel.run("np.ones(4)")
    kernel.run("exp.finish()")
    report = last_report(kernel)
    both = set(report["cleared"]) & set(report["left"])
    assert not both, report
    assert "_" in report["cleared"], report
    kernel.run("np.zeros(2)")
    assert kernel.value("type(_).__name__") == "ndarray", "IPython updates `_` again"
