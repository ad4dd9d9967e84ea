"""Prints the `gpuexp.explain()` table the docs show (docs/captures/explain-*.txt): the
transformer LM of lm.py trained one step with AdamW, and a 256 MiB tensor held in a list.

    python docs/examples/explain.py cuda   # on a machine with a GPU and torch
    python docs/examples/explain.py cpu
"""

import sys

import torch
from lm import build, train_step

import gpuexp

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
layer, model, optimizer = build(device)
tokens, loss = train_step(model, optimizer, 16, device)
cache = [torch.empty(64, 1024, 1024, device=device)]
print(gpuexp.explain(device))
