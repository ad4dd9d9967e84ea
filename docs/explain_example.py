"""Prints the README's `gpuexp.explain()` tables: a transformer LM (nn.TransformerEncoder,
4 layers, d_model 512, an 8192-token vocabulary) trained one step with AdamW, and a 256 MiB
tensor held in a list.

    python docs/explain_example.py cuda   # on a machine with a GPU and torch
    python docs/explain_example.py cpu
"""

import sys

import torch

import gpuexp

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
layer = torch.nn.TransformerEncoderLayer(512, 8, batch_first=True)
model = torch.nn.Sequential(
    torch.nn.Embedding(8192, 512), torch.nn.TransformerEncoder(layer, 4), torch.nn.Linear(512, 8192)
).to(device)
optimizer = torch.optim.AdamW(model.parameters())
tokens = torch.randint(0, 8192, (16, 256), device=device)
loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
loss.backward()
optimizer.step()
optimizer.zero_grad(set_to_none=True)
cache = [torch.empty(64, 1024, 1024, device=device)]
print(gpuexp.explain(device))
