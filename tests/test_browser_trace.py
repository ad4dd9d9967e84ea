"""Where in the code as a person sees it in JupyterLab (headless Chromium, tests/browser.py): the
peak-by-site table with its collapsible stacks, and the timeline drawn inline, in both themes.
The snapshot is the scripted program of tests/test_trace.py, so this runs without a GPU."""

import pickle

import pytest

from browser import DARK, LIGHT
from test_trace import PROGRAM, scripted_snapshot

pytestmark = pytest.mark.browser


@pytest.mark.parametrize("theme", [LIGHT, DARK])
def test_the_peak_table_and_the_timeline_read_in_the_theme(lab, chrome, tmp_path, theme):
    program = tmp_path / "train.py"
    program.write_text(PROGRAM)
    snapshot = tmp_path / "bs16.pickle"
    snapshot.write_bytes(pickle.dumps(scripted_snapshot(program, 16), protocol=4))
    page = chrome.open(lab, lab.write_notebook("trace.ipynb", [
        f"import gpuexp\ntrace = gpuexp.load_snapshot({str(snapshot)!r})", "trace", "trace.plot_timeline()"]),
        theme=theme)
    cells = page.run_all()
    assert not [c for c in cells if c.errors()], [c.errors() for c in cells]
    table = next(b for b in cells[1].html_blocks() if b.title and b.title.startswith("At the peak on GPU 0"))
    sites = [row for row in table.rows if len(row) == 5]  # the category table's rows follow
    labels = [row[0][1] for row in sites]
    assert labels[0].endswith("train.py:4"), labels  # the largest site first: bs² MiB
    assert {label.rsplit(":", 1)[1] for label in labels} == {"2", "3", "4", "5"}, labels
    assert sites[0][1][1] == "scores = alloc(bs * bs * MiB)" and sites[0][2][1] == "256.00 MiB"
    summary = cells[1].find("details summary")[0]
    stack = cells[1].find("details pre")[0]
    assert not stack.is_displayed(), "a site's stack starts folded"
    summary.click()
    page.wait_for(stack.is_displayed, what="the unfolded stack")
    assert "train.py:4 in step" in stack.text
    svg = page.wait_for(lambda: cells[2].find("svg"), what="the timeline")[0]
    assert svg.size["width"] > 300 and svg.size["height"] > 100, svg.size
    assert not cells[2].find("script"), "the timeline runs no script"
    assert cells[2].find("svg polygon"), "the sites are stacked"
    texts = [t for t in cells[2].find("svg text") if t.text.strip()]
    assert texts and all(page.contrast(t)["ratio"] >= 4.5 for t in texts if "peak" not in t.text), theme
