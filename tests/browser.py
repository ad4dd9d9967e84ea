"""JupyterLab in headless Chromium, driven as a person would: open a notebook, run its cells
through the menu or Shift+Enter, wait for the kernel, read the rendered page.

`JupyterLab` is a server on 127.0.0.1 (a free port, a token) over a temporary root folder, with
its own config, data, runtime and user-settings folders, and one kernelspec, "python3", that is
the Python running the tests (the .venv with the freshly built gpuexp). `Browser` is Chromium
through Debian's chromedriver, named by path, so Selenium never looks for a driver to download.
`Page` is one notebook open in it. The fixtures at the end (`lab`, `chrome`, `screenshots`)
are what tests use; they skip, saying why, where Chromium or chromedriver is missing. A view
that changes while its cell runs is read with `run_cell(i, wait=False)` then `watch(cell)`.
"""

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

LIGHT = "JupyterLab Light"
DARK = "JupyterLab Dark"
KERNEL_NAME = "python3"

# The names Debian's chromium and chromium-driver put on PATH; CHROMIUM and CHROMEDRIVER name others.
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def find_browser():
    """(chromium, chromedriver, None) when both are installed, else (None, None, why not)."""
    found = {
        "chromium": os.environ.get("CHROMIUM") or next(filter(None, map(shutil.which, CHROMIUM_NAMES)), None),
        "chromedriver": os.environ.get("CHROMEDRIVER") or shutil.which("chromedriver"),
    }
    missing = [name for name, path in found.items() if not (path and os.access(path, os.X_OK))]
    if missing:
        why = (f"{' and '.join(missing)} not found: `apt-get install --no-install-recommends chromium "
               "chromium-driver` (make test does, as root)")
        return None, None, why
    if importlib.util.find_spec("selenium") is None:
        return None, None, "selenium is not installed in this Python: `make venv` installs it"
    return found["chromium"], found["chromedriver"], None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_json(path, value):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=1))


class JupyterLab:
    """A JupyterLab server of its own: nothing from the user's ~/.jupyter is read, and nothing of
    the user's is written."""

    def __init__(self, timeout=90):
        self.tmp = Path(tempfile.mkdtemp(prefix="gpuexp-lab-"))
        self.root = self.tmp / "root"
        self.root.mkdir()
        self.settings_dir = self.tmp / "settings"
        self.port = free_port()
        self.token = os.urandom(16).hex()
        self.url = f"http://127.0.0.1:{self.port}"
        data = self.tmp / "data"
        _write_json(data / "kernels" / KERNEL_NAME / "kernel.json", {
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (gpuexp)",
            "language": "python",
        })
        settings = {
            # No news or update checks (no network but the registries), and every cell stays in
            # the DOM (the default windowing leaves cells out of view unrendered).
            "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
            "@jupyterlab/extensionmanager-extension:plugin": {"enabled": False},
            "@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"},
            "@jupyterlab/apputils-extension:themes": {"theme": LIGHT},
        }
        for plugin, values in settings.items():
            self.write_setting(plugin, values)
        env = dict(os.environ)
        env.update(
            JUPYTER_CONFIG_DIR=str(self.tmp / "config"),
            JUPYTER_DATA_DIR=str(data),
            JUPYTER_PATH=str(data),
            JUPYTER_RUNTIME_DIR=str(self.tmp / "runtime"),
            JUPYTERLAB_SETTINGS_DIR=str(self.settings_dir),
            JUPYTERLAB_WORKSPACES_DIR=str(self.tmp / "workspaces"),
        )
        self.log_path = self.tmp / "server.log"
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser",
             "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
             f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
             "--ServerApp.terminals_enabled=False", "--KernelSpecManager.ensure_native_kernel=False",
             "--LabApp.extension_manager=readonly", "--allow-root"],
            env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=self.root,
        )
        self._wait_ready(timeout)

    def _wait_ready(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = self.log()
                self.stop()
                raise RuntimeError(f"JupyterLab exited with {self.process.returncode}:\n{log}")
            try:
                self.api("GET", "/api/status")
                return
            except OSError:
                time.sleep(0.2)
        log = self.log()
        self.stop()
        raise TimeoutError(f"JupyterLab did not answer in {timeout} s:\n{log}")

    def log(self):
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-5000:]

    def api(self, method, path, body=None):
        request = urllib.request.Request(
            self.url + path, method=method, data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read()
        return json.loads(text) if text else None

    def write_setting(self, plugin, values):
        """User settings of a plugin ("@jupyterlab/apputils-extension:themes"), as the settings
        editor stores them; a page opened afterwards reads them."""
        package, name = plugin.split(":")
        _write_json(self.settings_dir / package / f"{name}.jupyterlab-settings", values)

    def write_notebook(self, name, cells):
        """A notebook in the root folder from a list of code sources (str) or nbformat cells."""
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "Python 3 (gpuexp)", "language": "python"}
        nb.cells = [nbformat.v4.new_code_cell(c) if isinstance(c, str) else c for c in cells]
        nbformat.write(nb, self.root / name)
        return name

    def copy_notebook(self, path):
        shutil.copy(path, self.root / Path(path).name)
        return Path(path).name

    def shutdown_kernels(self):
        for session in self.api("GET", "/api/sessions"):
            self.api("DELETE", f"/api/sessions/{session['id']}")

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


