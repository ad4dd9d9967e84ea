"""Issue 38, section 5, where it meets snapshots and printed tables: a UNIX socket given to
load_snapshot is named as one, an experiment's name never sends a terminal escape, and a
snapshot of 200,000 out-of-memory errors analyses a bounded number of them and counts the rest."""

import pickle
import socket

import pytest

from kernel import Kernel

OOMS = 200_000


def test_a_unix_socket_is_named_as_one(tmp_path):
    import gpuexp

    path = tmp_path / "snapshot.pickle"
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(path))
        with pytest.raises(ValueError) as refused:
            gpuexp.load_snapshot(str(path))
    assert f"{path} is a socket, not a regular file" in str(refused.value), refused.value
    assert "load_snapshot reads a snapshot file" in str(refused.value)
    assert "No such device or address" not in str(refused.value)


def test_an_experiments_name_is_printed_with_its_control_characters_escaped():
    """In text, where a terminal would act on them (HTML shows them as characters)."""
    kernel = Kernel()
    try:
        kernel.run("import gpuexp")
        opened = kernel.run("exp = gpuexp.GPUExperiment('\\x1b[31mx\\x07')")
        finished = kernel.run("report = exp.finish()\nprint(report)\nreport")
    finally:
        kernel.shutdown()
    for cell in (opened, finished):
        assert "\\x1b[31mx\\x07" in cell.text, cell.text
        assert "\x1b" not in cell.text and "\x07" not in cell.text, repr(cell.text)
    assert finished.text.count("\\x1b[31mx") >= 2, "the printed report and the shown one"


def many_ooms(path, count=OOMS):
    """A snapshot with one block live and `count` OOMs after it, as a loop that catches the
    error and retries makes."""
    frames = [{"filename": "/home/u/train.py", "line": 7, "name": "step"}]
    trace = [{"action": "alloc", "addr": 1 << 32, "size": 1 << 30, "stream": 0, "time_us": 1, "frames": frames}]
    trace += [{"action": "oom", "addr": 0, "size": 1 << 40, "stream": 0, "time_us": 2 + i, "device_free": 1 << 20,
               "frames": frames} for i in range(count)]
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [trace]}, protocol=4))
    return path


def test_200000_ooms_analyse_the_first_hundred_and_count_the_rest_in_a_note(tmp_path):
    """The bound of the work: each OOM analysed walks the blocks live then, so a file's count
    of them must not set the load's time (bench/load_snapshot_cost.py times it: under 2 s)."""
    import gpuexp

    trace = gpuexp.load_snapshot(str(many_ooms(tmp_path / "ooms.pickle")))
    [device] = trace.to_dict()
    analysed = device["ooms"]
    assert len(analysed) == 100, len(analysed)
    assert [oom["event"] for oom in analysed] == list(range(1, 101)), "the first ones, in order"
    assert analysed[0]["site"]["label"] == "/home/u/train.py:7"
    assert device["ooms_not_analysed"] == OOMS - 100
    note = f"{OOMS} out-of-memory errors in the trace: the first 100 are analysed"
    assert note in str(trace), str(trace)
    assert f"the other {OOMS - 100} only counted" in str(trace)


def test_a_few_ooms_are_all_analysed_with_no_note(tmp_path):
    import gpuexp

    trace = gpuexp.load_snapshot(str(many_ooms(tmp_path / "ooms.pickle", count=100)))
    [device] = trace.to_dict()
    assert (len(device["ooms"]), device["ooms_not_analysed"]) == (100, 0)
    assert "out-of-memory errors in the trace" not in str(trace)
