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
    """([(filename, line, function), ...] innermost first, "model.blocks.3.fc1 (Linear)" or None,
    the layers one pass runs through the numbered containers on that path or None: see
    ``_pass_layers``). Never raises: a frame or a module that cannot be read is skipped."""
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
    return (frames, *_path(modules))


def _path(modules):
    """The innermost module's path under the outermost one (both from the traceback), and the
    layers one pass runs through the numbered containers on it."""
    if not modules:
        return None, None
    root, inner = modules[0], modules[-1]
    kind = type(inner).__name__
    try:
        prefix = _root_name(root)
        named = dict(root.named_modules(prefix=prefix, remove_duplicate=False))
        for name, module in named.items():
            if module is inner:
                return f"{name} ({kind})", _pass_layers(name, named)
    except Exception:  # a module whose tree cannot be walked: its type still helps
        pass
    return kind, None


def _pass_layers(path, named):
    """How many layers one pass of the model runs through the numbered containers on ``path``
    (``model.blocks.20.fc1`` in 24 blocks: 24; ``layer3.5.conv1``: the blocks of ``layer3``),
    the product of their sizes: a single forward that fails in its 21st block repeats the same
    allocations once per block, which the rescue must not take for 20 iterations of a loop.
    None where no container on the path is numbered."""
    parts = path.split(".")
    layers = None
    for at in range(1, len(parts)):
        container = named.get(".".join(parts[:at]))
        if parts[at].isdigit() and container is not None:
            layers = (layers or 1) * max(len(container._modules), 1)
    return layers
