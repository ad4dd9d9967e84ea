"""How long `gpuexp.load_snapshot` takes on a snapshot of many out-of-memory errors (a loop that
catches the error and retries writes one): the target is under 2 s for 200,000 of them, on the
installed gpuexp (a release build: `make build`).

    python bench/load_snapshot_cost.py [--ooms N] [--repeats R]

Needs no GPU. Exit status: 0 when the target is met, 1 when not.
"""

import argparse
import os
import pickle
import statistics
import sys
import tempfile
import time

TARGET_S = 2.0


def many_ooms(path, count):
    frames = [{"filename": "/home/u/train.py", "line": 7, "name": "step"}]
    trace = [{"action": "alloc", "addr": 1 << 32, "size": 1 << 30, "stream": 0, "time_us": 1, "frames": frames}]
    trace += [{"action": "oom", "addr": 0, "size": 1 << 40, "stream": 0, "time_us": 2 + i, "device_free": 1 << 20,
               "frames": frames} for i in range(count)]
    with open(path, "wb") as out:
        pickle.dump({"segments": [], "device_traces": [trace]}, out, protocol=4)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ooms", type=int, default=200_000, help="OOM events in the file (default 200000)")
    parser.add_argument("--repeats", type=int, default=3, help="loads timed; the median is shown (default 3)")
    args = parser.parse_args(argv)
    if args.ooms < 0 or args.repeats < 1:
        parser.error("--ooms must be at least 0 and --repeats at least 1")
    import gpuexp

    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "ooms.pickle")
        many_ooms(path, args.ooms)
        seconds = []
        for _ in range(args.repeats):
            started = time.monotonic()
            trace = gpuexp.load_snapshot(path)
            seconds.append(time.monotonic() - started)
        [device] = trace.to_dict()
    median = statistics.median(seconds)
    print(f"load_snapshot of {args.ooms} OOMs ({len(device['ooms'])} analysed, "
          f"{device['ooms_not_analysed']} counted): {median:.2f} s median of {args.repeats} (target {TARGET_S:.0f} s)")
    return 0 if median < TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
