"""Across ranks, in real kernels: gloo ranks a notebook starts by fork, by spawn and through
torchrun publish their reports, and the notebook (or any rank) gathers them into one table.
CPU only: host rows, torch's CPU build and gloo."""

import json
import os
import re
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import RANK_PRELUDE, SAMPLER_RUNNING, load_rank_code

MiB = 1 << 20

# The ranks' code: a module the tests write next to their notebook, so spawn and torchrun can import it too.
RANK_CODE = RANK_PRELUDE + '''

def train(rank, world, port, out):
    """Rank r holds (r + 1) × 64 MiB in its experiment. Without a port, the group is already there
    (torchrun's env://)."""
    if port is not None:
        join(rank, world, port)
    world = dist.get_world_size()
    with gpuexp.CPUExperiment("train"):
        buffer = bytearray((rank + 1) * (64 << 20))
        del buffer
    seen = gpuexp.ranks("train", timeout=30) if rank == world - 1 else None
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({
            "gathered_missing": None if seen is None else seen.missing,
            "gathered_ranks": None if seen is None else [r.rank for r in seen.reports],
            "publish_s": gpuexp._core.last_publish_s(),
        }, f)
    dist.destroy_process_group()


def flaky(rank, world, port):
    """Rank 0 finishes; rank 1 raises inside its experiment; rank 2 hangs inside it."""
    join(rank, world, port)
    with gpuexp.CPUExperiment("flaky"):
        if rank == 1:
            raise ValueError("boom on rank 1")
        if rank == 2:
            time.sleep(600)
    started = time.perf_counter()
    gathered = gpuexp.ranks("flaky", timeout=2)
    print("RANK0", json.dumps({"missing": gathered.missing, "s": time.perf_counter() - started}), flush=True)
'''

@pytest.fixture
def rank_kernel(make_kernel, tmp_path):
    return lambda **env: load_rank_code(make_kernel(**env), tmp_path, RANK_CODE)


def read_outputs(tmp_path, world):
    return [json.loads((tmp_path / "out" / f"{r}.json").read_text()) for r in range(world)]


def check_train(kernel, tmp_path, world):
    """What every launch of `train` must show, in the ranks and in the notebook."""
    outputs = read_outputs(tmp_path, world)
    # The finder's agreement across ranks needs CUDA: tests/test_gpu_ranks.py and the Rust tests of ranks/agree.rs.
    assert outputs[-1]["gathered_missing"] == [] and outputs[-1]["gathered_ranks"] == list(range(world))
    assert all(o["publish_s"][0] < 0.05 for o in outputs), [o["publish_s"] for o in outputs]

    kernel.run("gathered = gpuexp.ranks('train', timeout=30)")
    gathered = kernel.value("gathered.to_dict()")
    assert gathered["world_size"] == world
    assert all("over the median" in f for f in gathered["flags"]), gathered["flags"]
    rows = gathered["rows"]
    assert [r["rank"] for r in rows] == list(range(world)) and all(r["reported"] for r in rows)
    # Rank 1 held 64 MiB more than rank 0.
    assert rows[1]["host_rss_peak"] - rows[0]["host_rss_peak"] >= 48 * MiB, rows
    reports = gathered["reports"]
    assert [(r["rank"], r["world_size"], r["name"]) for r in reports] == [(i, world, "train") for i in range(world)]
    assert all(r["hostname"] for r in reports)
    assert kernel.value("[type(r).__name__ for r in gathered.reports]") == ["Report"] * world
    text = kernel.run("print(gathered)").text
    assert f"gpuexp · train · {world} of {world} ranks reported" in text and "│ median" in text
    assert "<table>" in kernel.value("gathered._repr_html_()")
    assert kernel.value("list(gathered.to_pandas().index)") == list(range(world))


def test_ranks_forked_from_a_notebook_reach_it_without_configuration(rank_kernel, tmp_path):
    kernel = rank_kernel()
    where = kernel.value("os.environ['GPUEXP_RANKS_STORE']")
    assert where.startswith("file:///")
    assert stat.S_IMODE(os.stat(where[len("file://") :]).st_mode) == 0o700
    kernel.run(
        f"mp.start_processes(rank_code.train, args=(2, rank_code.free_port(), {str(tmp_path / 'out')!r}),"
        f" nprocs=2, start_method='fork')"
    )
    check_train(kernel, tmp_path, 2)


def test_ranks_spawned_from_a_notebook(rank_kernel, tmp_path):
    kernel = rank_kernel()
    kernel.run(
        f"mp.start_processes(rank_code.train, args=(2, rank_code.free_port(), {str(tmp_path / 'out')!r}),"
        f" nprocs=2, start_method='spawn')"
    )
    check_train(kernel, tmp_path, 2)


