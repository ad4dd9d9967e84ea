"""Prints the `gpuexp.estimate()` table the docs show (docs/captures/estimate-*.txt): one
training step of lm.py's transformer LM at batch size 32, estimated under fake tensors after one
real step at batch size 16 (so the optimizer's state exists, as in a notebook mid-tuning).

    python docs/examples/estimate.py cuda   # on a machine with a GPU: against a 24 GiB card
    python docs/examples/estimate.py cpu    # anywhere: against 4 GiB of host memory
"""

import sys

from lm import build, train_step

import gpuexp

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
layer, model, optimizer = build(device)
train_step(model, optimizer, 16, device)
print(gpuexp.estimate(lambda batch_size: train_step(model, optimizer, batch_size, device), 32,
                      limit="24GiB" if device == "cuda" else "4GiB"))
