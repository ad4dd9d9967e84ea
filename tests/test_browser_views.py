"""The live view of a running cell and gpuexp.compare() as a person sees them in JupyterLab
(headless Chromium, tests/browser.py): read on the rendered page while and after cells run."""

import re
import time

import pytest

from browser import DARK, LIGHT
from test_browser import COLOUR, THEME_VARIABLE, only, png_size

pytestmark = pytest.mark.browser

LIVE_TITLE = re.compile(r"gpuexp · cell running · (\d+\.\d) s")
# A cell of about 3 s that prints as it goes and keeps more memory at every step.
GROWING = """\
chunks = []
for step in range(6):
    chunks.append(bytearray(96 << 20))
    print(f"step {step}: {len(chunks) * 96} MiB held", flush=True)
    time.sleep(0.5)
"""
SETUP = "import time, gpuexp\nexp = gpuexp.CPUExperiment('live')"


def live_titles(html):
    return LIVE_TITLE.findall(html)


def test_a_long_cell_shows_a_live_view_that_updates_then_its_block(lab, chrome, screenshots):
    notebook = lab.write_notebook("live.ipynb", [SETUP + "\ngpuexp.config(live_view_after_s=1);", GROWING])
    page = chrome.open(lab, notebook)
    page.hide_left_sidebar()
    assert not page.run_cell(0).errors()
    cell = page.run_cell(1, wait=False)
    drawn = set()  # every title the view showed, from its first drawing on

    def mid_cell():  # the live view is on the page, between the lines the cell printed
        titles = live_titles(cell.html)
        drawn.update(titles)
        return len(titles) == 1 and "step 3" in cell.text

    page.wait_for(mid_cell, what="the live view")
    shot = page.screenshot(screenshots / "jupyterlab-live.png", cell.element, block="center")
    assert png_size(shot) == (1400, 900)
    drawn.update(title for _, html in page.watch(cell) for title in live_titles(html))
    assert len(drawn) >= 3, f"the live view was drawn {len(drawn)} times: {sorted(drawn)}"  # shown, then updated twice
    bars = [b for b in cell.html_blocks() if b.title and LIVE_TITLE.fullmatch(b.title)]
    assert not bars, "the live view is gone once the cell has ended"
    block = only([b for b in cell.html_blocks() if b.title and b.title.startswith("gpuexp · cell [")], "cell block")
    delta = block.row("host RSS")[1]
    assert re.fullmatch(r"\+5\d\d\.\d\d MiB", delta), delta  # 6 × 96 MiB kept
    assert "step 5" in cell.text


@pytest.mark.parametrize("theme", [LIGHT, DARK])
def test_the_live_view_reads_in_the_theme(lab, chrome, theme):
    page = chrome.open(lab, lab.write_notebook("live-theme.ipynb", [
        SETUP + "\ngpuexp.config(live_view_after_s=0.5);", "time.sleep(30)"]), theme=theme)
    assert not page.run_cell(0).errors()
    cell = page.run_cell(1, wait=False)
    page.wait_for(lambda: cell.find(".gpuexp-live td"), what="the live view")
    page.rest_pointer()

    def read():
        """Contrast and styles of one drawing (a drawing replaced while read is read again)."""
        texts = cell.find(".gpuexp-live :is(td, th, b, span)")
        return [(e.text, page.contrast(e)) for e in texts], [e.get_attribute("style") for e in
                                                                cell.find(".gpuexp-live [style]")]

    contrasts, styles = page.wait_for(read, what="a whole drawing of the live view")
    assert len(contrasts) >= 8, contrasts
    for text, seen in contrasts:
        assert seen["ratio"] >= 4.5, f"{text!r} in {theme}: {seen}"
    assert any("--jp-brand-color1" in s for s in styles), styles
    hard_coded = [s for s in styles if COLOUR.search(THEME_VARIABLE.sub("", s))]
    assert not hard_coded, f"colours that ignore the theme: {hard_coded}"
    page._menu("Kernel", "Interrupt Kernel")
    page.wait_for(lambda: "KeyboardInterrupt" in cell.text and page.kernel_idle(), what="the interrupted cell")
    assert not cell.find(".gpuexp-live"), "an interrupted cell's live view is replaced"


def test_compare_shows_a_table_and_a_plot(lab, chrome, screenshots):
    runs = [f"with gpuexp.CPUExperiment('bs={bs}'):\n    batch = bytearray({bs} << 24)" for bs in (16, 32, 64)]
    page = chrome.open(lab, lab.write_notebook("compare.ipynb", [
        "import gpuexp", *runs, "comparison = gpuexp.compare()\ncomparison", "comparison.plot()"]))
    page.hide_left_sidebar()
    cells = page.run_all()
    assert not [c for c in cells if c.errors()], [c.errors() for c in cells]
    table = only(cells[-2].html_blocks(), "comparison table")
    assert table.title == "gpuexp · compare · 3 experiments"
    assert table.header[:4] == ["experiment", "bs", "duration", "host RSS peak"]
    assert [row[1][1] for row in table.rows] == ["16", "32", "64"]
    plot = page.wait_for(lambda: cells[-1].find("img"), what="the plot")[0]
    assert plot.get_attribute("src").startswith("data:image/png"), "the plot shows as an image"
    assert plot.size["width"] > 300 and plot.size["height"] > 200, plot.size
    time.sleep(0.2)
    shot = page.screenshot(screenshots / "jupyterlab-compare.png", cells[-2].element)
    assert png_size(shot) == (1400, 900)
