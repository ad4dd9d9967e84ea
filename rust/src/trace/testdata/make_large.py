"""Writes a large synthetic snapshot for the parse bench, shaped as torch writes them: each
frame dict shared by every stack that has it (so the pickle refers back to it), a new frames
list and event dict per event. About 100 bytes an event: 10.7 million events make 1 GiB.
Usage: python3 make_large.py EVENTS PATH"""

import pickle
import random
import sys

events, path = int(sys.argv[1]), sys.argv[2]
random.seed(1)
files = [f"/usr/lib/python3.11/site-packages/torch/nn/modules/m{i}.py" for i in range(30)]
files.append("/tmp/ipykernel_42/123.py")
frames = [{"filename": random.choice(files), "line": random.randint(1, 2000), "name": f"f{i}"} for i in range(400)]
stacks = [[random.choice(frames) for _ in range(12)] for _ in range(300)]
trace, live, time = [], [], 0


def event(action, addr, size, stack):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": time,
            "frames": list(stacks[stack]), "compile_context": "N/A", "user_metadata": ""}


while len(trace) < events:
    time += 3
    if live and random.random() < 0.45:
        addr, size, stack = live.pop(random.randrange(len(live)))
        trace.append(event("free_requested", addr, size, stack))
        trace.append(event("free_completed", addr, size, stack))
    else:
        block = (1 << 33 | len(trace) << 12, random.randint(1, 1 << 22), random.randrange(len(stacks)))
        live.append(block)
        trace.append(event("alloc", *block))
with open(path, "wb") as f:
    pickle.dump({"segments": [], "device_traces": [trace]}, f, protocol=4)
