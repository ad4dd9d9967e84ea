"""Writes snapshot_shared_frames_p0.pickle and _p4.pickle for the parse tests: frames lists
shared as torch shares them (one list per traceback: a block and its alloc and free_completed
events, the free more than a 1000-item batch after the alloc), a one-frame list, a list of 1500
frames (more than one batch) referred to again from a second device, an empty list and an
event dict appended twice. Protocol 0 sets and appends item by item; protocol 4 in
batches. Run from this folder: python3 make_shared_frames.py"""

import pickle

TORCH = {"name": "linear", "filename": "/usr/lib/python3.11/site-packages/torch/nn/functional.py", "line": 2000}
USER = {"name": "forward", "filename": "/home/u/train.py", "line": 14}
OTHER = {"name": "step", "filename": "/home/u/train.py", "line": 30}
shared = [TORCH, USER]
alone = [OTHER]
deep = [TORCH, USER] * 750


def event(action, addr, size, time_us, frames):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": time_us, "frames": frames}


first = event("alloc", 1 << 30, 1000, 1, shared)
filler = [event("alloc", (1 << 31) + 4096 * i, 512, 2 + i, [TORCH, OTHER]) for i in range(1500)]
trace = [first, *filler, event("free_requested", 1 << 30, 1000, 1600, alone),
         event("free_completed", 1 << 30, 1000, 1601, shared), first,
         event("alloc", 3 << 30, 512, 1602, deep), event("alloc", 4 << 30, 512, 1603, [])]
segments = [{"device": 0, "address": 1 << 30, "total_size": 2 << 20, "stream": 0, "segment_type": "small",
             "blocks": [{"address": 1 << 30, "size": 1024, "requested_size": 1000, "state": "active_allocated",
                         "frames": shared}]}]
snapshot = {"segments": segments, "device_traces": [trace, [event("alloc", 5 << 30, 64, 7, alone),
                                                          event("alloc", 6 << 30, 64, 8, deep)]]}
for protocol in (0, 4):
    with open(f"snapshot_shared_frames_p{protocol}.pickle", "wb") as f:
        pickle.dump(snapshot, f, protocol=protocol)
