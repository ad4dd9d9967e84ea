"""The quiet cell log and the live view of a long cell, in real kernels: what reaches the
frontend is read from the kernel's IOPub messages (display_data with a display id, then
update_display_data), as JupyterLab receives them."""

import os
import pty
import re
import select
import subprocess
import sys
import time

from nbclient.util import run_sync

MiB = 1 << 20
SETUP = "import sys, time, threading\nimport gpuexp\nexp = gpuexp.CPUExperiment('live')"
LIVE_TITLE = re.compile(r"gpuexp · cell running · (\d+\.\d) s")
# About 3 s, printing as it goes, keeping 8 MiB at the end.
PRINTING = "for tick in range(6):\n    print('tick', tick, flush=True)\n    time.sleep(0.5)\nkept = bytearray(8 << 20)"


class Message:
    def __init__(self, at, kind, content):
        self.at, self.kind, self.content = at, kind, content

    @property
    def display_id(self):
        return self.content.get("transient", {}).get("display_id")

    @property
    def text(self):
        return self.content.get("data", {}).get("text/plain", "") or self.content.get("text", "")

    def __repr__(self):
        return f"<{self.at:.2f} s {self.kind} {self.display_id} {self.text[:60]!r}>"


def messages(kernel, code, timeout=120):
    """Runs a cell; every IOPub message it caused, with the seconds since it was sent."""
    kc = kernel.client.kc
    sent = time.monotonic()
    msg_id = kc.execute(code)
    found = []
    while True:
        msg = run_sync(kc.get_iopub_msg)(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        found.append(Message(time.monotonic() - sent, msg["msg_type"], msg["content"]))
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    while run_sync(kc.get_shell_msg)(timeout=timeout)["parent_header"].get("msg_id") != msg_id:
        pass
    return found


def live_views(found):
    """The cell's live view: its first display, then its updates (all with one display id)."""
    first = [m for m in found if m.kind == "display_data" and m.display_id and LIVE_TITLE.match(m.text)]
    assert len(first) == 1, found
    return [m for m in found if m.display_id == first[0].display_id]


def test_a_trivial_cell_shows_no_block_and_one_that_allocates_does(kernel):
    kernel.run(SETUP)
    assert "gpuexp · cell" not in kernel.run("y = 1").text
    assert "gpuexp · cell" not in kernel.run("exp.data").text
    moved = kernel.run("x = bytearray(8 << 20)")
    assert "gpuexp · cell [" in moved.text and "+8." in moved.text
    freed = kernel.run("del x")
    assert "gpuexp · cell [" in freed.text and " MiB" in freed.text
    records = kernel.value("[c.to_dict()['host']['consumed'] for c in exp.cells]")
    assert len(records) == 4, "quiet cells are recorded all the same"
    # The window of a cell starts where the previous one ended: what the kernel did in between
    # (KiB of its own) is the cell's too, so the fall is 8 MiB give or take that.
    assert abs(records[-1] + (8 << 20)) < 256 << 10, f"a fall shows as much as a rise: {records}"


def test_the_threshold_is_a_setting_and_log_all_shows_every_cell(kernel):
    kernel.run(SETUP)
    assert kernel.value("gpuexp.config()['cell_log_min_change']") == MiB
    assert kernel.value("gpuexp.config(cell_log_min_change='16MiB')['cell_log_min_change']") == 16 * MiB
    assert "gpuexp · cell" not in kernel.run("a = bytearray(8 << 20)").text
    assert "gpuexp · cell" in kernel.run("b = bytearray(32 << 20)").text
    kernel.run("%gpuexp log all")
    assert "gpuexp · cell [" in kernel.run("y = 1").text
    assert "gpuexp · cell [" in kernel.run("pass").text
    kernel.run("%gpuexp log on")
    assert "gpuexp · cell" not in kernel.run("z = 1").text
    bad = kernel.run("gpuexp.config(cell_log_min_change='lots')", expect_error=True)
    assert bad.error.startswith("ValueError") and "24GiB" in bad.error


def test_a_long_cell_that_prints_gets_a_live_view_then_its_block(kernel):
    kernel.run(SETUP + "\ngpuexp.config(live_view_after_s=1);")
    found = messages(kernel, PRINTING)
    views = live_views(found)
    first, *updates, last = views
    assert first.at >= 0.9, views
    live = [m for m in updates if LIVE_TITLE.match(m.text)]
    assert len(live) >= 2 and all(m.kind == "update_display_data" for m in updates), views
    assert all(b.at - a.at >= 0.45 for a, b in zip(views[:-1], views[1:-1])), "at most twice a second"
    assert "host RSS" in first.text and "peak so far" in first.text
    # The cell's prints came between the drawings, and the block replaced the view at the end.
    ticks = [m for m in found if m.kind == "stream" and "tick" in m.text]
    assert first.at < ticks[-1].at < last.at, found
    assert last.kind == "update_display_data" and last.text.startswith("gpuexp · cell ["), last
    assert "+8." in last.text
    shown = [m for m in found if m.kind == "display_data" and "gpuexp · cell [" in m.text]
    assert shown == [], "the block is not shown twice"


def test_a_cell_that_raises_or_is_interrupted_has_its_view_replaced(kernel):
    kernel.run(SETUP + "\ngpuexp.config(live_view_after_s=0.5);")
    raised = messages(kernel, "big = bytearray(16 << 20)\ntime.sleep(1.2)\nraise ValueError('boom')")
    assert any(m.kind == "error" and m.content["ename"] == "ValueError" for m in raised)
    last = live_views(raised)[-1]
    assert last.kind == "update_display_data" and last.text.startswith("gpuexp · cell ["), raised
    # A sleep moves no memory: the view is emptied, and no block follows.
    kc, km = kernel.client.kc, kernel.client.km
    msg_id = kc.execute("time.sleep(30)")
    found, interrupted_at = [], None
    started = time.monotonic()
    while True:
        msg = run_sync(kc.get_iopub_msg)(timeout=60)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        found.append(Message(time.monotonic() - started, msg["msg_type"], msg["content"]))
        if interrupted_at is None and msg["msg_type"] == "update_display_data":
            run_sync(km.interrupt_kernel)()
            interrupted_at = time.monotonic()
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    assert any(m.kind == "error" and m.content["ename"] == "KeyboardInterrupt" for m in found)
    last = live_views(found)[-1]
    assert last.kind == "update_display_data" and last.content["data"] == {"text/plain": ""}, found
    assert kernel.value("[t.name for t in threading.enumerate() if 'gpuexp' in t.name]") == ["gpuexp-live-view"]


def test_the_delay_is_a_setting_and_the_view_can_be_turned_off(kernel):
    kernel.run(SETUP)
    assert kernel.value("gpuexp.config()['live_view_after_s']") == 2.0
    default = messages(kernel, "time.sleep(2.6)\nk = bytearray(4 << 20)")
    assert live_views(default)[0].at >= 2.0, default
    kernel.run("gpuexp.config(live_view_after_s=None)")
    assert kernel.value("gpuexp.config()['live_view_after_s']") is None
    off = messages(kernel, "time.sleep(1.5)")
    assert not [m for m in off if m.display_id], off
    kernel.run("gpuexp.config(live_view_after_s=0.5)")
    assert len([m for m in messages(kernel, "time.sleep(1.2)") if m.display_id]) >= 2
    for bad in ("'2s'", "True", "-1"):
        failed = kernel.run(f"gpuexp.config(live_view_after_s={bad})", expect_error=True)
        assert "live_view_after_s" in failed.error, failed.error


def test_without_the_cell_log_a_long_cell_has_no_live_view(kernel):
    kernel.run("import time, gpuexp\ngpuexp.config(live_view_after_s=0.2)")
    assert not [m for m in messages(kernel, "time.sleep(1)") if m.display_id]
    kernel.run("exp = gpuexp.CPUExperiment('quiet', cell_log=False)")
    assert not [m for m in messages(kernel, "time.sleep(1)") if m.display_id]


def test_ipython_on_a_terminal_rewrites_one_line(tmp_path):
    """Terminal IPython (stdout a pseudo-terminal): the view is one line rewritten with \\r."""
    primary, secondary = pty.openpty()
    code = "time.sleep(2); kept = bytearray(8 << 20)"
    process = subprocess.Popen(
        [sys.executable, "-m", "IPython", "--no-banner", "--colors=nocolor", "--HistoryManager.enabled=False",
         "--InteractiveShellApp.exec_lines=['import time, gpuexp', '%gpuexp log on', "
         "'gpuexp.config(live_view_after_s=0.5);']", "-c", code],
        stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary, cwd=tmp_path,
        env=dict(os.environ, IPYTHONDIR=str(tmp_path), TERM="xterm", COLUMNS="100"),
    )
    os.close(secondary)
    output = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([primary], [], [], 1)
        if ready:
            try:
                chunk = os.read(primary, 4096)
            except OSError:
                break
            if not chunk:
                break
            output += chunk
        elif process.poll() is not None:
            break
    process.wait(10)
    os.close(primary)
    text = output.decode(errors="replace")
    drawings = re.findall(r"\r(gpuexp · \d+\.\d s · host RSS [^\r\n\x1b]*)\x1b\[K", text)
    assert len(drawings) >= 2, text
    assert all(len(d) <= 99 for d in drawings), drawings
    # The line is cleared and the block printed below it.
    assert "\r\x1b[Kgpuexp · cell [" in text and "+8." in text, text


def test_a_script_draws_no_live_view(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        "import threading, time, gpuexp\n"
        "exp = gpuexp.CPUExperiment('script')\n"
        "gpuexp.config(live_view_after_s=0.1)\n"
        "time.sleep(0.5)\n"
        "print([t.name for t in threading.enumerate() if 'gpuexp' in t.name])\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert "cell running" not in done.stdout


def test_the_finders_progress_is_one_output_in_jupyter_and_lines_in_a_script(kernel, tmp_path):
    """find_batch_size needs CUDA (test_gpu_views.py runs it); its progress is driven the same
    way here: an update per trial, then finish."""
    drive = ("from gpuexp.live import Progress\np = Progress()\n"
             "for n in (1, 2, 3):\n    p.update(f'trial {n}', f'<b>{n} trials</b>')\np.finish('done', '<b>done</b>')")
    found = [m for m in messages(kernel, drive) if m.display_id]
    assert [m.kind for m in found] == ["display_data"] + ["update_display_data"] * 3, found
    assert len({m.display_id for m in found}) == 1 and found[0].display_id.startswith("gpuexp-finder-")
    assert [m.text for m in found] == ["trial 1", "trial 2", "trial 3", "done"]
    script = tmp_path / "progress.py"
    script.write_text(drive)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines() == ["trial 1", "trial 2", "trial 3"], done.stdout + done.stderr
