"""Two or more NCCL ranks, each on its own GPU, spawned from one process as a notebook does:
prints the gathered per-rank table and each rank's explain() after its first collective, for
bench/RESULTS.md. Needs a machine with two or more GPUs.

    python3 bench/nccl_ranks.py [--ranks N]   (default: every visible GPU)
"""

import argparse
import datetime
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gpuexp


def rank_main(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    with gpuexp.GPUExperiment("ddp step"):
        torch.cuda.set_device(rank)
        model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()
        gpuexp.snapshot()  # a reading before NCCL's communicator exists
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
        opt = torch.optim.AdamW(ddp.parameters())
        batch = 64 * (rank + 1)  # rank r takes (r + 1) times rank 0's batch
        for _ in range(3):
            ddp(torch.randn(batch, 4096, device="cuda")).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        with open(os.path.join(out, f"explain-{rank}.txt"), "w") as f:
            f.write(str(gpuexp.explain()))
        dist.barrier()
        del ddp, model, opt
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    world = parser.parse_args().ranks
    if world < 2:
        sys.exit("needs two or more GPUs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        os.environ.setdefault("GPUEXP_RANKS_STORE", f"file://{out}")  # ranks publish here
        print(f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, {world} ranks")
        mp.start_processes(rank_main, args=(world, port, out), nprocs=world, start_method="spawn")
        print(gpuexp.ranks("ddp step", timeout=60))
        for rank in range(world):
            with open(os.path.join(out, f"explain-{rank}.txt")) as f:
                print(f"rank {rank}:\n{f.read()}")


if __name__ == "__main__":
    main()
