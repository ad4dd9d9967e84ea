"""Retakes the outputs the documentation shows, each from the notebook, script or command that
makes it, so that no output in README.md or docs/ is typed by hand.

    python docs/capture.py                  # the captures: what makes each, and where it was taken
    python docs/capture.py NAME [NAME ...]  # retake these
    python docs/capture.py --cpu            # retake every capture that runs without a GPU
    python docs/capture.py --gpu            # retake every capture that needs one (on a GPU machine)
    python docs/capture.py --readme         # copy the README's examples from their captures

Each capture is a text file, docs/captures/NAME.txt, that the pages include as it is
(pymdownx.snippets); docs/captures/machines.json says on which machine and when each was taken.
A notebook's capture is the text of its cells tagged ``capture`` (a report, a table, a printed
line; never a traceback). tests/test_docs.py checks that the README's examples are their captures and
that no page shows a gpuexp table outside a capture. Run it with the environment's bin/ first on
PATH, so that the notebooks' kernel is the Python that has gpuexp (``make docs-captures`` does).
"""

import argparse
import ctypes
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CAPTURES_DIR = ROOT / "docs" / "captures"
MACHINES = CAPTURES_DIR / "machines.json"
README = ROOT / "README.md"
# The README's examples, in the order it shows them.
README_CAPTURES = ("quickstart-report", "trace")


@dataclass(frozen=True)
class Capture:
    """What makes one output: a notebook (its cells tagged ``capture``) or a shell command."""

    what: str
    gpu: bool
    notebook: str = ""
    command: str = ""

    def source(self):
        return self.notebook or self.command


CAPTURES = {
    "quickstart-report": Capture(
        "the report `del exp` shows in the quickstart", gpu=True, notebook="notebooks/quickstart.ipynb"),
    "cell-log": Capture("a cell's memory block", gpu=True, notebook="docs/examples/cell_log.ipynb"),
    "oom": Capture("the diagnosis after a CUDA out-of-memory error", gpu=True, notebook="docs/examples/oom.ipynb"),
    "oom-creep": Capture("the creep diagnosis after an evaluation loop kept its outputs until out of memory",
                         gpu=True, notebook="docs/examples/oom_creep.ipynb"),
    "holders": Capture("gpuexp.holders() on a notebook that holds memory in many ways", gpu=True,
                       notebook="docs/examples/holders.ipynb"),
    "still-held": Capture("a finished experiment's report naming what it could not free", gpu=True,
                          notebook="docs/examples/still_held.ipynb"),
    "explain-cpu": Capture("gpuexp.explain('cpu') after a training step", gpu=False,
                           command="python docs/examples/explain.py cpu"),
    "explain-cuda": Capture("gpuexp.explain() on a GPU after a training step", gpu=True,
                            command="python docs/examples/explain.py cuda"),
    "estimate-cpu": Capture("gpuexp.estimate() of a training step on the CPU", gpu=False,
                            command="python docs/examples/estimate.py cpu"),
    "estimate-cuda": Capture("gpuexp.estimate() of a training step on a GPU", gpu=True,
                             command="python docs/examples/estimate.py cuda"),
    "fit-cpu": Capture("gpuexp.fit() of a training step over its limit, on the CPU", gpu=False,
                       command="python docs/examples/fit.py cpu"),
    "fit-cuda": Capture("gpuexp.fit(..., verify=True) of a training step over its limit, on a GPU", gpu=True,
                        command="python docs/examples/fit.py cuda"),
    "status": Capture("the gpuexp status command", gpu=True, command="gpuexp status"),
    "watch-csv": Capture("gpuexp watch's CSV log", gpu=True, command="gpuexp watch -n 0.3 --csv | head -3"),
    "trace": Capture("a traced experiment's peak by source line, and why bs=16 peaks higher than bs=8", gpu=True,
                     notebook="docs/examples/trace.ipynb"),
    "ranks": Capture("gpuexp.ranks() after four gloo ranks launched from a notebook", gpu=False,
                     notebook="docs/examples/ranks.ipynb"),
}


def machine():
    """The machine in a few words: its GPU and driver where there is one, its CPU, and torch."""
    try:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.splitlines()[0].replace(", ", ", driver ")
    except (OSError, subprocess.SubprocessError, IndexError):
        gpu = "no GPU"
    try:
        torch = "torch " + importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "no torch"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpu += f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    return f"{gpu} · {platform.machine()} {os.cpu_count()} CPUs · Python {platform.python_version()} · {torch}"


