"""The ``gpuexp`` command: ``gpuexp status`` and ``gpuexp watch``, read straight from NVML."""

import argparse
import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path

from . import _core
from ._core import format_bytes as size

NO_NVML_EXIT = 3


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="gpuexp", description="GPU memory status and a live view, from NVML.")
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help="driver, CUDA and each GPU with its processes")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--torch", action="store_true",
                        help="import torch to confirm that it sees CUDA (seconds); by default its build is read from its files")
    watch = commands.add_parser("watch", help="one line per GPU, refreshed (Ctrl-C stops)")
    watch.add_argument("-n", "--interval", type=float, default=1.0, metavar="SECONDS", help="seconds between refreshes (default 1)")
    form = watch.add_mutually_exclusive_group()
    form.add_argument("--csv", action="store_true", help="a CSV log, like nvidia-smi --query-gpu=... --format=csv -l")
    form.add_argument("--json", action="store_true", help="a JSON line per GPU and refresh")
    watch.add_argument("--log", metavar="FILE", help="also append what is printed to FILE")
    for command in (status, watch):
        command.add_argument("--cuda-order", action="store_true",
                             help="the GPUs CUDA_VISIBLE_DEVICES shows, in CUDA's order (default: all GPUs, NVML order)")
    args = parser.parse_args(argv)
    if args.command == "watch" and not args.interval > 0:
        parser.error(f"-n {args.interval}: the interval must be more than 0 seconds, e.g. -n 1")
    return args


def read_status(cuda_order, processes=True):
    return json.loads(_core.gpu_status(cuda_order, processes))


def torch_build():
    """(version, CUDA version it was built for or None) read from torch's files, or None when it
    isn't installed. Importing torch takes seconds; its version.py says the same."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text(encoding="utf-8")
    except OSError:
        return None
    version = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", text, re.M)
    cuda = re.search(r"^cuda\b[^=\n]*=\s*['\"]([^'\"]+)", text, re.M)
    return (version.group(1) if version else "?"), (cuda.group(1) if cuda else None)


def torch_status(driver_cuda, import_it):
    """Whether torch sees CUDA: by importing it, or judged from its build, the driver's CUDA version
    and CUDA_VISIBLE_DEVICES. A dict with "sees" (a device count, or None) and a "line" for people."""
    build = torch_build()
    if build is None:
        return {"installed": False, "sees": None, "line": "torch: not installed"}
    version, cuda = build
    found = {"installed": True, "version": version, "cuda_build": cuda}
    if import_it:
        import torch

        sees = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return {**found, "sees": sees, "how": "imported",
                "line": f"torch {version}: sees {sees} CUDA device(s) (checked by importing it)"}
    found["how"] = "judged from its build, the driver and CUDA_VISIBLE_DEVICES"
    if cuda is None:
        return {**found, "sees": 0, "line": f"torch {version}: a CPU-only build, so it sees no CUDA device"}
    if int(cuda.split(".")[0]) > int(driver_cuda.split(".")[0]):
        return {**found, "sees": 0, "line": f"torch {version} is built for CUDA {cuda}, newer than the driver's CUDA "
                f"{driver_cuda}: it sees no CUDA device. Update the driver, or install a torch built for CUDA {driver_cuda.split('.')[0]}"}
    sees = len(read_status(cuda_order=True, processes=False)["devices"])
    if sees == 0:
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        return {**found, "sees": 0, "line": f"torch {version}: CUDA_VISIBLE_DEVICES={hidden!r} hides every GPU"}
    return {**found, "sees": sees, "line": f"torch {version} (built for CUDA {cuda}): sees {sees} CUDA device(s), "
            "judged from its build, the driver and CUDA_VISIBLE_DEVICES (--torch imports it to check)"}


def device_line(device):
    activity = [f"{device['utilization']}%" if device.get("utilization") is not None else "util n/a"]
    if device.get("temperature_c") is not None:
        activity.append(f"{device['temperature_c']} °C")
    if device.get("power_w") is not None:
        activity.append(f"{device['power_w']:.0f} W")
    return (f"[{device['index']}] {device['name']} · {size(device['used'])} / {size(device['total'])} · "
            + " · ".join(activity) + f" · {device['uuid']}")


def status(args):
    report = read_status(args.cuda_order)
    report["torch"] = torch_status(report["cuda"], args.torch)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    order = "CUDA order (CUDA_VISIBLE_DEVICES)" if args.cuda_order else "NVML order"
    print(f"gpuexp status · driver {report['driver']} · CUDA {report['cuda']} · {order}")
    for device in report["devices"]:
        print(device_line(device))
        for process in device["processes"]:
            used = size(process["used"]) if process["used"] is not None else "n/a"
            print(f"    pid {process['pid']} ({process['user']}) {process['command'][:60]} · {used}")
    if not report["devices"]:
        print("no GPU listed")
    print(report["torch"]["line"])
    return 0


CSV_FIELDS = ["timestamp", "index", "name", "utilization", "memory_used", "memory_total", "temperature_c", "power_w"]


def watch(args):
    log = open(args.log, "a", encoding="utf-8") if args.log else None
    live = not (args.csv or args.json) and sys.stdout.isatty()

    def emit(text):
        print(text, flush=True)
        if log is not None:
            log.write(text + "\n")
            log.flush()

    report = read_status(args.cuda_order, processes=False)  # no driver: fail before printing anything
    if args.csv:
        emit(",".join(CSV_FIELDS))
    try:
        while True:
            started = time.monotonic()
            stamp = time.strftime("%Y/%m/%d %H:%M:%S")
            if args.csv or args.json:
                for d in report["devices"]:
                    row = [stamp, d["index"], d["name"], d.get("utilization"), d["used"], d["total"], d.get("temperature_c"), d.get("power_w")]
                    if args.csv:
                        emit(",".join("" if v is None else str(v) for v in row))
                    else:
                        emit(json.dumps(dict(zip(CSV_FIELDS, row))))
            else:
                lines = [f"gpuexp watch · {stamp} · every {args.interval:g} s · Ctrl-C stops"]
                lines += [device_line(d) for d in report["devices"]]
                emit(("\x1b[H\x1b[2J" if live else "") + "\n".join(lines))
            time.sleep(max(0.0, args.interval - (time.monotonic() - started)))
            report = read_status(args.cuda_order, processes=False)
    except KeyboardInterrupt:
        return 0
    finally:
        if log is not None:
            log.close()


def main(argv=None):
    args = parse_args(argv)
    try:
        return status(args) if args.command == "status" else watch(args)
    except RuntimeError as error:
        print(f"gpuexp: {error}", file=sys.stderr)
        return NO_NVML_EXIT


if __name__ == "__main__":
    sys.exit(main())
