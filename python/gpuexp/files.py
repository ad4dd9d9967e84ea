"""Files gpuexp writes from Python (the history, a timeline's figure): the bytes are made in
memory, then written by the core's one writer (``_core.write_atomically``), so a failure (a
full disk, an exception in the middle of a figure, an interrupt) leaves the previous file whole
and no temporary file behind. See docs/robustness.md for what the writer guarantees."""

import io
import os

from . import _core


def write_atomically(path, write):
    """Calls ``write(file)`` on an in-memory binary file, then has the core replace ``path`` with
    what it wrote: the file is the old one or the new one, never cut off. The error names the path."""
    buffer = io.BytesIO()
    write(buffer)
    _core.write_atomically(os.fspath(path), buffer.getvalue())


def save_figure(figure, path, **options):
    """Saves a matplotlib figure to ``path`` through ``write_atomically``, in the format its
    extension names (``.png``, ``.svg``, ``.pdf``)."""
    extension = os.path.splitext(os.fspath(path))[1][1:] or None
    write_atomically(path, lambda out: figure.savefig(out, format=extension, **options))
