"""Makes docs/monitor-gpu.png, the monitor page's timeline: a few seconds of training under gpuexp.Monitor.

    python docs/examples/monitor_plot.py docs/monitor-gpu.png      # on a machine with a GPU and torch
"""

import sys
import time

import torch

import gpuexp


def train(seconds, batch):
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()
    opt = torch.optim.AdamW(model.parameters())
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        model(torch.randn(batch, 4096, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def main(path):
    torch.ones(1, device="cuda")
    with gpuexp.Monitor("50ms") as mon:
        time.sleep(0.5)
        train(2.0, batch=1024)
        time.sleep(0.5)
        train(2.0, batch=8192)  # a larger batch: more activations, the process's memory steps up
        torch.cuda.empty_cache()
        time.sleep(0.5)
    mon.plot(path, title=f"gpuexp monitor · {torch.cuda.get_device_name(0)}: an MLP trained at batch 1024, then 8192")
    print(f"{len(mon.samples())} samples -> {path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/monitor-gpu.png")
