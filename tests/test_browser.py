"""gpuexp as a person sees it: notebooks run through JupyterLab's own UI in headless Chromium,
checked on the rendered page (tests/browser.py has the harness)."""

import importlib.util
import re
import struct
import sys
from pathlib import Path

import pytest

from browser import DARK, LIGHT

pytestmark = pytest.mark.browser

QUICKSTART = Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"
# What the tables show for a size: "1.72 GiB", "+64.00 MiB", "-1.00 KiB", "0 B", "512 B".
SIZE = re.compile(r"[+-]?(\d+\.\d\d [KMGT]iB|\d+ B)")
SCALED_SIZE = re.compile(r"\d+\.\d\d [KMG]iB")
CELL_LOG_TITLE = re.compile(r"gpuexp · cell \[(\d+)\] · (\d+\.\d{3}) s")
REPORT_HEADER = ["memory", "start", "peak", "consumed", "reclaimed", "share", "end"]
CELL_LOG_HEADER = ["memory", "Δ", "peak above start", "now"]
# A colour written out in a style attribute, once the theme's variables (fallbacks included) are gone.
COLOUR = re.compile(
    r"#[0-9a-f]{3,8}\b|\b(rgba?|hsla?)\(|\b(black|white|gr[ae]y|silver|red|green|blue|yellow|orange)\b", re.I)
THEME_VARIABLE = re.compile(r"var\(--jp-[^()]*(\([^()]*\)[^()]*)*\)")
SMALL_EXPERIMENT = [
    "import gpuexp\nexp = gpuexp.CPUExperiment('theme')",
    "x = bytearray(64 << 20)",
    "del exp",
]


def only(items, what):
    assert len(items) == 1, f"expected one {what}, found {items}"
    return items[0]


def blocks_titled(cells, pattern):
    return [b for c in cells for b in c.html_blocks() if b.title and re.fullmatch(pattern, b.title)]


def assert_real_cells(block):
    """Every figure is in its own <td>, under <th> headers: a table, not preformatted text."""
    assert block.rows, block
    for row in block.rows:
        assert [tag for tag, _ in row] == ["TD"] * len(block.header), block


def png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_quickstart_shows_the_report_and_the_cell_log_as_tables(lab, chrome, screenshots):
    page = chrome.open(lab, lab.copy_notebook(QUICKSTART))
    page.hide_left_sidebar()
    cells = page.run_all(timeout=600)
    assert not [c for c in cells if c.errors()], [c.errors() for c in cells]
    assert not any("┌" in c.text for c in cells), "a table showed as text, not HTML"

    report = only(blocks_titled(cells, r"gpuexp · bs=64 · finished · [\d.]+ s"), "finished report")
    assert report.header == REPORT_HEADER
    assert_real_cells(report)
    rss = report.row("host RSS")
    for column in ("start", "peak", "end"):
        assert SCALED_SIZE.fullmatch(rss[REPORT_HEADER.index(column)]), rss
    for column in ("consumed", "reclaimed"):
        assert SIZE.fullmatch(rss[REPORT_HEADER.index(column)]), rss
    assert re.fullmatch(r"\d+\.\d%", rss[REPORT_HEADER.index("share")]), rss
    deleted = next(line for line in report.lines if line.startswith("deleted: "))
    assert {"model", "optimizer", "buffer"} <= set(deleted[len("deleted: "):].split(", ")), deleted

    training = only([c for c in cells if "step 2: loss" in c.text], "training cell")
    log = only([b for b in training.html_blocks() if CELL_LOG_TITLE.fullmatch(b.title or "")], "cell log")
    assert int(CELL_LOG_TITLE.fullmatch(log.title).group(1)) == training.execution_count()
    assert log.header == CELL_LOG_HEADER
    assert_real_cells(log)
    delta, peak, now = log.row("host RSS")[1:]
    # The cell made a 256 MiB array and a model: RSS rose by more than a KiB-sized figure.
    assert re.fullmatch(r"\+\d+\.\d\d [MG]iB", delta) and SIZE.fullmatch(peak) and SCALED_SIZE.fullmatch(now)

    # The live report (exp.data), its cell's log, and the finished report below them.
    live = only([c for c in cells if blocks_titled([c], r"gpuexp · bs=64 · running · [\d.]+ s")], "exp.data cell")
    shot = page.screenshot(screenshots / "jupyterlab-report.png", live.element)
    assert png_size(shot) == (1400, 900)


@pytest.mark.parametrize("theme", [LIGHT, DARK])
def test_report_and_cell_log_are_readable_in_the_theme(lab, chrome, theme):
    # The last cell fails, to show that the harness sees an error where there is one.
    failing = "raise ValueError('seen by the harness')"
    page = chrome.open(lab, lab.write_notebook("theme.ipynb", [*SMALL_EXPERIMENT, failing]), theme=theme)
    *cells, failed = page.run_all()
    assert not [c for c in cells if c.errors()], [c.errors() for c in cells]
    assert "ValueError: seen by the harness" in only(failed.errors(), "traceback")
    page.rest_pointer()  # a hovered row takes another background

    texts = [e for c in cells for e in c.find(
        '[data-mime-type="text/html"] :is(td, th, b, span, small)')]
    assert len(texts) > 20, "the report and the cell log did not render"
    backgrounds = set()
    for element in texts:
        seen = page.contrast(element)
        backgrounds.add(seen["background"])
        assert seen["ratio"] >= 4.5, f"{element.text!r} in {theme}: {seen}"
    # The check means something only if the theme's own background is what the text sits on.
    for background in backgrounds:
        mean = sum(map(int, re.findall(r"\d+", background))) / 3
        assert (mean < 80) if theme == DARK else (mean > 175), f"{background} is not {theme}'s background"

    # Colours, where the HTML sets any, come from the theme's variables.
    styles = [e.get_attribute("style") for c in cells for e in c.find('[data-mime-type="text/html"] [style]')]
    hard_coded = [s for s in styles if COLOUR.search(THEME_VARIABLE.sub("", s))]
    assert not hard_coded, f"colours that ignore the theme: {hard_coded}"


def test_a_long_cell_shows_its_output_as_it_runs_then_its_log(lab, chrome):
    page = chrome.open(lab, lab.write_notebook("long.ipynb", [
        "import sys, gpuexp\nprint(sys.executable)\nprint(gpuexp.__file__)\nexp = gpuexp.CPUExperiment('long')",
        "import time\nfor tick in range(6):\n    print('tick', tick, flush=True)\n    time.sleep(0.5)\n"
        "kept = bytearray(8 << 20)",  # memory moved: the cell's block shows
    ]))
    kernel = page.run_cell(0)
    assert not kernel.errors(), kernel.errors()
    # The kernel is this venv's Python with the gpuexp that `make build` installed into it.
    executable, module = kernel.text.splitlines()[:2]
    assert executable == sys.executable
    assert module == importlib.util.find_spec("gpuexp").origin

    cell = page.run_cell(1, wait=False)
    seen = page.watch(cell)
    ticks_shown = {html.count("tick ") for _, html in seen if "gpuexp · cell [" not in html}
    assert len(ticks_shown - {0, 6}) >= 2, f"the output changed {len(seen)} times while the cell ran"

    log = only([b for b in cell.html_blocks() if CELL_LOG_TITLE.fullmatch(b.title or "")], "cell log")
    assert float(CELL_LOG_TITLE.fullmatch(log.title).group(2)) >= 3.0, log.title
    assert log.header == CELL_LOG_HEADER
    assert_real_cells(log)
