"""What publishing and gathering cost with 64 ranks: per-rank publish (target at most 5 ms) and
`gpuexp.ranks()` over every rank (target at most 1 s).

    python bench/ranks_scale.py [--ranks 64] [--store file|tcp|group] [--json PATH]

This process plays the notebook kernel: it names a store for its ranks in GPUEXP_RANKS_STORE
(its private directory, as a kernel does, or with --store tcp a TCPStore it hosts on
loopback; with --store group none, so the ranks use their process group's store, a TCPStore
in rank 0), then forks the ranks. They join one gloo process group (CPU, host rows only), and
each runs a CPUExperiment twice: once with all ranks finishing together after a barrier (the
worst case: every rank writes to the store at once), once one after another (`--slot` apart,
the other ranks asleep). Each finish publishes; gpuexp reports what that took (wall and the
thread's CPU time). Then the last rank gathers, and this process too, twice (the first call
opens the store), where it named one.

With many ranks on a few cores, wall time is mostly waiting for a core: the CPU time is what
publishing itself costs, the wall time what a rank saw.
"""

import argparse
import json
import multiprocessing
import os
import queue
import socket
import statistics
import sys
import time

from machine import cpu_model


def rank_main(rank, world, port, results, slot_s):
    import datetime

    import torch.distributed as dist

    import gpuexp

    sys.stdout = open(os.devnull, "w")  # each experiment prints its tables
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    costs = {}
    dist.barrier()
    with gpuexp.CPUExperiment("together", cell_log=False):
        scratch = bytearray((1 + rank % 4) << 20)
        del scratch
        dist.barrier()
    costs["together"] = gpuexp._core.last_publish_s()
    # One after another, each in a slot of its own; the others sleep meanwhile (a gloo barrier
    # would keep them spinning on the cores).
    start = [time.time() + 1.0]
    dist.broadcast_object_list(start, src=0)
    time.sleep(max(0.0, start[0] + rank * slot_s - time.time()))
    with gpuexp.CPUExperiment("staggered", cell_log=False):
        scratch = bytearray(1 << 20)
        del scratch
    costs["staggered"] = gpuexp._core.last_publish_s()
    time.sleep(max(0.0, start[0] + world * slot_s + 0.5 - time.time()))
    dist.barrier()
    if rank == world - 1:
        started = time.perf_counter()
        gathered = gpuexp.ranks("staggered", timeout=30)
        costs["gather_in_rank_s"] = time.perf_counter() - started
        costs["gather_in_rank_missing"] = gathered.missing
    costs["publish_failures"] = [n for r in gpuexp.history() for n in r.notes if "publishing" in n]
    results.put((rank, costs))
    dist.barrier()
    dist.destroy_process_group()


def spread(values):
    values = sorted(values)
    return {
        "median": statistics.median(values),
        "p95": values[min(len(values) - 1, round(0.95 * (len(values) - 1)))],
        "max": values[-1],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--store", choices=["file", "tcp", "group"], default="file")
    parser.add_argument("--slot", type=float, default=0.1, help="seconds between the staggered ranks' finishes")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    import torch

    import gpuexp

    if args.store == "tcp":
        where = gpuexp.host_ranks_store()
    elif args.store == "file":
        where = os.environ.setdefault("GPUEXP_RANKS_STORE", gpuexp._core.kernel_ranks_store())
    else:
        where = os.environ.pop("GPUEXP_RANKS_STORE", None) and None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    forked = multiprocessing.get_context("fork")
    results = forked.Queue()
    started = time.perf_counter()
    ranks = [
        forked.Process(target=rank_main, args=(r, args.ranks, port, results, args.slot)) for r in range(args.ranks)
    ]
    for process in ranks:
        process.start()
    costs = {}
    while len(costs) < len(ranks):
        try:
            rank, cost = results.get(timeout=5)
            costs[rank] = cost
        except queue.Empty:
            if not any(p.is_alive() for p in ranks):
                break
    for process in ranks:
        process.join(120)
    launched_s = time.perf_counter() - started
    failed = [r for r, p in enumerate(ranks) if p.exitcode != 0 or r not in costs]
    if failed:
        print(f"ranks {failed} failed (their stderr is above)")
        return 1

    gathers, gathered, record = [None, None], None, None
    if where is not None:
        for i in range(2):
            t = time.perf_counter()
            gathered = gpuexp.ranks("staggered", timeout=30)
            gathers[i] = time.perf_counter() - t
        record = json.loads(gathered.to_json())
    store_bytes = None
    if args.store == "file":
        path = os.path.join(where[len("file://") :], "ranks.store")
        store_bytes = os.path.getsize(path)
        gpuexp._core.remove_kernel_ranks_store()

    results = {
        "ranks": args.ranks,
        "store": args.store,
        "failed_ranks": failed,
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "seconds_for_the_whole_run": launched_s,
        "staggered_slot_s": args.slot,
        "publish_together_wall_s": spread([costs[r]["together"][0] for r in costs]),
        "publish_together_cpu_s": spread([costs[r]["together"][1] for r in costs]),
        "publish_staggered_wall_s": spread([costs[r]["staggered"][0] for r in costs]),
        "publish_staggered_cpu_s": spread([costs[r]["staggered"][1] for r in costs]),
        "gather_in_a_rank_s": costs[args.ranks - 1]["gather_in_rank_s"],
        "gather_in_a_rank_missing": costs[args.ranks - 1]["gather_in_rank_missing"],
        "gather_in_the_kernel_first_s": gathers[0],
        "gather_in_the_kernel_again_s": gathers[1],
        "gathered_missing": gathered and gathered.missing,
        "publish_failures": [n for r in costs for n in costs[r]["publish_failures"]],
        "record_bytes_median": record and statistics.median(len(json.dumps(r)) for r in record["reports"] if r),
        "store_file_bytes": store_bytes,
    }
    ms = lambda s: f"{s * 1e3:.2f}"  # noqa: E731
    print(
        f"# {args.ranks} gloo ranks, {args.store} store ({results['cpu']}, {results['cores']} cores, "
        f"Python {results['python']}, torch {results['torch']})\n"
    )
    print("| what | median | p95 | max |")
    print("|---|---:|---:|---:|")
    for key, label in [
        ("publish_together", "publish, all ranks at once"),
        ("publish_staggered", "publish, one rank after another"),
    ]:
        for kind in ("wall", "cpu"):
            s = results[f"{key}_{kind}_s"]
            print(f"| {label}, {kind} ms | {ms(s['median'])} | {ms(s['p95'])} | {ms(s['max'])} |")
    print(
        f"\nranks() in the last rank: {ms(results['gather_in_a_rank_s'])} ms, "
        f"missing {results['gather_in_a_rank_missing']}"
    )
    if gathered is not None:
        print(
            f"ranks() in the kernel: {ms(gathers[0])} ms (first call, opens the store), {ms(gathers[1])} ms again; "
            f"missing {gathered.missing}"
        )
        print(f"a published record: {results['record_bytes_median']:.0f} bytes; the store's file: {store_bytes} bytes")
    print(f"publishes that failed: {len(results['publish_failures'])}; whole run {launched_s:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
