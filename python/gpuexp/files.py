"""Files gpuexp writes (the history, a timeline's figure): each is replaced atomically, so a
failure (a full disk, an interrupt) leaves the previous file whole."""

import os
import tempfile


def write_atomically(path, write):
    """Calls ``write(file)`` on a binary temporary file beside ``path``, then renames it over
    ``path``: the file is the old one or the new one, never cut off. The error names the path."""
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    name, extension = os.path.splitext(os.path.basename(target))
    temporary = None
    try:
        # The same extension: a writer such as matplotlib's savefig picks its format by it.
        with tempfile.NamedTemporaryFile(dir=directory, prefix=f".{name}.", suffix=f".tmp{extension}",
                                         delete=False) as out:
            temporary = out.name
            write(out)
            out.flush()
            os.fsync(out.fileno())
        if os.path.exists(target):
            os.chmod(temporary, os.stat(target).st_mode & 0o7777)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(temporary, 0o666 & ~umask)  # as open() would have made it
        os.replace(temporary, target)
    except OSError as error:
        if temporary is not None:
            try:
                os.unlink(temporary)
            except OSError:
                pass
        raise OSError(error.errno, f"writing {target} failed, and the previous file is left as it was: "
                                   f"{error.strerror or error}") from error
