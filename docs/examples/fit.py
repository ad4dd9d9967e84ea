"""Prints the `gpuexp.fit()` tables the docs show (docs/captures/fit-*.txt): lm.py's transformer
LM at batch size 32, after one real step at 16, against a limit 40% below its predicted peak (so
that it does not fit as it is), with what would make it fit.

    python docs/examples/fit.py cuda   # on a machine with a GPU; verify=True checks the best option
    python docs/examples/fit.py cpu    # anywhere: predicted only
"""

import sys

from lm import build, train_step

import gpuexp

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
layer, model, optimizer = build(device)
train_step(model, optimizer, 16, device)


def step(batch_size):
    train_step(model, optimizer, batch_size, device)


estimated = gpuexp.estimate(step, 32)
limit = estimated.to_dict()["now"] + int(estimated.peak * 0.6)
print(gpuexp.fit(step, 32, limit=limit, verify=device == "cuda"))
