"""Where a CUDA out-of-memory error was raised, read from its traceback after the error (nothing
runs before it): the frames, innermost first, and the path of the innermost ``nn.Module`` whose
code was running, named from the outermost module's ``named_modules`` (names and types only:
no user ``__repr__`` runs). The core picks the user's line (``FailedLine`` in report/oom.rs)."""

import sys

from .module_paths import _root_name


def _module_of(frame, module_type):
    """The frame's ``self`` where the frame is a method of an ``nn.Module``."""
    code = frame.f_code
    if module_type is None or code.co_argcount == 0 or code.co_varnames[0] != "self":
        return None
    this = frame.f_locals.get("self")
    return this if isinstance(this, module_type) else None


def failed_frames(error):
    """([(filename, line, function), ...] innermost first, "model.blocks.3.fc1 (Linear)" or None).
    Never raises: a frame or a module that cannot be read is skipped."""
    module_type = getattr(sys.modules.get("torch.nn"), "Module", None)
    frames, modules = [], []
    traceback = getattr(error, "__traceback__", None)
    while traceback is not None:
        frame = traceback.tb_frame
        frames.append((frame.f_code.co_filename, traceback.tb_lineno or 0, frame.f_code.co_name))
        try:
            module = _module_of(frame, module_type)
        except Exception:  # a proxy's isinstance, an odd frame: the path is only a help
            module = None
        if module is not None:
            modules.append(module)
        traceback = traceback.tb_next
    frames.reverse()
    return frames, _path(modules)


def _path(modules):
    """The innermost module's path under the outermost one (both from the traceback)."""
    if not modules:
        return None
    root, inner = modules[0], modules[-1]
    kind = type(inner).__name__
    try:
        prefix = _root_name(root)
        for name, module in root.named_modules(prefix=prefix):
            if module is inner:
                return f"{name} ({kind})"
    except Exception:  # a module whose tree cannot be walked: its type still helps
        pass
    return kind
