"""Exact peaks from snapshot files on the CPU: a file gpuexp saved carries the allocator's state
when the recording began and torch's own peak (under the key `gpuexp`), so blocks from before
the recording replay at their true size; a file without them gets the bound of its error in
bytes. The GPU side is tests/test_gpu_trace_exact.py."""

import pickle

import gpuexp

MiB = 1 << 20
OLD_REQUESTED, OLD_BLOCK = 2_700_000, 3 * MiB + MiB // 2  # cut whole from a free block
NEW_REQUESTED, NEW_BLOCK = 15 * MiB + MiB // 2, 16 * MiB + MiB // 2
FRAMES = [{"filename": "/home/u/train.py", "line": 7, "name": "step"}]


def event(action, addr, size, time_us):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": time_us, "frames": FRAMES}


def snapshot(with_gpuexp_key):
    """A 20 MiB segment holding a block from before the recording and a free rest; the trace
    allocates the rest whole, frees the old block, then the new one."""
    events = [event("alloc", OLD_BLOCK, NEW_REQUESTED, 100), event("free_requested", 0, OLD_REQUESTED, 110),
              event("free_completed", 0, OLD_REQUESTED, 111), event("free_requested", OLD_BLOCK, NEW_REQUESTED, 120),
              event("free_completed", OLD_BLOCK, NEW_REQUESTED, 121)]
    segment = {"device": 0, "address": 0, "total_size": 20 * MiB, "stream": 0, "segment_type": "large",
               "blocks": [{"address": 0, "size": 20 * MiB, "requested_size": 0, "state": "inactive", "frames": []}]}
    data = {"segments": [segment], "device_traces": [events]}
    if with_gpuexp_key:
        at_start = dict(segment, blocks=[
            {"address": 0, "size": OLD_BLOCK, "requested_size": OLD_REQUESTED, "state": "active_allocated",
             "frames": []},
            {"address": OLD_BLOCK, "size": NEW_BLOCK, "requested_size": 0, "state": "inactive", "frames": []}])
        data["gpuexp"] = {"opening": {"time_us": 90, "max_entries": 1000, "segments": [at_start]},
                          "window": {"opened_us": 95, "max_entries": 1000,
                                     "peaks": [{"device": 0, "max_memory_allocated": OLD_BLOCK + NEW_BLOCK}]}}
    return data


def test_a_file_gpuexp_saved_replays_blocks_from_before_the_recording_at_their_true_size(tmp_path):
    path = tmp_path / "saved.pickle"
    path.write_bytes(pickle.dumps(snapshot(True), protocol=4))
    (device,) = gpuexp.load_snapshot(str(path)).to_dict()
    peak = device["peak"]
    assert peak["peak"]["bytes"] == OLD_BLOCK + NEW_BLOCK == peak["true_peak"]
    assert sum(row["bytes"] for row in peak["sites"]) + peak["rest"]["bytes"] == peak["peak"]["bytes"]
    assert "bounds" not in peak, peak.get("bounds")
    assert peak["completeness"]["sized_from_opening"] == 1 and peak["completeness"]["inferred_sizes"] == 0


def test_a_file_from_elsewhere_gives_the_bound_of_its_error_in_bytes_and_the_truth_lies_within(tmp_path):
    path = tmp_path / "torch.pickle"
    path.write_bytes(pickle.dumps(snapshot(False), protocol=4))
    trace = gpuexp.load_snapshot(str(path))
    (device,) = trace.to_dict()
    peak, truth = device["peak"], OLD_BLOCK + NEW_BLOCK
    assert peak["peak"]["bytes"] < truth, "sizes inferred from the requests fall short here"
    assert peak["bounds"]["at_least"] <= truth <= peak["bounds"]["at_most"], peak["bounds"]
    assert "the true peak lies between" in str(trace), str(trace)
