"""Writes the snapshot fixtures of rust/src/trace/tests: torch's snapshot shape, pickled by
Python itself (protocols 2, 4 and 5), with fields this reader ignores, a None where torch
writes one, frame dicts shared among stacks (as torch shares them) and an object the reader
must not run. Run from this folder: python3 make_snapshots.py"""

import collections
import pickle

FILE = "/home/u/train.py"
TORCH = {"filename": "/usr/lib/python3.11/site-packages/torch/nn/functional.py", "line": 2000, "name": "linear"}
BASE = 1 << 30


USER_FRAMES = {}


def frames(line):
    user = USER_FRAMES.setdefault(line, {"filename": FILE, "line": line, "name": "forward"})
    return [TORCH, user]


def event(action, addr, size, time_us, line, **more):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": time_us, "frames": frames(line), **more}


traces = [[
    event("segment_alloc", BASE, 2 << 20, 10, 14),
    event("alloc", BASE, 1000, 11, 14, compile_context="N/A", user_metadata=""),
    event("alloc", BASE + 1024, 4096, 12, 15, user_metadata="model.layers.3.attn"),
    event("free_requested", BASE, 1000, 13, 14),
    event("free_completed", BASE, 1000, 14, 14),
    event("oom", 0, 1 << 40, 15, 16, device_free=123),
    {"action": "some_future_action", "addr": 5, "size": 6, "stream": None, "time_us": 16, "frames": []},
]]
segments = [{
    "device": 0, "address": BASE, "total_size": 2 << 20, "allocated_size": 4096, "active_size": 4096,
    "requested_size": 4096, "stream": 0, "segment_type": "small", "segment_pool_id": (0, 0),
    "is_expandable": False, "frames": frames(14),
    "blocks": [
        {"address": BASE, "size": 1024, "requested_size": 1000, "state": "inactive", "frames": []},
        {"address": BASE + 1024, "size": 4096, "requested_size": 4096, "state": "active_allocated", "frames": frames(15)},
        {"address": BASE + 5120, "size": (2 << 20) - 5120, "requested_size": 0, "state": "inactive"},
    ],
}]
snapshot = {"segments": segments, "device_traces": traces, "allocator_settings": collections.OrderedDict(conf=None),
            "external_annotations": []}
for protocol in (2, 4, 5):
    with open(f"snapshot_p{protocol}.pickle", "wb") as f:
        f.write(pickle.dumps(snapshot, protocol=protocol))

# The same events with `action` last: read all the same, only later.
reordered = dict(snapshot, device_traces=[[dict(reversed(list(e.items()))) for e in traces[0]]])
with open("snapshot_reordered.pickle", "wb") as f:
    f.write(pickle.dumps(reordered, protocol=4))
