"""The ``gpuexp`` command: ``gpuexp status`` and ``gpuexp watch``, read straight from NVML."""

import argparse
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

from . import _core
from ._core import NvmlUnavailable

# A refresh is an NVML read, a format and a write: below 10 ms a watch only burns a core.
MIN_INTERVAL_S = 0.01
MAX_INTERVAL_S = 86400

# The exit code of each failure the command reports in one line; the most specific class of an
# error decides. Anything else is a bug and ends with its traceback. argparse exits with 2 itself.
EXIT_CODES = {
    NvmlUnavailable: 3,  # no NVIDIA driver: NVML cannot be opened
    ValueError: 2,  # an argument only the core can judge, a usage error like argparse's
    OSError: 1,  # the output or the --log file could not be written
    RuntimeError: 1,  # NVML failed on a device it had opened
}


# What to do instead where there is no driver: both commands read NVML and nothing else.
NO_DRIVER_FIX = ("this machine has no NVIDIA GPU this process can reach. On a GPU machine, install the NVIDIA driver "
                 "(`nvidia-smi` works once it is there); here, gpuexp.snapshot() and CPUExperiment measure host "
                 "memory from Python")


def exit_code(error):
    """The exit code for `error`, or None when it is not a failure the command reports."""
    return next((EXIT_CODES[kind] for kind in type(error).__mro__ if kind in EXIT_CODES), None)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="gpuexp", description="GPU memory status and a live view, from NVML.")
    parser.add_argument("--version", action="version", version=f"gpuexp {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help="driver, CUDA and each GPU with its processes")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--torch", action="store_true",
                        help="import torch to confirm that it sees CUDA (seconds); "
                             "by default its build is read from its files")
    watch = commands.add_parser("watch", help="one line per GPU, refreshed (Ctrl-C stops)")
    watch.add_argument("-n", "--interval", type=float, default=1.0, metavar="SECONDS",
                       help="seconds between refreshes (default 1)")
    form = watch.add_mutually_exclusive_group()
    form.add_argument("--csv", action="store_true", help="a CSV log, like nvidia-smi --query-gpu=... --format=csv -l")
    form.add_argument("--json", action="store_true", help="a JSON line per GPU and refresh")
    watch.add_argument("--log", metavar="FILE", help="also append what is printed to FILE")
    for command in (status, watch):
        command.add_argument("--cuda-order", action="store_true",
                             help="the GPUs CUDA_VISIBLE_DEVICES shows, in CUDA's order "
                                  "(default: all GPUs, NVML order)")
    args = parser.parse_args(argv)
    # A bad value of a subcommand gets that subcommand's usage, not the top level's.
    if args.command == "watch" and not MIN_INTERVAL_S <= args.interval <= MAX_INTERVAL_S:
        watch.error(f"-n {args.interval}: the interval must be between {MIN_INTERVAL_S} and {MAX_INTERVAL_S} seconds, "
                    "e.g. -n 1")
    if args.command == "watch" and args.log and not writable(args.log):
        watch.error(f"--log {args.log}: cannot write there; name a file in a directory you can write to")
    return args


def _version():
    from . import __version__

    return __version__


def writable(path):
    """Whether `path` can be appended to (checked before any device is opened, so the error comes first)."""
    if os.path.exists(path):
        return os.path.isfile(path) and os.access(path, os.W_OK)
    return os.access(os.path.dirname(os.path.abspath(path)), os.W_OK)


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
        driver_major = driver_cuda.split(".")[0]
        return {**found, "sees": 0, "line": f"torch {version} is built for CUDA {cuda}, newer than the driver's CUDA "
                f"{driver_cuda}: it sees no CUDA device. Update the driver, or install a torch built for CUDA "
                f"{driver_major}"}
    sees = len(_core.GpuStatus(cuda_order=True, processes=False))
    if sees == 0:
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        return {**found, "sees": 0, "line": f"torch {version}: CUDA_VISIBLE_DEVICES={hidden!r} hides every GPU"}
    return {**found, "sees": sees, "line": f"torch {version} (built for CUDA {cuda}): sees {sees} CUDA device(s), "
            "judged from its build, the driver and CUDA_VISIBLE_DEVICES (--torch imports it to check)"}


def status(args):
    report = _core.GpuStatus(args.cuda_order)
    torch = torch_status(report.cuda, args.torch)
    if args.json:
        print(json.dumps({**json.loads(report.to_json()), "torch": torch}, indent=2))
    else:
        print(report)
        print(torch["line"])
    return 0


def watch(args):
    style = "csv" if args.csv else "json" if args.json else "live"
    view = _core.Watch(args.cuda_order, style, args.interval)  # no driver: fails before anything is printed
    try:
        view.run(args.log, redraw=style == "live" and sys.stdout.isatty())
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a watch ends
    return 0


def main(argv=None):
    args = parse_args(argv)
    try:
        return status(args) if args.command == "status" else watch(args)
    except Exception as error:
        code = exit_code(error)
        if code is None:
            raise
        said = f"{error}: {NO_DRIVER_FIX}" if isinstance(error, NvmlUnavailable) else str(error)
        if args.command == "status" and args.json:
            # A script reading --json gets JSON whatever happened: the error and no GPUs.
            print(json.dumps({"error": said, "exit_code": code, "devices": []}, indent=2))
        print(f"gpuexp: {said}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
