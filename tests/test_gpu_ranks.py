"""Across ranks on one NVIDIA GPU (`pytest -m gpu`): two gloo ranks share cuda:0, launched from a
real kernel. Multi-GPU NCCL runs are another issue; the code takes any number of GPUs."""

import json

import pytest

from conftest import RANK_PRELUDE, load_rank_code

pytestmark = pytest.mark.gpu

GiB = 1 << 30

RANK_CODE = RANK_PRELUDE + '''

def share(rank, world, port):
    """Rank r holds (r + 1) GiB on cuda:0 while every rank holds its own, for a second."""
    join(rank, world, port)
    with gpuexp.GPUExperiment("share", devices=[0]):
        held = torch.empty((rank + 1) << 30, dtype=torch.uint8, device="cuda:0")
        dist.barrier()
        time.sleep(1.0)
        dist.barrier()
        del held
    dist.destroy_process_group()


def find(rank, world, port, out):
    """Each rank rehearses a card of its own size (4 and 8 GiB); all must agree on one batch size."""
    join(rank, world, port)
    def step(bs):
        x = torch.empty(bs, 1 << 20, device="cuda:0")  # 4 MiB per sample
        (x * 2).sum()
    result = gpuexp.find_batch_size(step, start=8, max=4096, limit=f"{4 + 4 * rank}GiB", progress=False)
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"agreed": result.batch_size, "table": str(result),
                   "answers": result.to_dict()["ranks"]["answers"]}, f)
    dist.destroy_process_group()


def hold(ready, release):
    """A stray: holds 512 MiB on cuda:0 until released."""
    held = torch.empty(512 << 20, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    ready.set()
    release.wait(120)
'''

@pytest.fixture
def kernel_with_ranks(kernel, tmp_path):
    return load_rank_code(kernel, tmp_path, RANK_CODE)


# Spawn only: on an H100, a rank forked from the kernel saw no GPU ("Visible GPUs: []"), and torch
# supports CUDA in forked children only where the parent never initialised it. Forked ranks are
# covered on the CPU (tests/test_ranks.py); GPU ranks are spawned, as torch recommends.
@pytest.mark.parametrize("start_method", ["spawn"])
def test_two_ranks_share_a_gpu_with_exact_torch_figures_and_the_notebook_sees_both(kernel_with_ranks, start_method):
    kernel = kernel_with_ranks
    # The notebook's own experiment is open (its sampler reads NVML every 1 ms) while the ranks run.
    kernel.run('launch = gpuexp.GPUExperiment("launch", devices=[0])')
    kernel.run(
        f"mp.start_processes(rank_code.share, args=(2, rank_code.free_port()), nprocs=2, start_method={start_method!r})"
    )
    kernel.run("gathered = gpuexp.ranks('share', timeout=60)")
    rows = kernel.value("gathered.to_dict()['rows']")
    assert [r["torch_allocated_peak"] for r in rows] == [GiB, 2 * GiB]
    assert rows[0]["gpu"] == rows[1]["gpu"] and rows[0]["gpu"].startswith("cuda:0 = NVML "), rows
    for rank, row in enumerate(rows):
        assert row["torch_reserved_peak"] >= (rank + 1) * GiB and row["nvml_process_peak"] > (rank + 1) * GiB, row
    assert kernel.value("gathered.missing") == []
    shown = kernel.run("del launch")
    report = kernel.value("gpuexp.history()[-1].to_dict()")
    children = report["gpus"][0]["children_used"]
    # Both ranks held their tensors at once for a second: the sampler saw at least 3 GiB below the kernel.
    assert children["peak"] >= 3 * GiB and children["end"] == 0, children
    assert "cuda:0 child processes" in shown.text
    assert report["child_processes"] == []


def test_a_descendant_still_holding_memory_is_named_at_finish(kernel_with_ranks):
    kernel = kernel_with_ranks
    kernel.run('exp = gpuexp.GPUExperiment("strays", devices=[0])')
    kernel.run(
        "spawn = mp.get_context('spawn')\n"
        "ready, release = spawn.Event(), spawn.Event()\n"
        "stray = spawn.Process(target=rank_code.hold, args=(ready, release))\n"
        "stray.start()\n"
        "assert ready.wait(120)"
    )
    kernel.run("exp.keep('stray', 'release')")  # made in the scope, used after it
    shown = kernel.run("exp.finish()")
    named = kernel.value("exp.data.child_processes")
    pid = kernel.value("stray.pid")
    assert [c["pid"] for c in named] == [pid], named
    assert named[0]["used"] >= 512 << 20 and named[0]["torch_index"] == 0
    assert f"child process {pid} still holds" in shown.text and f"kill {pid}" in shown.text
    kernel.run("release.set(); stray.join(60)")
    assert kernel.value("stray.exitcode") == 0, "gpuexp never ends a process itself"


def test_the_finder_across_ranks_agrees_when_ranks_have_different_limits(kernel_with_ranks, tmp_path):
    kernel = kernel_with_ranks
    out = str(tmp_path / "out")
    kernel.run(
        f"mp.start_processes(rank_code.find, args=(2, rank_code.free_port(), {out!r}), nprocs=2, start_method='spawn')"
    )
    results = [json.loads((tmp_path / "out" / f"{r}.json").read_text()) for r in range(2)]
    answers = results[0]["answers"]
    assert results[1]["answers"] == answers and answers[0] < answers[1], answers
    assert [r["agreed"] for r in results] == [answers[0], answers[0]]
    assert "largest that fits on every rank" in results[1]["table"] and "each rank's answer" in results[1]["table"]