def has_driver():
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def notebook_capture(path):
    """The text outputs of the notebook's cells tagged ``capture``, run in a real kernel."""
    import nbformat
    from nbclient import NotebookClient

    sys.path.insert(0, str(ROOT / "notebooks"))
    from run import output_text  # the same reading of an output as `make demo` prints

    nb = nbformat.read(ROOT / path, as_version=4)
    # A cell tagged raises-exception may raise (an OOM on purpose); any other error stops the capture.
    NotebookClient(nb, kernel_name="python3", timeout=600,
                   resources={"metadata": {"path": str((ROOT / path).parent)}}).execute()
    texts = [
        output_text(output).rstrip("\n")
        for cell in nb.cells if "capture" in cell.get("metadata", {}).get("tags", [])
        for output in cell.get("outputs", []) if output.output_type != "error"
    ]
    if not any(texts):
        raise SystemExit(f"{path}: no cell tagged 'capture' printed anything")
    return "\n".join(text for text in texts if text)


def command_capture(command):
    """What the command prints, after the command line itself."""
    shown = command
    if command.startswith("python "):  # this Python, the one that has gpuexp
        command = f"{shlex.quote(sys.executable)} {command[len('python '):]}"
    done = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 and "| head" not in command:  # head closing the pipe ends a watch loop
        raise SystemExit(f"{shown} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    return f"$ {shown}\n{done.stdout.rstrip()}"


def retake(name):
    capture = CAPTURES[name]
    text = notebook_capture(capture.notebook) if capture.notebook else command_capture(capture.command)
    CAPTURES_DIR.mkdir(exist_ok=True)
    (CAPTURES_DIR / f"{name}.txt").write_text(text + "\n", encoding="utf-8")
    machines = json.loads(MACHINES.read_text(encoding="utf-8")) if MACHINES.exists() else {}
    machines[name] = {"machine": machine(), "taken": datetime.date.today().isoformat(), "by": capture.source()}
    MACHINES.write_text(json.dumps(dict(sorted(machines.items())), indent=2, ensure_ascii=False) + "\n",
                        encoding="utf-8")
    print(f"{name}: {len(text.splitlines())} lines from {capture.source()}")


README_BLOCK = re.compile(r"(<!-- capture: (?P<name>[\w-]+) -->\n```text\n)(?P<body>.*?)(```\n<!-- /capture -->)", re.S)


def readme_with_captures(readme):
    """The README with each marked block replaced by its capture."""
    def fill(match):
        body = (CAPTURES_DIR / f"{match['name']}.txt").read_text(encoding="utf-8")
        return match.group(1) + body + match.group(4)

    return README_BLOCK.sub(fill, readme)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help="captures to retake: " + ", ".join(CAPTURES))
    parser.add_argument("--cpu", action="store_true", help="retake every capture that runs without a GPU")
    parser.add_argument("--gpu", action="store_true", help="retake every capture that needs a GPU")
    parser.add_argument("--readme", action="store_true", help="copy the README's examples from their captures")
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in CAPTURES]
    if unknown:
        parser.error(f"no capture named {', '.join(unknown)}: run it without arguments to list them")
    names = list(args.names)
    names += [name for name, capture in CAPTURES.items() if (args.gpu if capture.gpu else args.cpu)]
    if not names and not args.readme:
        machines = json.loads(MACHINES.read_text(encoding="utf-8")) if MACHINES.exists() else {}
        for name, capture in CAPTURES.items():
            taken = machines.get(name, {})
            print(f"{name:18} {'GPU' if capture.gpu else 'CPU'}  {capture.source()}\n{'':24}{capture.what}; "
                  f"taken {taken.get('taken', 'never')} on {taken.get('machine', '-')}")
        return 0
    if any(CAPTURES[name].gpu for name in names) and not has_driver():
        raise SystemExit("these captures need a GPU machine: " + ", ".join(n for n in names if CAPTURES[n].gpu))
    for name in dict.fromkeys(names):
        retake(name)
    if args.readme or set(README_CAPTURES) & set(names):
        README.write_text(readme_with_captures(README.read_text(encoding="utf-8")), encoding="utf-8")
        print("README.md: its examples are the captures", ", ".join(README_CAPTURES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
