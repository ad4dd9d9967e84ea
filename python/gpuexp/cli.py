"""The ``gpuexp`` command: ``gpuexp status`` and ``gpuexp watch``, read straight from NVML."""

import argparse
import json
import sys
import time

from . import _core
from ._core import format_bytes as size

NO_NVML_EXIT = 3


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="gpuexp", description="GPU memory status and a live view, from NVML.")
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help="driver, CUDA and each GPU with its processes")
    status.add_argument("--json", action="store_true", help="machine-readable output")
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


def read_status(cuda_order):
    return json.loads(_core.gpu_status(cuda_order))


def torch_line():
    """Whether torch sees CUDA, when torch is installed (this is a separate process: importing it is fine)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "torch: not installed"
    import torch

    if not torch.cuda.is_available():
        return f"torch {torch.__version__}: CUDA not available"
    return f"torch {torch.__version__}: sees {torch.cuda.device_count()} CUDA device(s)"


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
    if args.json:
        report["torch"] = torch_line()
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
    print(torch_line())
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

    report = read_status(args.cuda_order)  # no driver: fail before printing anything
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
            report = read_status(args.cuda_order)
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
