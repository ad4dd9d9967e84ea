"""The rough edges a newcomer's hostile round found (issue 30, section 5), one test each, in a
real IPython kernel."""

SETUP = """\
import gpuexp
from gpuexp import CPUExperiment
"""


def test_an_empty_name_is_no_name(kernel):
    kernel.run(SETUP)
    shown = kernel.run("with CPUExperiment(''):\n    pass")
    name = kernel.value("gpuexp.history()[-1].name")
    assert name.startswith("exp-") and f"gpuexp · {name} · finished" in shown.text, shown.text


def test_a_lone_surrogate_in_a_name_is_a_clear_error(kernel):
    kernel.run(SETUP)
    error = kernel.run("CPUExperiment('bs\\udc80')", expect_error=True).error
    assert error.startswith("ValueError: name 'bs\\udc80' holds a lone surrogate"), error
    assert kernel.value("gpuexp.history()") == []


def test_save_snapshot_says_what_path_it_takes(kernel):
    kernel.run(SETUP + "report = CPUExperiment('plain').finish()")
    error = kernel.run("report.save_snapshot(b'peak.pickle')", expect_error=True).error
    assert error == ("TypeError: save_snapshot() takes a file path (a str or os.PathLike), "
                     "e.g. save_snapshot('peak.pickle'); got b'peak.pickle'"), error


def test_a_gpuexp_cell_displays_its_last_expression_as_a_plain_cell_does(kernel):
    kernel.run(SETUP)
    cell = kernel.run("%%gpuexp shown\nx = 41\nx + 1")
    results = [o for o in cell.outputs if o.output_type == "execute_result"]
    assert [r["data"]["text/plain"] for r in results] == ["42"], cell.outputs
    assert "gpuexp · shown · finished" in cell.text
    texts = [o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in cell.outputs]
    assert texts.index("42") < next(i for i, t in enumerate(texts) if "gpuexp · shown · finished" in t)
    quiet = kernel.run("%%gpuexp quiet\ny = 1\ny + 1;")
    assert not [o for o in quiet.outputs if o.output_type == "execute_result"], quiet.outputs
    assert kernel.value("'x' in globals() or 'y' in globals()") is False, "the cells' names were deleted"


def test_finish_as_a_cells_last_line_shows_the_report_once(kernel):
    kernel.run(SETUP)
    for cell, name in (("exp = CPUExperiment('{}')", "once"), ("exp = CPUExperiment('{}')", "quiet")):
        kernel.run(cell.format(name))
        shown = kernel.run("exp.finish()" + (";" if name == "quiet" else ""))
        assert shown.text.count(f"gpuexp · {name} · finished") == 1, shown.text
    kernel.run("exp = CPUExperiment('kept')")
    shown = kernel.run("report = exp.finish()")
    assert shown.text.count("gpuexp · kept · finished") == 1, shown.text