class Browser:
    """Headless Chromium at a fixed window size, so screenshots come out the same size."""

    def __init__(self, chromium, chromedriver, size=(1400, 900)):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        self.profile = tempfile.mkdtemp(prefix="gpuexp-chromium-")
        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                         "--force-device-scale-factor=1", f"--window-size={size[0]},{size[1]}",
                         f"--user-data-dir={self.profile}", "--no-first-run", "--disable-extensions"):
            options.add_argument(argument)
        # Both paths given: Selenium Manager (which would download a driver) is never run.
        self.driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
        # The window's size includes what headless Chromium reserves around the page: grow it so
        # the page itself (and so every screenshot) is `size`.
        inner = self.driver.execute_script("return [window.innerWidth, window.innerHeight];")
        outer = self.driver.get_window_size()
        self.driver.set_window_size(outer["width"] + size[0] - inner[0], outer["height"] + size[1] - inner[1])

    def open(self, lab, notebook, theme=LIGHT, timeout=60):
        """Opens `notebook` (a path in the lab's root) alone, in `theme` ("JupyterLab Dark" is
        what Settings → Theme stores), and waits for its kernel."""
        lab.write_setting("@jupyterlab/apputils-extension:themes", {"theme": theme})
        # `reset`: a fresh workspace, without the tabs an earlier test left open.
        self.driver.get(f"{lab.url}/lab/tree/{notebook}?reset&token={lab.token}")
        page = Page(self.driver, timeout)
        page.wait_for(lambda: page.theme() == theme and page.kernel_idle(),
                      timeout, f"{notebook} open with an idle kernel in {theme}")
        return page

    def quit(self):
        self.driver.quit()
        shutil.rmtree(self.profile, ignore_errors=True)


class CellView:
    """One code cell as rendered: its prompt and its output area."""

    def __init__(self, element):
        self.element = element

    @property
    def output(self):
        return self.element.find_element("css selector", ".jp-OutputArea")

    @property
    def html(self):
        return self.output.get_attribute("innerHTML")

    @property
    def text(self):
        return self.output.text

    def prompt(self):
        return self.element.find_element("css selector", ".jp-InputArea-prompt").text.strip()

    def execution_count(self):
        match = re.fullmatch(r"\[(\d+)\]:", self.prompt())
        return int(match.group(1)) if match else None

    def find(self, selector):
        return self.output.find_elements("css selector", selector)

    def html_blocks(self):
        """Each HTML output of the cell as rendered: its title (first bold text), its other lines,
        and its table's header and rows, each cell as (tag, text), so a test sees real cells."""
        driver = self.element.parent  # Selenium's name for the driver an element belongs to
        return [Block(**b) for b in driver.execute_script(BLOCKS_JS, self.output)]

    def errors(self):
        """The tracebacks the cell shows. JupyterLab renders an error output under the stderr
        MIME type, beside stderr streams (warnings), so the traceback's own header tells them apart."""
        shown = self.find('[data-mime-type="application/vnd.jupyter.stderr"], '
                          '[data-mime-type="application/vnd.jupyter.error"]')
        return [e.text for e in shown if "Traceback (most recent call last)" in e.text]

    def __repr__(self):
        return f"<CellView {self.prompt()}\n{self.text}>"


class Block:
    """One HTML output: a report, a cell's log, a snapshot."""

    def __init__(self, title, lines, header, rows):
        self.title, self.lines, self.header, self.rows = title, lines, header, rows

    def row(self, label):
        """The texts of the row whose first cell is `label`."""
        return next([text for _, text in row] for row in self.rows if row and row[0][1] == label)

    def __repr__(self):
        return f"<Block {self.title!r} {self.lines} {self.header} {self.rows}>"


