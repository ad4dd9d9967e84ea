"""gpuexp.compare(): finished experiments side by side, in a real kernel (host figures)."""

MiB = 1 << 20

SETUP = """\
import gpuexp
for bs in (16, 32, 64):
    with gpuexp.CPUExperiment(f"bs={bs},lr=3e-4"):
        batch = bytearray(bs << 21)   # 2 MiB per sample
with gpuexp.CPUExperiment("tuned", params={"bs": 128, "opt": "adam", "amp": True}):
    batch = bytearray(128 << 21)
with gpuexp.CPUExperiment("baseline"):
    pass
comparison = gpuexp.compare()
"""


def test_rows_carry_params_as_numbers_and_the_reports_json_shape(kernel):
    kernel.run(SETUP)
    rows = kernel.value("comparison.to_dict()['rows']")
    assert [r["name"] for r in rows] == ["bs=16,lr=3e-4", "bs=32,lr=3e-4", "bs=64,lr=3e-4", "tuned", "baseline"]
    assert rows[0]["params"] == {"bs": 16, "lr": 0.0003}
    assert isinstance(rows[0]["params"]["bs"], int) and isinstance(rows[0]["params"]["lr"], float)
    assert rows[3]["params"] == {"bs": 128, "opt": "adam", "amp": True}
    assert rows[4]["params"] == {}
    for row in rows:
        assert set(row["host"]["rss"]) == {"start", "before_teardown", "end", "peak", "consumed", "reclaimed"}
        assert row["gpus"] == [] and row["kind"] == "cpu" and row["duration_s"] >= 0
    peaks = [r["host"]["rss"]["peak"] - r["host"]["rss"]["start"] for r in rows[:3]]
    for bs, peak in zip((16, 32, 64), peaks):
        assert bs * 2 * MiB <= peak <= bs * 2 * MiB + 8 * MiB, (bs, peak)
    # The report carries its params too.
    assert kernel.value("gpuexp.history()[3].to_dict()['params']") == {"bs": 128, "opt": "adam", "amp": True}


def test_the_table_shows_each_experiment_and_its_params(kernel):
    kernel.run(SETUP)
    shown = kernel.run("comparison")
    assert shown.text.startswith("gpuexp · compare · 5 experiments")
    header = next(line for line in shown.text.splitlines() if line.startswith("│ experiment"))
    for column in ("bs", "lr", "opt", "amp", "duration", "host RSS peak", "consumed", "reclaimed", "OOMs"):
        assert column in header, header
    assert "<table>" in shown.html and "<td style=\"text-align:left\">tuned</td>" in shown.html
    assert kernel.value("len(gpuexp.compare([gpuexp.history()[0], gpuexp.history()[2]]))") == 2
    kernel.run("running = gpuexp.CPUExperiment('bs=256')")
    both = kernel.run("gpuexp.compare([gpuexp.history()[0], running])").text
    assert "bs=256 (running)" in both and "a running experiment's figures are those so far" in both


def test_to_pandas_gives_a_row_per_experiment_with_numbers(kernel):
    kernel.run(SETUP)
    frame = kernel.value(
        "(lambda f: {'columns': list(f.columns)[:4], 'bs': [None if v != v else v for v in f['bs']], "
        "'dtype': str(f['host.rss.peak'].dtype)})(comparison.to_pandas())"
    )
    assert frame["columns"] == ["name", "bs", "lr", "opt"]
    assert frame["bs"] == [16, 32, 64, 128, None]
    assert frame["dtype"] == "int64"


def test_plot_returns_a_figure_with_the_peaks_the_memory_and_the_fit(kernel):
    kernel.run(SETUP)
    kernel.run("figure = comparison.plot()")
    lines = kernel.value("[line.get_label() for line in figure.axes[0].get_lines()]")
    assert lines[0] == "host RSS"
    assert any(label.startswith("host memory (") for label in lines), lines
    fit = next(label for label in lines if label.startswith("fit of host RSS"))
    assert "fits up to bs = " in fit, fit
    assert kernel.value("type(figure).__module__ + '.' + type(figure).__name__") == "matplotlib.figure.Figure"
    points = kernel.value("[list(map(float, figure.axes[0].get_lines()[0].get_xdata()))]")
    assert points == [[16.0, 32.0, 64.0, 128.0]], "'baseline' has no bs and is left out"
    # As a cell's result, the figure shows once, as an image.
    shown = kernel.run("comparison.plot(x='bs')")
    assert [o.output_type for o in shown.outputs if "image/png" in o.get("data", {})] == ["execute_result"]


def test_bad_input_gets_a_clear_error(kernel):
    kernel.run(SETUP)
    kernel.run("pair = [gpuexp.CPUExperiment(n).finish() for n in ('bs=8,lr=0.1', 'bs=16,lr=0.2')]")
    several = kernel.run("gpuexp.compare(pair).plot()", expect_error=True).error
    assert several.startswith("ValueError") and "several params vary (bs, lr)" in several, several
    assert "x=" in several
    none = kernel.run("gpuexp.compare(gpuexp.history()[4:5]).plot()", expect_error=True).error
    assert "no numeric param varies" in none, none
    wrong = kernel.run("comparison.plot(x='opt')", expect_error=True).error
    assert "no experiment has a number for \"opt\"" in wrong, wrong
    not_a_report = kernel.run("gpuexp.compare([1, 2])", expect_error=True).error
    assert not_a_report.startswith("TypeError") and "compare([exp1, exp2])" in not_a_report
    bad_params = kernel.run("gpuexp.CPUExperiment('x', params={'bs': [1]})", expect_error=True).error
    assert bad_params.startswith("TypeError") and "params={\"bs\": 64}" in bad_params, bad_params


def test_sites_needs_two_traced_experiments_and_says_how(kernel):
    kernel.run(SETUP)
    error = kernel.run("comparison.sites()", expect_error=True)
    assert "0 of these 5 were traced" in error.text and "trace=True" in error.text, error.text
