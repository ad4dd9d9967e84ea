"""NCCL ranks launched from a real kernel, each rank on its own GPU (`pytest -m gpu` on a machine
with two or more GPUs; the code takes any number). Ranks are spawned with
torch.multiprocessing, or forked by accelerate's notebook_launcher, as users do in notebooks."""

import json

import pytest

from conftest import GPU_UUIDS, load_rank_code

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(len(GPU_UUIDS) < 2, reason="needs two GPUs")]

GiB = 1 << 30

RANK_CODE = '''
import datetime, json, os, socket, sys, time
import torch
import torch.distributed as dist
import gpuexp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank, world, port, timeout=120):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout))


def own(rank, world, port, out):
    """Each rank opens an experiment before it touches CUDA (so nothing but its rank says which GPU
    is its own), holds (rank + 1) GiB there, runs its group's first collective and explains."""
    join(rank, world, port)
    with gpuexp.GPUExperiment("own") as exp:
        torch.cuda.set_device(rank)
        x = torch.ones(1 << 20, device="cuda")
        gpuexp.snapshot()  # a reading before NCCL's communicator exists
        held = torch.empty((rank + 1) << 30, dtype=torch.uint8, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        explained = gpuexp.explain()
        dist.barrier()
        del held, x
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"report": exp.data.to_dict(), "explain": explained.to_dict(), "table": str(explained)}, f)
    dist.destroy_process_group()


def oom(rank, world, port):
    """Rank 1 asks for more than its GPU has, inside its experiment."""
    join(rank, world, port)
    torch.cuda.set_device(rank)
    with gpuexp.GPUExperiment("oom"):
        x = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(x)
        if rank == 1:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    dist.destroy_process_group()


def hang(rank, world, port):
    """Rank 1 waits in a collective that rank 0 never joins: its experiment never finishes."""
    join(rank, world, port, timeout=300)
    torch.cuda.set_device(rank)
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    with gpuexp.GPUExperiment("hang"):
        if rank == 1:
            dist.all_reduce(x)
            torch.cuda.synchronize()
    time.sleep(600)


def find(rank, world, port, out):
    """Each rank rehearses a card of its own size on its own GPU; all must agree on one size."""
    join(rank, world, port)
    torch.cuda.set_device(rank)
    def step(bs):
        x = torch.empty(bs, 1 << 20, device="cuda")  # 4 MiB per sample
        (x * 2).sum()
    result = gpuexp.find_batch_size(step, start=8, max=4096, limit=f"{4 + 4 * rank}GiB", progress=False)
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"agreed": result.batch_size,
                   "answers": result.to_dict()["ranks"]["answers"]}, f)
    dist.destroy_process_group()
'''


@pytest.fixture
def kernel_with_ranks(kernel, tmp_path):
    return load_rank_code(kernel, tmp_path, RANK_CODE)


def test_each_nccl_rank_reports_its_own_gpu_and_explains_nccl(kernel_with_ranks, tmp_path):
    kernel = kernel_with_ranks
    out = str(tmp_path / "out")
    kernel.run('launch = gpuexp.GPUExperiment("launch")')
    cell = kernel.run(f"mp.start_processes(rank_code.own, args=(2, rank_code.free_port(), {out!r}), nprocs=2, "
                      "start_method='spawn')")
    assert cell.error is None, cell
    kernel.run("gathered = gpuexp.ranks('own', timeout=60)")
    rows = kernel.value("gathered.to_dict()['rows']")
    assert [r["torch_allocated_peak"] >= (rank + 1) * GiB for rank, r in enumerate(rows)] == [True, True], rows
    assert rows[0]["gpu"].startswith("cuda:0 = NVML ") and rows[1]["gpu"].startswith("cuda:1 = NVML "), rows
    for rank in range(2):
        result = json.loads((tmp_path / "out" / f"{rank}.json").read_text())
        gpus = result["report"]["gpus"]
        assert [g["torch_index"] for g in gpus] == [rank], "a rank covers its own GPU only"
        assert any(f"covers cuda:{rank} only" in n for n in result["report"]["notes"]), result["report"]["notes"]
        explained = result["explain"]
        assert explained["device"] == f"cuda:{rank}", "explain() means the rank's own GPU"
        parts = sum(v for v in explained["categories"].values() if v is not None)
        assert parts == explained["process_used"], explained
        nccl = explained["not_torch_nccl"]
        assert nccl is not None and 0 < nccl <= explained["categories"]["not_torch"], explained
        assert "of which NCCL" in result["table"], result["table"]
    shown = kernel.run("del launch")
    report = kernel.value("gpuexp.history()[-1].to_dict()")
    # The notebook is no rank: its report covers every GPU of the machine, the ranks' two first.
    assert [g["torch_index"] for g in report["gpus"]] == list(range(len(GPU_UUIDS))), report["gpus"]
    for index, gpu in enumerate(report["gpus"][:2]):
        assert gpu["children_used"]["peak"] >= (index + 1) * GiB, gpu["children_used"]
    assert "cuda:1 child processes" in shown.text


