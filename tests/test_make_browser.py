"""`make test`'s browser step as root on a fresh machine (issue 38, section 6): apt's output goes
to a log, and the console shows a heading and a one-line summary, or the log where apt failed.
apt-get and id are stand-ins on PATH here; the recipe is the Makefile's own."""

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = 26


def fake_machine(tmp_path, apt_fails):
    """A PATH with no chromedriver, an `id` that says root, and an apt-get that talks as much as
    Debian's does (a Get line and a Setting up line per package)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("mkdir", "dirname", "grep", "cat", "readlink", "sh"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    scripts = {
        "id": "echo 0",
        "update-alternatives": f'echo "$@" >> {tmp_path / "alternatives"}',
        "apt-get": "\n".join([
            'if [ "$1" = update ]; then exit 0; fi',
            f"for i in $(seq 1 {PACKAGES}); do echo \"Get:$i http://deb.debian.org pkg$i\"; done",
            "echo 'E: Unable to fetch some archives' >&2; exit 100" if apt_fails else
            f"for i in $(seq 1 {PACKAGES}); do echo \"Setting up pkg$i (1.0) ...\"; done",
        ]),
    }
    os.symlink(shutil.which("seq"), bin_dir / "seq")
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def make_browser(tmp_path, apt_fails):
    bin_dir = fake_machine(tmp_path, apt_fails)
    log = tmp_path / "apt.log"
    done = subprocess.run(
        [shutil.which("make"), "-s", "-C", str(ROOT), "browser", f"PATH={bin_dir}", f"APT_LOG={log}"],
        capture_output=True, text=True, timeout=60,
    )
    return done, log


def test_apt_output_goes_to_a_log_behind_a_heading_and_a_summary(tmp_path):
    done, log = make_browser(tmp_path, apt_fails=False)
    assert done.returncode == 0, done.stdout + done.stderr
    shown = (done.stdout + done.stderr).splitlines()
    assert len(shown) == 2, shown
    assert shown[0].startswith("make test: installing Chromium and chromedriver with apt") and str(log) in shown[0]
    assert shown[1] == f"make test: apt installed {PACKAGES} packages", shown
    assert log.read_text().count("Setting up ") == PACKAGES, "the whole of apt's output is in the log"


def test_a_failed_apt_shows_its_log_and_fails_the_step(tmp_path):
    done, log = make_browser(tmp_path, apt_fails=True)
    shown = done.stdout + done.stderr
    assert done.returncode != 0, shown
    assert "make test: apt failed (status 100)" in shown and "E: Unable to fetch some archives" in shown, shown
    assert shown.count("Get:") == PACKAGES, "the log is shown whole"
    assert not (tmp_path / "alternatives").exists(), "the default browser is left alone when nothing was installed"
