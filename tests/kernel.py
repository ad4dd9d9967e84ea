"""A real IPython kernel driven cell by cell through nbclient, as Jupyter runs a notebook."""

import json
import os

import nbformat
from nbclient import NotebookClient

VALUE_MARK = "@@gpuexp-test-value@@"


class Cell:
    def __init__(self, node):
        self.outputs = node.outputs
        self.text = "".join(_texts(node.outputs))
        self.html = "".join(o.get("data", {}).get("text/html", "") for o in node.outputs)
        errors = [o for o in node.outputs if o.output_type == "error"]
        self.error = f"{errors[0].ename}: {errors[0].evalue}" if errors else None

    def __repr__(self):
        return f"<Cell error={self.error!r}\n{self.text}>"


def _texts(outputs):
    for o in outputs:
        if o.output_type == "stream":
            yield o.text
        elif o.output_type in ("execute_result", "display_data"):
            yield o.get("data", {}).get("text/plain", "") + "\n"
        elif o.output_type == "error":
            yield "\n".join(o.traceback) + "\n"


class Kernel:
    """One kernel for one test: `run` executes a cell, `value` reads a JSON-able expression
    without binding anything in the namespace (no Out entry, no `_`)."""

    def __init__(self, env=None, timeout=300):
        self.nb = nbformat.v4.new_notebook()
        self.client = NotebookClient(self.nb, timeout=timeout, kernel_name="python3", allow_errors=True)
        kernel_env = dict(os.environ)
        kernel_env.update(env or {})
        self._setup = self.client.setup_kernel(env=kernel_env)
        self._setup.__enter__()

    def run(self, source, expect_error=False):
        cell = nbformat.v4.new_code_cell(source)
        self.nb.cells.append(cell)
        node = self.client.execute_cell(cell, len(self.nb.cells) - 1)
        result = Cell(node)
        if result.error and not expect_error:
            raise AssertionError(f"cell failed:\n{source}\n---\n{result.text}")
        return result

    def value(self, expression):
        cell = self.run(f"print({VALUE_MARK!r} + __import__('json').dumps({expression}))")
        line = next(line for line in cell.text.splitlines() if line.startswith(VALUE_MARK))
        return json.loads(line[len(VALUE_MARK):])

    def shutdown(self):
        self._setup.__exit__(None, None, None)


def error_of(kernel, source):
    """The error a cell ends with, as 'Name: message' (None where it ran)."""
    return kernel.run(source, expect_error=True).error


def module_kernel(setup):
    """A fixture: one kernel for a module's checks that leave nothing behind (no experiment stays
    open), started with `setup` run in it."""
    import pytest

    @pytest.fixture(scope="module")
    def shared():
        k = Kernel()
        k.run(setup)
        yield k
        k.shutdown()

    return shared
