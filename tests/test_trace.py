"""Where in the code, on the CPU: torch snapshots written by a scripted program whose allocations
are known (sizes and lines), read by `gpuexp.load_snapshot` in a real kernel. The GPU side
(`trace=True` on real training) is tests/test_gpu_trace.py."""

import pickle

import pytest

from conftest import GPU

MiB = 1 << 20

# The scripted program: each line allocates a known size per sample; a batch's blocks are all
# alive at its peak, then freed.
PROGRAM = """\
def step(bs):
    params = alloc(64 * MiB)
    activations = alloc(bs * 4 * MiB)
    scores = alloc(bs * bs * MiB)
    logits = alloc(bs * 2 * MiB)
"""
LINES = {"params": (2, lambda bs: 64 * MiB), "activations": (3, lambda bs: bs * 4 * MiB),
         "scores": (4, lambda bs: bs * bs * MiB), "logits": (5, lambda bs: bs * 2 * MiB)}
TORCH_FRAME = {"filename": "/opt/venv/lib/python3.12/site-packages/torch/nn/functional.py", "line": 10, "name": "x"}


def scripted_snapshot(program, bs):
    """torch's snapshot shape for one step at batch size `bs`: allocations in line order, all freed."""
    events, address, time_us = [], 1 << 32, 1_000
    blocks = []
    for line, size in LINES.values():
        frames = [dict(TORCH_FRAME), {"filename": str(program), "line": line, "name": "step"}]
        events.append({"action": "alloc", "addr": address, "size": size(bs), "stream": 0, "time_us": time_us,
                       "frames": frames})
        blocks.append((address, size(bs), frames))
        address += size(bs)
        time_us += 1
    for address, size, frames in reversed(blocks):
        events.append({"action": "free_requested", "addr": address, "size": size, "stream": 0, "time_us": time_us,
                       "frames": frames})
        time_us += 1
    return {"segments": [], "device_traces": [events]}


@pytest.fixture
def snapshots(tmp_path):
    program = tmp_path / "train.py"
    program.write_text(PROGRAM)
    paths = {}
    for bs in (8, 16):
        paths[bs] = tmp_path / f"bs{bs}.pickle"
        paths[bs].write_bytes(pickle.dumps(scripted_snapshot(program, bs), protocol=4))
    return paths


def test_a_loaded_snapshot_gives_the_peak_by_source_line_exactly(kernel, snapshots):
    kernel.run(f"import gpuexp\ntrace = gpuexp.load_snapshot({str(snapshots[8])!r})")
    shown = kernel.run("trace")
    (device,) = kernel.value("trace.to_dict()")
    sites = {row["source"]: row["bytes"] for row in device["peak"]["sites"]}
    for name, (_, size) in LINES.items():
        line = PROGRAM.splitlines()[LINES[name][0] - 1].strip()
        assert sites[line] == size(8), (name, sites)
    assert device["peak"]["peak"]["bytes"] == sum(size(8) for _, size in LINES.values())
    assert "train.py:4" in shown.text and "scores = alloc(bs * bs * MiB)" in shown.text
    assert "<details>" in shown.html, "each site's stack is collapsible"


def test_the_diff_attributes_the_growth_to_the_lines_that_grew(kernel, snapshots):
    kernel.run(f"import gpuexp\na = gpuexp.load_snapshot({str(snapshots[8])!r})\n"
               f"b = gpuexp.load_snapshot({str(snapshots[16])!r})")
    diff = kernel.value("b.diff(a).to_dict()")
    rows = {row["source"]: row for row in diff["rows"]}
    scores = rows["scores = alloc(bs * bs * MiB)"]
    assert scores["bytes_b"] - scores["bytes_a"] == (16 * 16 - 8 * 8) * MiB
    assert rows["params = alloc(64 * MiB)"]["bytes_b"] == rows["params = alloc(64 * MiB)"]["bytes_a"]
    ordered = [row["source"] for row in diff["rows"]]
    assert ordered[0] == "scores = alloc(bs * bs * MiB)", "sorted by growth"
    assert "+192.00 MiB" in kernel.run("b.diff(a)").text


def test_save_snapshot_writes_torch_s_pickle_back_and_the_timeline_draws_offline(kernel, snapshots, tmp_path):
    out = tmp_path / "again.pickle"
    kernel.run(f"import gpuexp\ntrace = gpuexp.load_snapshot({str(snapshots[16])!r})\n"
               f"trace.save_snapshot({str(out)!r})")
    assert out.read_bytes() == snapshots[16].read_bytes()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "no temporary file is left"
    html = kernel.run("trace.plot_timeline()").html
    assert "<svg" in html and "<script" not in html and "http" not in html.replace("http://www.w3.org", "")
    assert kernel.value("type(trace.plot_timeline().figure()).__name__") == "Figure"


def test_bad_files_and_arguments_get_errors_that_name_the_fix(kernel, tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("not a pickle")
    kernel.run("import gpuexp")
    assert "not a torch memory snapshot" in kernel.run(f"gpuexp.load_snapshot({str(bad)!r})", expect_error=True).error
    missing = kernel.run(f"gpuexp.load_snapshot({str(tmp_path / 'none.pickle')!r})", expect_error=True).error
    assert "none.pickle" in missing
    assert "file's path" in kernel.run("gpuexp.load_snapshot(3)", expect_error=True).error


def test_trace_is_a_setting_and_a_report_without_one_says_how_to_get_it(kernel):
    kernel.run("import gpuexp")
    assert kernel.value("gpuexp.config(trace=True)['trace']") is True
    assert kernel.value("gpuexp.config(trace=False)['trace']") is False
    assert "True or False" in kernel.run("gpuexp.config(trace='yes')", expect_error=True).error
    kernel.run("exp = gpuexp.CPUExperiment('plain')\nexp.finish()")
    assert kernel.value("exp.data.trace is None")
    error = kernel.run("exp.data.diff(exp.data)", expect_error=True).error
    assert "trace=True" in error


def test_the_cell_log_with_the_trace_on_and_no_cuda_shows_what_it_showed_with_it_off(kernel):
    kernel.run("import torch, gpuexp\n%gpuexp log on")
    off = kernel.run("a = bytearray(64 << 20)")
    kernel.run("gpuexp.config(trace=True)")
    on = kernel.run("b = bytearray(64 << 20)")
    for shown in (off, on):
        assert "host RSS" in shown.text and "% at" not in shown.text, shown.text
    assert kernel.value("[sorted(c.to_dict()) for c in gpuexp.cells()[-3:]]") == [
        kernel.value("sorted(gpuexp.cells()[-3].to_dict())")] * 3, "no key added: the record is as before"
    assert kernel.value("any('peak_sites' in c.to_dict() for c in gpuexp.cells())") is False
    assert kernel.value("torch.cuda.is_initialized()") is False, "the log created no CUDA context to trace"


@pytest.mark.skipif(GPU, reason="checks a machine where torch sees no CUDA GPU")
def test_trace_true_without_cuda_points_at_the_host_trace(kernel):
    kernel.run("import torch, gpuexp")
    finished = kernel.run("exp = gpuexp.GPUExperiment('t', trace=True)\nexp.finish()")
    said = "trace=True records torch's CUDA allocations, and torch sees no CUDA GPU: trace=\"host\" traces the host's"
    assert said in finished.text, finished.text
