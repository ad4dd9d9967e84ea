"""Files from elsewhere and files gpuexp writes (issue 30, sections 2 and 3): load_snapshot
refuses what is not a regular file without waiting on it, names compressed files, says when a
file holds no history, and stops at Ctrl-C, in the parse and in the analysis; every file
gpuexp writes goes through one atomic writer that never follows a planted link, keeps the mode
and leaves no temporary file."""

import gzip
import os
import pickle
import signal
import stat
import struct
import subprocess
import sys
import textwrap
import time

MiB = 1 << 20


def small_snapshot(tmp_path):
    frames = [{"filename": str(tmp_path / "train.py"), "line": 3, "name": "step"}]
    events = [{"action": "alloc", "addr": 1 << 32, "size": 8 * MiB, "stream": 0, "time_us": 1, "frames": frames}]
    return pickle.dumps({"segments": [], "device_traces": [events]}, protocol=4)


def test_a_fifo_a_device_and_a_compressed_file_are_refused_at_once_and_an_empty_one_says_so(kernel, tmp_path):
    fifo = tmp_path / "snapshot.pickle"
    os.mkfifo(fifo)
    gzipped = tmp_path / "snapshot.pickle.gz"
    gzipped.write_bytes(gzip.compress(small_snapshot(tmp_path)))
    empty = tmp_path / "cpu_only.pickle"
    empty.write_bytes(pickle.dumps({"segments": [], "device_traces": []}))
    kernel.run("import gpuexp, time")
    refused = kernel.run(f"started = time.monotonic()\ngpuexp.load_snapshot({str(fifo)!r})", expect_error=True)
    assert kernel.value("time.monotonic() - started") < 5, "no writer was waited for"
    assert refused.error.startswith("ValueError") and "is a FIFO (named pipe), not a regular file" in refused.error
    device = kernel.run("gpuexp.load_snapshot('/dev/zero')", expect_error=True).error
    assert "/dev/zero is a device, not a regular file" in device, device
    compressed = kernel.run(f"gpuexp.load_snapshot({str(gzipped)!r})", expect_error=True).error
    assert "gzip-compressed" in compressed and f"gunzip -k {gzipped}" in compressed, compressed
    assert "opcode" not in compressed
    kernel.run(f"trace = gpuexp.load_snapshot({str(empty)!r})")
    shown = kernel.run("trace")
    assert "cpu_only.pickle: this snapshot holds no allocation history" in shown.text, shown.text
    assert "no allocation history" in shown.html
    assert kernel.value("trace.to_dict()['devices']") == []
    assert "no allocation history" in kernel.value("trace.to_dict()['note']")


def test_impossible_sizes_are_refused_not_shown(kernel, tmp_path):
    huge = tmp_path / "huge.pickle"
    event = {"action": "alloc", "addr": 4096, "size": 2**64 - 1, "stream": 0, "time_us": 1, "frames": []}
    huge.write_bytes(pickle.dumps({"segments": [], "device_traces": [[event]]}))
    kernel.run("import gpuexp")
    error = kernel.run(f"gpuexp.load_snapshot({str(huge)!r})", expect_error=True).error
    assert "impossible size: size a number past 64 bits in event 0" in error, error


def test_save_snapshot_never_follows_a_planted_link_and_keeps_the_mode(kernel, tmp_path):
    source = tmp_path / "source.pickle"
    source.write_bytes(small_snapshot(tmp_path))
    shared = tmp_path / "shared"
    shared.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("the victim's")
    target = shared / "out.pickle"
    target.write_bytes(b"old")
    target.chmod(0o600)
    pid = kernel.value("__import__('os').getpid()")
    # The old writer's name (from the pid) and the other guessable ones, each a link to the victim.
    planted = [f".out.pickle.{pid}.tmp", ".out.pickle.tmp", "out.pickle.tmp", f"out.pickle.{pid}"]
    for name in planted:
        (shared / name).symlink_to(victim)
    kernel.run(f"import gpuexp\ntrace = gpuexp.load_snapshot({str(source)!r})\ntrace.save_snapshot({str(target)!r})")
    assert victim.read_text() == "the victim's"
    assert target.read_bytes() == source.read_bytes() and not target.is_symlink()
    assert stat.S_IMODE(target.stat().st_mode) == 0o600, "the file's mode is kept"
    assert sorted(p.name for p in shared.iterdir()) == sorted(planted + ["out.pickle"]), "no temporary file is left"


