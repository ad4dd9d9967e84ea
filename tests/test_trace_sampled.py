"""Sampled stacks on the CPU: a snapshot gpuexp saved from a traced experiment whose second
step was recorded without stacks (the `gpuexp` key's `steps`) replays exactly, gives that step's
blocks the sampled step's lines, puts what no sampled step made in an unattributed row, and says
so; and the setting that keeps stacks on every step. The GPU side (a real training loop) is in
tests/test_gpu_trace.py."""

import pickle

import gpuexp

MiB = 1 << 20
X, Y, NEW = 4 * MiB, 8 * MiB, 2 * MiB


def frames(line):
    return [{"filename": "/home/u/train.py", "line": line, "name": "step"}]


def event(action, addr, size, time_us, line=None):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": time_us,
            "frames": frames(line) if line else []}


def alloc_free(sized, time_us, lines):
    """Allocates each (addr, size) in turn (with its line's stack, or none), then frees them."""
    events = [event("alloc", addr, size, time_us + n, line) for n, ((addr, size), line) in enumerate(zip(sized, lines))]
    for n, (addr, size) in enumerate(reversed(sized)):
        events += [event("free_requested", addr, size, time_us + 50 + 2 * n),
                   event("free_completed", addr, size, time_us + 51 + 2 * n)]
    return events


def sampled_snapshot():
    """One 32 MiB segment made in the trace; step 1 with stacks (lines 10 and 14), step 2 without
    any, making the same blocks and one of a size step 1 never made."""
    events = [event("segment_alloc", 0, 32 * MiB, 100)]
    events += alloc_free([(0, X), (X, Y)], 200, [10, 14])
    events += alloc_free([(0, X), (X, Y), (X + Y, NEW)], 400, [None, None, None])
    data = {"segments": [], "device_traces": [events]}
    data["gpuexp"] = {
        "window": {"opened_us": 95, "max_entries": 1000, "peaks": [{"device": 0, "max_memory_allocated": X + Y + NEW}]},
        "steps": [{"time_us": 95, "recorded": "stacks"}, {"time_us": 300, "recorded": "events"}],
    }
    return data


def test_a_step_without_stacks_takes_the_sampled_steps_lines_and_the_peak_stays_exact(tmp_path):
    path = tmp_path / "sampled.pickle"
    path.write_bytes(pickle.dumps(sampled_snapshot(), protocol=4))
    trace = gpuexp.load_snapshot(str(path))
    (device,) = trace.to_dict()
    peak = device["peak"]
    assert peak["peak"]["bytes"] == X + Y + NEW == peak["true_peak"]
    assert sum(row["bytes"] for row in peak["sites"]) + peak["rest"]["bytes"] == peak["peak"]["bytes"]
    rows = {row["label"]: row["bytes"] for row in peak["sites"]}
    assert rows["/home/u/train.py:10"] == X and rows["/home/u/train.py:14"] == Y, rows
    assert rows["(unattributed: made in a step recorded without stacks)"] == NEW, rows
    sampling = peak["sampling"]
    assert (sampling["steps"], sampling["with_stacks"]) == (2, 1)
    assert (sampling["direct_bytes"], sampling["mapped_bytes"], sampling["unattributed_bytes"]) == (0, X + Y, NEW)
    assert sampling["sites_from_steps"] == [1]
    text = str(trace)
    assert "attribution sampled: Python stacks on 1 of 2 steps" in text, text
    assert "12.00 MiB mapped from step 1" in text, text
    assert "attribution sampled" in trace._repr_html_()


def test_a_file_without_gpuexps_steps_says_nothing_of_sampling(tmp_path):
    data = sampled_snapshot()
    del data["gpuexp"]["steps"]
    path = tmp_path / "plain.pickle"
    path.write_bytes(pickle.dumps(data, protocol=4))
    trace = gpuexp.load_snapshot(str(path))
    (device,) = trace.to_dict()
    assert "sampling" not in device["peak"]
    assert "attribution" not in str(trace)


def test_trace_sampling_is_a_setting_that_keeps_stacks_on_every_step_when_off(kernel):
    kernel.run("import gpuexp")
    assert kernel.value("gpuexp.config()['trace_sampling']") is True
    assert kernel.value("gpuexp.config(trace_sampling=False)['trace_sampling']") is False
    assert kernel.value("gpuexp.config()['trace_sampling']") is False
    failed = kernel.run("gpuexp.config(trace_sampling='full')", expect_error=True)
    assert "trace_sampling is True or False" in failed.error, failed.error
    assert kernel.value("gpuexp.config(trace_sampling=True)['trace_sampling']") is True