BLOCKS_JS = """
const text = e => e ? e.innerText.trim() : null;
const outputs = arguments[0].querySelectorAll('.jp-OutputArea-output[data-mime-type="text/html"]');
return Array.from(outputs, out => ({
  title: text(out.querySelector('b, strong')),
  lines: Array.from(out.querySelectorAll('span, small')).map(text),
  header: Array.from(out.querySelectorAll('table thead th')).map(text),
  rows: Array.from(out.querySelectorAll('table tbody tr'), r => Array.from(r.children, c => [c.tagName, text(c)])),
}));
"""


LEFT_SIDEBAR_OPEN = "#jp-left-stack:not(.lm-mod-hidden)"

KERNEL_IDLE_JS = """
const indicator = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook-ExecutionIndicator');
const status = Array.from(document.querySelectorAll('.jp-StatusBar-Item'), e => e.innerText.trim())
  .find(text => / \\| \\w+$/.test(text));
return !!indicator && indicator.getAttribute('data-status') === 'idle'
  && !!status && status.endsWith(' | Idle') && !status.startsWith('No Kernel');
"""


class Page:
    """A notebook open in JupyterLab."""

    def __init__(self, driver, timeout):
        self.driver = driver
        self.timeout = timeout

    def wait_for(self, condition, timeout=None, what="condition", interval=0.1):
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            try:
                value = condition()
            except Exception:  # the DOM changes under us while JupyterLab renders
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(interval)

    def theme(self):
        body = self.driver.find_element("css selector", "body")
        return body.get_attribute("data-jp-theme-name")

    def kernel_idle(self):
        """The notebook's kernel is connected and idle. The toolbar's indicator alone says "idle"
        before the kernel has even started; the status bar says "No Kernel | Initializing" then."""
        return self.driver.execute_script(KERNEL_IDLE_JS)

    def cells(self):
        """Every code cell of the notebook, in order."""
        return [CellView(e) for e in self.driver.find_elements(
            "css selector", ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-CodeCell")]

    def _menu(self, *labels):
        """Clicks through the menu bar: _menu("Run", "Run All Cells")."""
        def shown(kind, label):
            """The menu bar's or an open menu's item labelled `label`."""
            names = self.driver.find_elements("css selector", f".{kind}-itemLabel")
            return [e.find_element("xpath", "..") for e in names if e.is_displayed() and e.text.strip() == label]

        self.wait_for(lambda: shown("lm-MenuBar", labels[0]), what=f"menu {labels[0]}")[0].click()
        for label in labels[1:]:
            item = self.wait_for(lambda label=label: shown("lm-Menu", label), what=f"menu item {label}")[0]
            if "lm-mod-disabled" in item.get_attribute("class"):
                raise AssertionError(f"menu item {' → '.join(labels)} is disabled")
            item.click()

    def run_all(self, timeout=None):
        """Run → Run All Cells, then waits until every code cell has run again and the kernel is
        idle; returns the cells."""
        before = [c.execution_count() for c in self.cells()]
        self._menu("Run", "Run All Cells")

        def done():
            cells = self.cells()
            counts = [c.execution_count() for c in cells]
            ran = all(n is not None and n != old for n, old in zip(counts, before))
            return ran and self.kernel_idle() and cells
        return self.wait_for(done, timeout, f"{len(before)} cells to run")

    def run_cell(self, index, wait=True, timeout=None):
        """Selects code cell `index` and presses Shift+Enter, as a person would."""
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.keys import Keys

        cell = self.cells()[index]
        before = cell.execution_count()
        prompt = cell.element.find_element("css selector", ".jp-InputArea-prompt")
        actions = ActionChains(self.driver).move_to_element(prompt).click()
        actions.key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT).perform()
        self.wait_for(lambda: cell.execution_count() != before or cell.prompt() == "[*]:",
                      what=f"cell {index} to start")
        if wait:
            self.wait_for(lambda: cell.execution_count() not in (None, before) and self.kernel_idle(),
                          timeout, f"cell {index} to finish")
        return cell

    def watch(self, cell, timeout=None, interval=0.05):
        """Each new rendering of `cell`'s output while it runs, as (seconds since the call, HTML),
        for views that update during a cell; returns when the cell has finished. Call it right
        after `run_cell(..., wait=False)`."""
        start = time.monotonic()
        deadline = start + (timeout or self.timeout)
        seen = []
        while cell.prompt() == "[*]:" or not self.kernel_idle():
            html = cell.html
            if not seen or seen[-1][1] != html:
                seen.append((time.monotonic() - start, html))
            if time.monotonic() > deadline:
                raise TimeoutError("timed out watching a running cell")
            time.sleep(interval)
        return seen

    def scroll_to(self, element, block="start"):
        self.driver.execute_script(f"arguments[0].scrollIntoView({{block: '{block}'}});", element)

    def hide_left_sidebar(self):
        """View → Appearance → Show Left Sidebar, unticked: the notebook gets the window's width."""
        if self.driver.find_elements("css selector", LEFT_SIDEBAR_OPEN):
            self._menu("View", "Appearance", "Show Left Sidebar")
            self.wait_for(lambda: not self.driver.find_elements("css selector", LEFT_SIDEBAR_OPEN),
                          what="the left sidebar to close")

    def rest_pointer(self):
        """Moves the mouse to an empty spot of the menu bar, so no table row shows as hovered."""
        from selenium.webdriver.common.actions.action_builder import ActionBuilder

        width = self.driver.execute_script("return window.innerWidth;")
        actions = ActionBuilder(self.driver)
        actions.pointer_action.move_to_location(width - 5, 5)
        actions.perform()

    def screenshot(self, path, element=None, block="start"):
        """The window, scrolled to `element` if given, as a PNG."""
        self.rest_pointer()
        if element is not None:
            self.scroll_to(element, block)
        time.sleep(0.3)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.driver.save_screenshot(str(path))
        return Path(path)

    def contrast(self, element):
        """WCAG contrast ratio of `element`'s text against the background it is drawn on (the
        first ancestor with an opaque background), computed by the browser."""
        return self.driver.execute_script(CONTRAST_JS, element)


CONTRAST_JS = """
const parse = c => { const v = (c.match(/[\\d.]+/g) || []).map(Number); return v.length === 3 ? [...v, 1] : v; };
const over = (top, below) => top.slice(0, 3).map((v, i) => v * top[3] + below[i] * (1 - top[3])).concat([1]);
const luminance = rgb => {
  const lin = v => { v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); };
  return 0.2126 * lin(rgb[0]) + 0.7152 * lin(rgb[1]) + 0.0722 * lin(rgb[2]);
};
const el = arguments[0];
// The backgrounds from the element up to the first opaque one, composited from the bottom.
const layers = [];
for (let node = el; node && node.nodeType === 1; node = node.parentElement) {
  const c = parse(getComputedStyle(node).backgroundColor);
  if (c.length === 4 && c[3] > 0) layers.push(c);
  if (c.length === 4 && c[3] >= 1) break;
}
let bg = [255, 255, 255, 1];
for (const layer of layers.reverse()) bg = over(layer, bg);
const fg = over(parse(getComputedStyle(el).color), bg);
const [l1, l2] = [luminance(fg), luminance(bg)].sort((a, b) => b - a);
const css = c => 'rgb(' + c.slice(0, 3).map(Math.round).join(', ') + ')';
return {ratio: (l1 + 0.05) / (l2 + 0.05), color: css(fg), background: css(bg)};
"""


# Fixtures, imported by conftest.py: one server and one browser for the whole session.

@pytest.fixture(scope="session")
def jupyter_lab():
    chromium, chromedriver, why = find_browser()
    if why:
        pytest.skip(why)
    lab = JupyterLab()
    lab.chromium, lab.chromedriver = chromium, chromedriver
    yield lab
    lab.stop()


@pytest.fixture(scope="session")
def chrome(jupyter_lab):
    browser = Browser(jupyter_lab.chromium, jupyter_lab.chromedriver)
    yield browser
    browser.quit()


@pytest.fixture
def lab(jupyter_lab, chrome):
    """The session's JupyterLab for one test; the kernels the test started are shut down after it."""
    yield jupyter_lab
    jupyter_lab.shutdown_kernels()


@pytest.fixture
def screenshots(tmp_path):
    """Where screenshots go: GPUEXP_SCREENSHOTS (`make screenshots` gives docs/), else a temp folder."""
    folder = os.environ.get("GPUEXP_SCREENSHOTS")
    return Path(folder) if folder else tmp_path
