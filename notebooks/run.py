"""Runs a notebook headless in a real Jupyter kernel and prints it: the text of its markdown
cells, then each code cell with its outputs, and at the end how to open it in JupyterLab.

    python notebooks/run.py notebooks/quickstart.ipynb [--save executed.ipynb]

The kernel is "python3" as Jupyter finds it: put the environment's bin/ first on PATH so that
it is the Python that has gpuexp (the Makefile's `demo` target does). A failing cell stops the
run: its traceback is printed and the exit status is 1.
"""

import argparse
import os
import re
import sys
import tempfile

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from traitlets.config import Config

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
HEADING = re.compile(r"^(#{1,6})\s+(.*)$")
# Markdown's emphasis, shown as plain text in a terminal (inline `code` keeps its backticks).
EMPHASIS = re.compile(r"(\*\*|\*)(?=\S)(.+?)(?<=\S)\1")


def output_text(output):
    if output.output_type == "stream":
        return output.text
    if output.output_type in ("execute_result", "display_data"):
        return output.get("data", {}).get("text/plain", "")
    if output.output_type == "error":
        return ANSI.sub("", "\n".join(output.traceback))
    return ""


def markdown_text(source):
    """A markdown cell as a terminal shows it: headings underlined, emphasis marks dropped."""
    lines = []
    for line in source.splitlines():
        heading = HEADING.match(line)
        if heading:
            title = EMPHASIS.sub(r"\2", heading.group(2))
            lines += [title, ("=" if len(heading.group(1)) == 1 else "-") * len(title)]
        else:
            lines.append(EMPHASIS.sub(r"\2", line))
    return "\n".join(lines).strip("\n")


def print_cells(nb):
    """Every markdown cell up to the last cell run, and every code cell run. A note repeated
    word for word under a later output (the same "note: no NVIDIA driver ..." under every table
    on a machine without a GPU) is printed the first time only."""
    ran = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code" and cell.get("execution_count")]
    notes_shown = set()
    for cell in nb.cells[: ran[-1] + 1 if ran else 0]:
        if cell.cell_type == "markdown":
            print(markdown_text(cell.source))
            print()
            continue
        count = cell.get("execution_count")
        if cell.cell_type != "code" or count is None:
            continue  # not reached because an earlier cell failed
        prompt = f"In [{count}]: "
        print(prompt + cell.source.replace("\n", "\n" + " " * len(prompt)))
        for output in cell.get("outputs", []):
            lines = []
            for line in output_text(output).rstrip("\n").splitlines():
                if line.startswith("note: "):
                    if line in notes_shown:
                        continue
                    notes_shown.add(line)
                lines.append(line)
            if lines:
                print("\n".join(lines))
        print()


def how_to_open(notebook):
    """The command that opens the notebook in JupyterLab from this environment, whose "python3"
    kernel is the Python running this one (the one that has gpuexp)."""
    jupyter = os.path.join(os.path.dirname(sys.executable), "jupyter")
    if not os.path.exists(jupyter):
        jupyter = "jupyter"
    elif not os.path.relpath(jupyter).startswith(".."):
        jupyter = os.path.relpath(jupyter)
    return f"To open it in JupyterLab and run it cell by cell: {jupyter} lab {notebook}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook")
    parser.add_argument("--save", metavar="PATH", help="write the executed notebook here")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell (default 600)")
    args = parser.parse_args(argv)

    nb = nbformat.read(args.notebook, as_version=4)
    failed = None
    # The kernel talks over Unix sockets in a folder of its own: over TCP, ipykernel warns at
    # start that the traffic is not encrypted, and that warning would open the demo.
    with tempfile.TemporaryDirectory(prefix="gpuexp-kernel-") as sockets:
        client = NotebookClient(
            nb,
            config=Config({"KernelManager": {"transport": "ipc", "ip": os.path.join(sockets, "kernel")}}),
            kernel_name="python3",
            timeout=args.timeout,
            allow_errors=False,
            resources={"metadata": {"path": os.path.dirname(os.path.abspath(args.notebook))}},
        )
        try:
            client.execute()
        except CellExecutionError as error:
            failed = error
    print_cells(nb)
    print(how_to_open(args.notebook))
    if args.save:
        nbformat.write(nb, args.save)
    if failed is not None:
        print(f"FAILED: {args.notebook}: {failed.ename}: {failed.evalue}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