def test_a_rank_that_runs_out_of_memory_is_flagged_with_its_diagnosis(kernel_with_ranks):
    kernel = kernel_with_ranks
    cell = kernel.run("try:\n"
                      "    mp.start_processes(rank_code.oom, args=(2, rank_code.free_port()), nprocs=2, "
                      "start_method='spawn')\n"
                      "except Exception as e:\n"
                      "    raised = type(e).__name__\n")
    assert cell.error is None, cell
    assert kernel.value("raised") == "ProcessRaisedException"
    kernel.run("gathered = gpuexp.ranks('oom', timeout=60)")
    assert kernel.value("gathered.missing") == []
    errors = kernel.value("gathered.errors")
    assert errors[0] is None and "OutOfMemoryError" in errors[1], errors
    flags = "\n".join(kernel.value("gathered.flags"))
    assert "rank 1" in flags and "out of memory" in flags.lower(), flags


def test_a_rank_hung_in_a_collective_is_named_missing_and_the_kernel_stays_usable(kernel_with_ranks):
    kernel = kernel_with_ranks
    kernel.run("ranks_ctx = mp.start_processes(rank_code.hang, args=(2, rank_code.free_port()), nprocs=2, "
               "start_method='spawn', join=False)")
    cell = kernel.run("gathered = gpuexp.ranks('hang', timeout=40)")
    assert cell.error is None, cell
    assert kernel.value("gathered.missing") == [1]
    assert kernel.value("gathered.reports[0] is not None")
    assert kernel.value("sum(range(10))") == 45, "the kernel answers"
    kernel.run("for p in ranks_ctx.processes:\n    p.kill()\n    p.join(30)")
    assert kernel.value("[p.exitcode for p in ranks_ctx.processes]") == [-9, -9]


def test_the_finder_agrees_across_two_gpus_with_different_limits(kernel_with_ranks, tmp_path):
    kernel = kernel_with_ranks
    out = str(tmp_path / "out")
    cell = kernel.run(f"mp.start_processes(rank_code.find, args=(2, rank_code.free_port(), {out!r}), nprocs=2, "
                      "start_method='spawn')")
    assert cell.error is None, cell
    results = [json.loads((tmp_path / "out" / f"{r}.json").read_text()) for r in range(2)]
    answers = results[0]["answers"]
    assert results[1]["answers"] == answers and answers[0] < answers[1], answers
    assert [r["agreed"] for r in results] == [answers[0], answers[0]]


def test_notebook_launcher_ranks_report_their_own_gpus(kernel):
    kernel.run("import gpuexp, torch\nfrom accelerate import notebook_launcher")
    kernel.run(
        "def train():\n"
        "    from accelerate import Accelerator\n"
        "    accelerator = Accelerator()\n"
        "    with gpuexp.GPUExperiment('accelerate'):\n"
        "        size = (accelerator.process_index + 1) << 30\n"
        "        held = torch.empty(size, dtype=torch.uint8, device=accelerator.device)\n"
        "        accelerator.wait_for_everyone()\n"
        "        del held\n"
    )
    cell = kernel.run("notebook_launcher(train, num_processes=2)")
    assert cell.error is None, cell
    kernel.run("gathered = gpuexp.ranks('accelerate', timeout=60)")
    rows = kernel.value("gathered.to_dict()['rows']")
    assert [r["gpu"].split(" ")[0] for r in rows] == ["cuda:0", "cuda:1"], rows
    assert [r["torch_allocated_peak"] >= (i + 1) * GiB for i, r in enumerate(rows)] == [True, True], rows