def test_a_torchrun_script_launched_from_a_notebook(rank_kernel, tmp_path):
    script = tmp_path / "launched.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(tmp_path)!r})
        import torch.distributed as dist
        import rank_code
        dist.init_process_group("gloo")
        rank_code.train(dist.get_rank(), None, None, {str(tmp_path / "out")!r})
    """)
    )
    kernel = rank_kernel()
    done = kernel.run(
        "import subprocess\n"
        "done = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc-per-node', '2',"
        f" {str(script)!r}], capture_output=True, text=True, timeout=240)\n"
        "print(done.returncode, done.stderr[-3000:])"
    )
    assert done.text.startswith("0 "), done.text
    check_train(kernel, tmp_path, 2)
    assert kernel.value("[r.local_rank for r in gathered.reports]") == [0, 1]


def test_a_rank_that_raises_and_one_that_hangs_are_named_and_nothing_hangs(rank_kernel):
    kernel = rank_kernel()
    started = time.perf_counter()
    # Rank 0 gathers on its own, from the group's store, while rank 2 hangs; it prints what it saw.
    shown = kernel.run(
        "context = mp.start_processes(rank_code.flaky, args=(3, rank_code.free_port()), nprocs=3, start_method='fork',"
        " join=False)\n"
        "context.processes[0].join(60)\n"
        "context.processes[1].join(60)\n"
        "t = time.perf_counter()\n"
        "gathered = gpuexp.ranks('flaky', timeout=3)\n"
        "waited = time.perf_counter() - t"
    )
    # Three forked ranks share the kernel's output: another's may land between "RANK0" and its JSON.
    found = re.search(r'RANK0 .*?(\{"missing": [^}]*\})', shown.text, re.S)
    assert found, shown.text
    rank0 = json.loads(found.group(1))
    assert 2 in rank0["missing"] and rank0["s"] < 5, rank0
    assert 2.9 < kernel.value("waited") < 8
    assert kernel.value("gathered.missing") == [2]
    flags = kernel.value("gathered.flags")
    assert "rank 1 raised ValueError: boom on rank 1" in flags, flags
    assert any(f.startswith('rank 2 missing: no report of "flaky" within 3.0 s') for f in flags), flags
    assert kernel.value("gathered.reports[2] is None and gathered.errors[1].startswith('ValueError')")
    text = kernel.run("print(gathered)").text
    assert "2 of 3 ranks reported" in text and "flag: rank 2 missing" in text
    kernel.run("context.processes[2].kill(); context.processes[2].join(30)")
    assert kernel.value("[p.exitcode for p in context.processes]") == [0, 1, -9]
    assert time.perf_counter() - started < 60


def test_a_forked_rank_inheriting_an_open_experiment_starts_clean(make_kernel):
    # A sampler thread runs in the parent (sampled host peaks), and a timeline thread too.
    kernel = make_kernel(GPUEXP_HOST_PEAK="sampled")
    kernel.run("import gpuexp, multiprocessing, os")
    # A 1 ms timeline is inside its host or NVML reads often enough that 30 forks would catch
    # one taken mid-read, which the fork gate must keep out.
    kernel.run('exp = gpuexp.CPUExperiment("outer", monitor="1ms")')
    kernel.run("big = bytearray(64 << 20)")
    assert kernel.value(SAMPLER_RUNNING + " and gpuexp._core.cell_log_active()")
    kernel.run(
        textwrap.dedent("""
        def child(queue):
            import gc
            state = {
                "parent_scope_open": gpuexp._core.is_open(exp._id),
                "history": len(gpuexp.history()),
                "tracked": len(gpuexp.experiment.tracked()),
                "shell": gpuexp.ipython.shell() is not None,
                "cell_log": gpuexp._core.cell_log_active(),
                "sampler": SAMPLER_RUNNING_EXPR,
            }
            with gpuexp.CPUExperiment("child") as own:
                scratch = bytearray(8 << 20)
            report = own.finish()
            gc.collect()
            gpuexp._core.shutdown()  # what atexit runs: nothing of the parent's to join
            state.update(name=report.name, deleted=report.deleted, history_after=[r.name for r in gpuexp.history()])
            queue.put(state)

        forked = multiprocessing.get_context("fork")
        results = []
        for _ in range(30):  # forks at different moments of the background threads' reads
            queue = forked.Queue()
            process = forked.Process(target=child, args=(queue,))
            process.start()
            try:
                results.append(queue.get(timeout=20))
            except Exception:  # a child stuck on a lock it inherited held
                process.kill()
                results.append({"hung": True})
            process.join(30)
            results[-1]["exitcode"] = process.exitcode
    """).replace("SAMPLER_RUNNING_EXPR", SAMPLER_RUNNING)
    )
    for state in kernel.value("results"):
        assert state == {
            "parent_scope_open": False,
            "history": 0,
            "tracked": 0,
            "shell": False,
            "cell_log": False,
            "sampler": False,
            "name": "child",
            "deleted": [],
            "history_after": ["child"],
            "exitcode": 0,
        }, state
    # The parent's experiment was untouched by its children.
    kernel.run("del exp")
    report = kernel.value("gpuexp.history()[-1].to_dict()")
    assert report["name"] == "outer" and "big" in report["deleted"] and len(report["monitor"]) > 0
    assert kernel.value("[r.name for r in gpuexp.history()]") == ["outer"]


def test_a_store_hosted_by_the_kernel_listens_on_loopback(rank_kernel, tmp_path):
    kernel = rank_kernel()
    url = kernel.value("gpuexp.host_ranks_store()")
    assert url.startswith("tcp://127.0.0.1:") and kernel.value("os.environ['GPUEXP_RANKS_STORE']") == url
    port = int(url.rsplit(":", 1)[1])
    listening = [line.split() for line in open("/proc/net/tcp").read().splitlines()[1:]]
    bound = [entry[1] for entry in listening if entry[3] == "0A" and int(entry[1].split(":")[1], 16) == port]
    assert bound == [f"0100007F:{port:04X}"]
    kernel.run(
        f"mp.start_processes(rank_code.train, args=(2, rank_code.free_port(), {str(tmp_path / 'out')!r}),"
        f" nprocs=2, start_method='fork')"
    )
    check_train(kernel, tmp_path, 2)
    assert f"from {url}" in kernel.run("print(gathered)").text


def test_gathering_outside_a_run_says_how_ranks_find_the_store(kernel, tmp_path):
    kernel.run("import gpuexp, torch")
    failed = kernel.run("gpuexp.ranks('train', timeout=0.2)", expect_error=True)
    assert failed.error.startswith("TimeoutError") and "GPUEXP_RANKS_STORE" in failed.error, failed.error
    bad = kernel.run("gpuexp.ranks(timeout=-1)", expect_error=True)
    assert bad.error.startswith("ValueError")
    script = tmp_path / "alone.py"
    script.write_text(
        "import gpuexp, torch\ntry:\n    gpuexp.ranks(timeout=0.1)\nexcept RuntimeError as e:\n    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "GPUEXP_RANKS_STORE"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env).stdout
    assert "no store to gather from" in out and "GPUEXP_RANKS_STORE" in out


def test_a_report_outside_a_run_carries_no_rank(kernel):
    kernel.run("import gpuexp\nwith gpuexp.CPUExperiment('alone'):\n    x = 1")
    report = kernel.value("gpuexp.history()[-1].to_dict()")
    assert not {"rank", "local_rank", "world_size", "hostname"} & report.keys()
    with_env = kernel.run(
        "import os\nos.environ.update(RANK='1', WORLD_SIZE='4', LOCAL_RANK='1')\n"
        "with gpuexp.CPUExperiment('env'):\n    y = 1"
    )
    report = kernel.value("gpuexp.history()[-1].to_dict()")
    assert (report["rank"], report["world_size"], report["local_rank"]) == (1, 4, 1) and report["hostname"]
    assert "rank 1 of 4 (local rank 1) on " in with_env.text


def test_a_store_that_is_gone_costs_a_note_once_never_the_report(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(
        textwrap.dedent("""
        import json, time
        import torch, gpuexp
        seconds, notes = [], []
        for name in ("first", "second"):
            started = time.perf_counter()
            with gpuexp.CPUExperiment(name):
                x = 1
            seconds.append(time.perf_counter() - started)
            notes.append(gpuexp.history()[-1].notes)
        print(json.dumps({"seconds": seconds, "notes": notes, "rank": gpuexp.history()[-1].rank}))
    """)
    )
    with __import__("socket").socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, GPUEXP_RANKS_STORE=f"tcp://127.0.0.1:{port}", RANK="0", WORLD_SIZE="1")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["rank"] == 0
    assert all(any("publishing for gpuexp.ranks() failed" in n for n in notes) for notes in result["notes"]), result
    assert "not tried again" in " ".join(result["notes"][1])
    # The store's error is quoted once, without its class stacked on ours.
    assert not any("RuntimeError: RuntimeError" in n for notes in result["notes"] for n in notes), result["notes"]
    assert not any("failed: RuntimeError: " in n for notes in result["notes"] for n in notes), result["notes"]
    assert result["seconds"][1] < 0.5, result["seconds"]