def test_python_writers_go_through_the_core_and_a_failure_leaves_the_old_file_alone(kernel, tmp_path):
    history = tmp_path / "history.json"
    history.write_text("old")
    history.chmod(0o600)
    kernel.run("import gpuexp\nexp = gpuexp.CPUExperiment('one', cell_log=False)\nexp.finish()")
    kernel.run(f"gpuexp.save_history({str(history)!r})")
    assert history.read_text().startswith("[") and stat.S_IMODE(history.stat().st_mode) == 0o600
    figure = tmp_path / "figure.png"
    figure.write_bytes(b"old figure")
    failed = kernel.run(
        "from gpuexp import files\n"
        "def half_then_fail(out):\n"
        "    out.write(b'half a figure')\n"
        "    raise RuntimeError('the drawing failed')\n"
        f"files.write_atomically({str(figure)!r}, half_then_fail)",
        expect_error=True,
    )
    assert "the drawing failed" in failed.error
    assert figure.read_bytes() == b"old figure"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figure.png", "history.json"], "no temporary file"
    new = tmp_path / "new.json"
    kernel.run(f"gpuexp.save_history({str(new)!r})")
    plain = tmp_path / "plain"
    plain.touch()
    assert stat.S_IMODE(new.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode), "a new file: the umask's mode"


def large_snapshot(path, events):
    """A snapshot of `events` events written as Python's pickler writes them (protocol 2,
    batches of 1000), in a second: the same event's bytes repeated, each a new dict."""
    def text(s):
        return b"X" + struct.pack("<I", len(s)) + s.encode()

    def event(addr):
        fields = [("action", text("alloc")), ("addr", b"\x8a\x08" + struct.pack("<q", addr)),
                  ("size", b"J" + struct.pack("<i", 512)), ("stream", b"J\x00\x00\x00\x00"),
                  ("time_us", b"J\x00\x00\x00\x00"), ("frames", b"]")]
        return b"}(" + b"".join(text(k) + v for k, v in fields) + b"u"

    batch = b"(" + b"".join(event((1 << 40) + i * 512) for i in range(1000)) + b"e"
    with open(path, "wb") as out:
        out.write(b"\x80\x02}(" + text("segments") + b"]" + text("device_traces") + b"](]")
        for _ in range(events // 1000):
            out.write(batch)
        out.write(b"eu.")


def test_ctrl_c_stops_a_large_load_within_a_second(tmp_path):
    path = tmp_path / "large.pickle"
    large_snapshot(path, 3_000_000)
    script = textwrap.dedent(f"""
        import os, signal, threading, time
        import gpuexp
        sent = []
        def interrupt():
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)
        started = time.monotonic()
        threading.Timer(0.5, interrupt).start()
        try:
            gpuexp.load_snapshot({str(path)!r})
            print("loaded in", time.monotonic() - started)
        except KeyboardInterrupt:
            print("interrupted after", time.monotonic() - sent[0])
    """)
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith("interrupted after"), ran.stdout + ran.stderr
    assert float(ran.stdout.split()[-1]) < 1.5, ran.stdout


def test_ctrl_c_stops_the_analysis_after_the_parse_within_a_second(tmp_path):
    """A 4 MiB file parsed in milliseconds whose analysis takes seconds with the GIL held:
    each OOM event's live set is every block allocated before it. The signal comes from
    outside, as the stop button's does: a thread of the process would wait for the GIL."""
    def event(action, addr):
        return {"action": action, "addr": addr, "size": 512, "stream": 0, "time_us": 0, "frames": []}

    trace = [event("alloc", (1 << 40) + i * 512) for i in range(100_000)]
    trace += [event("oom", 1 << 50)] * 1000
    path = tmp_path / "ooms.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [trace]}, protocol=2))
    script = textwrap.dedent(f"""
        import time
        import gpuexp
        print("loading", flush=True)
        try:
            gpuexp.load_snapshot({str(path)!r})
            print("loaded")
        except KeyboardInterrupt:
            print("interrupted at", time.time())
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "loading\n"
    time.sleep(0.5)
    sent = time.time()
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=300)
    assert out.startswith("interrupted at"), out + err
    assert float(out.split()[-1]) - sent < 1.5, out


def test_an_interrupt_while_a_line_is_named_is_raised_not_dropped(tmp_path):
    path = tmp_path / "small.pickle"
    path.write_bytes(small_snapshot(tmp_path))
    script = textwrap.dedent(f"""
        import gpuexp, gpuexp.ipython
        def interrupted(filename, line):
            raise KeyboardInterrupt
        gpuexp.ipython.source_line = interrupted
        try:
            gpuexp.load_snapshot({str(path)!r})
            print("dropped")
        except KeyboardInterrupt:
            print("raised")
    """)
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert ran.stdout.strip() == "raised", ran.stdout + ran.stderr



def test_control_characters_in_a_files_filenames_are_escaped_in_its_text(tmp_path):
    """A file from elsewhere can't send the terminal escapes: str(trace) shows them as `\\x1b`."""
    frames = [{"filename": "/home/u/\x1b[31mtrain.py", "line": 3, "name": "step\x07"}]
    trace = [{"action": "alloc", "addr": 1 << 40, "size": 512, "stream": 0, "time_us": 0, "frames": frames}]
    path = tmp_path / "escapes.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [trace]}, protocol=4))
    import gpuexp

    text = str(gpuexp.load_snapshot(str(path)))
    assert "\\x1b[31mtrain.py" in text, text
    assert not any(ord(c) < 32 and c not in "\n\t" for c in text), repr(text)
