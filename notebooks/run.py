"""Runs a notebook headless in a real Jupyter kernel and prints each cell with its outputs.

    python notebooks/run.py notebooks/quickstart.ipynb [--save executed.ipynb]

The kernel is "python3" as Jupyter finds it: put the environment's bin/ first on PATH so that
it is the Python that has gpuexp (the Makefile's `demo` target does). A failing cell stops the
run: its traceback is printed and the exit status is 1.
"""

import argparse
import os
import re
import sys

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def output_text(output):
    if output.output_type == "stream":
        return output.text
    if output.output_type in ("execute_result", "display_data"):
        return output.get("data", {}).get("text/plain", "")
    if output.output_type == "error":
        return ANSI.sub("", "\n".join(output.traceback))
    return ""


def print_cells(nb):
    for cell in nb.cells:
        count = cell.get("execution_count")
        if cell.cell_type != "code" or count is None:
            continue  # markdown, or not reached because an earlier cell failed
        prompt = f"In [{count}]: "
        print(prompt + cell.source.replace("\n", "\n" + " " * len(prompt)))
        for output in cell.get("outputs", []):
            text = output_text(output)
            if text:
                print(text.rstrip("\n"))
        print()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook")
    parser.add_argument("--save", metavar="PATH", help="write the executed notebook here")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell (default 600)")
    args = parser.parse_args(argv)

    nb = nbformat.read(args.notebook, as_version=4)
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=args.timeout,
        allow_errors=False,
        resources={"metadata": {"path": os.path.dirname(os.path.abspath(args.notebook))}},
    )
    failed = None
    try:
        client.execute()
    except CellExecutionError as error:
        failed = error
    print_cells(nb)
    if args.save:
        nbformat.write(nb, args.save)
    if failed is not None:
        print(f"FAILED: {args.notebook}: {failed.ename}: {failed.evalue}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
