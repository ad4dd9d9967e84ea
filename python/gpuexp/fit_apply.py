"""Applying what ``gpuexp.fit`` proposes, and checking it with one real step.

``checkpointed(model, paths)`` wraps named blocks in activation checkpointing and undoes it
exactly. ``verify(step, batch_size, option, ...)`` runs the step once (or a few times) for real
with an option applied, in a gpuexp scope, measures torch's peak and the step time, and then
puts every piece of state the step changed back, bit for bit (``saved_state``).
"""

import contextlib
import difflib
import gc
import inspect
import threading
import time
import weakref

from . import _core
from .devices import device_indices
from .experiment import count, size
from .saved_state import RestoreFailed, capture, imported_torch
from .torch_peaks import watch_torch_peak_resets

__all__ = ["RestoreFailed", "Verified", "capture", "checkpointed", "verify"]


@contextlib.contextmanager
def checkpointed(model, paths):
    """Activation checkpointing on the named submodules of ``model`` while the block runs:
    ``with gpuexp.checkpointed(model, ["layers.0", "layers.1"]): step(64)``.

    paths: dotted names as ``model.named_modules()`` gives them (one string or a list). Each
        module's forward then runs under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``:
        what it saves for backward is dropped after its forward and recomputed in the backward
        (RNG preserved, so dropout draws the same mask; batch norms update their running
        statistics once, not again in the recompute). Without grad (``torch.no_grad``, eval) the
        forward runs as it is. A transformers layer gets no KV cache while checkpointed, as with
        its own ``gradient_checkpointing_enable()``: the recompute would write it twice.
    On exit the modules are exactly as before: the same objects, their own ``forward``, hooks
    (which run once per call, not again in the recompute) and ``state_dict`` keys. An unknown
    path raises ValueError naming it and the closest valid names; nothing is wrapped then. So
    does a module that an open ``checkpointed`` (on any thread) already wraps, inside or around
    it: two wrappers on one module, exited out of order, would leave one there for good.
    """
    torch = imported_torch("checkpointed")
    chosen = _chosen_modules(model, paths)
    checkpoint = _checkpoint_function()
    opened = f"checkpointed({type(model).__name__}, {[p for p, _ in chosen]!r})"
    with _OPEN_LOCK:
        for path, module in chosen:
            _refuse_overlap(path, module)
        for _, module in chosen:
            _OPEN[module] = opened
    wrapped = []
    try:
        for _, module in chosen:
            wrapped.append((module, "forward" in module.__dict__, module.__dict__.get("forward")))
            module.forward = _checkpointing_forward(torch, checkpoint, module, module.forward)
        yield model
    finally:
        for module, had_own, own in reversed(wrapped):
            if had_own:
                module.forward = own
            else:
                del module.forward
        with _OPEN_LOCK:
            for _, module in chosen:
                _OPEN.pop(module, None)


# The modules an open ``checkpointed`` wraps, each with that call as its error shows it.
_OPEN = weakref.WeakKeyDictionary()
_OPEN_LOCK = threading.Lock()


def _refuse_overlap(path, module):
    inside = set(map(id, module.modules()))
    for other, opened in list(_OPEN.items()):
        if id(other) in inside or any(m is module for m in other.modules()):
            raise ValueError(
                f"{path!r} is already checkpointed, or inside or around a module that is, by the open "
                f"{opened}: exit that block first, or name these blocks in that call"
            )


def _chosen_modules(model, paths):
    torch = imported_torch("checkpointed")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"checkpointed() takes a torch.nn.Module and paths of its submodules; got {type(model).__name__}"
        )
    given = paths
    if isinstance(paths, str):
        paths = [paths]
    try:
        paths = [] if isinstance(paths, (bytes, bytearray)) else list(dict.fromkeys(paths))
    except TypeError:
        raise TypeError(f"paths must be a list of submodule names, e.g. ['layers.0']; got {given!r}") from None
    if not paths or not all(isinstance(p, str) for p in paths):
        raise TypeError(f"paths must be a non-empty list of submodule names, e.g. ['layers.0']; got {given!r}")
    modules = dict(model.named_modules(remove_duplicate=False))
    unknown = [p for p in paths if p not in modules]
    if unknown:
        names = [n for n in modules if n]
        hints = []
        for path in unknown:
            close = difflib.get_close_matches(path, names, n=3, cutoff=0.5)
            hints.append(f"{path!r} (closest: {', '.join(close)})" if close else repr(path))
        raise ValueError(
            f"{type(model).__name__} has no submodule {'; '.join(hints)}. Paths are the names of "
            f"model.named_modules(), e.g. {', '.join(repr(n) for n in names[:3])}"
        )
    for path in paths:
        outer = next((p for p in paths if p != path and (p == "" or path.startswith(p + "."))), None)
        if outer is not None:
            raise ValueError(
                f"{path!r} is inside {outer!r}: checkpointing both would recompute {path!r} twice; name one of them"
            )
    return [(path, modules[path]) for path in paths]


def _checkpoint_function():
    import torch.utils.checkpoint  # a torch submodule, imported only once the user has torch

    return torch.utils.checkpoint.checkpoint


# A transformers layer's KV cache argument, by the names its layers give it.
_CACHE_ARGUMENTS = ("cache", "layer_past", "past_key_value", "past_key_values")


def _checkpointing_forward(torch, checkpoint, module, forward):
    def checkpointed_forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        args, kwargs = _without_cache(module, forward, args, kwargs)
        calls = []

        # The block's keywords are bound here, not passed to checkpoint, which would take its
        # own (debug, preserve_rng_state, context_fn...) from them.
        def run(*args):
            calls.append(None)
            if len(calls) == 1:
                return forward(*args, **kwargs)
            with _recomputing(torch, module):  # the backward's replay
                return forward(*args, **kwargs)

        return checkpoint(run, *args, use_reentrant=False)

    checkpointed_forward.__wrapped__ = forward
    return checkpointed_forward


def _without_cache(module, forward, args, kwargs):
    """A transformers layer that writes its KV cache would write it again in the replay, and the
    replay would then see other shapes: as transformers' own gradient checkpointing does, the
    cache is not passed (nor ``use_cache``) to a checkpointed layer. Other modules run as called."""
    if getattr(module, "_can_checkpoint_with_cache", True):
        return args, kwargs
    try:
        bound = inspect.signature(forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    for name in _CACHE_ARGUMENTS:
        if bound.arguments.get(name) is not None:
            bound.arguments[name] = None
    if bound.arguments.get("use_cache"):
        bound.arguments["use_cache"] = False
    return bound.args, bound.kwargs


@contextlib.contextmanager
def _recomputing(torch, module):
    """While the backward replays a block's forward, its batch norms normalise as in the forward
    (by the batch's statistics, saving the same tensors) but with a momentum of 0, and their count
    of batches is put back after: the running statistics move once per step, as without
    checkpointing."""
    norms = [m for m in module.modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats]
    before = [(m, m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone())
              for m in norms]
    for norm in norms:
        norm.momentum = 0.0
    try:
        yield
    finally:
        for norm, momentum, count in before:
            norm.momentum = momentum
            if count is not None:
                with torch.no_grad():
                    norm.num_batches_tracked.copy_(count)


class Verified:
    """What one option did in a real step: ``peak`` (bytes of torch allocated above the start),
    ``seconds`` (one step's time), ``out_of_memory`` (None, or torch's message), ``stranded``
    (with it: the bytes torch held reserved but unallocated as it ran out, which fragmentation
    strands and no estimate sees), ``leftover`` (bytes still allocated after everything was
    restored, cuBLAS's workspaces aside: 0 expected), ``report`` (the scope's), and
    ``forward_seconds`` (with ``time_forwards``: each named module's forward time in the step to
    its last save for backward, ``{path: seconds}``; None otherwise)."""

    def __init__(self, option, batch_size, peak, seconds, out_of_memory, leftover, report, notes, stranded=None,
                 forward_seconds=None):
        self.option, self.batch_size, self.peak, self.seconds = option, batch_size, peak, seconds
        self.out_of_memory, self.leftover, self.report, self.notes = out_of_memory, leftover, report, notes
        self.stranded, self.forward_seconds = stranded, forward_seconds

    def to_dict(self):
        return {"option": self.option, "batch_size": self.batch_size, "peak": self.peak, "seconds": self.seconds,
                "out_of_memory": self.out_of_memory, "stranded": self.stranded, "leftover": self.leftover,
                "forward_seconds": self.forward_seconds, "notes": list(self.notes)}

    def __repr__(self):
        if self.out_of_memory:
            outcome = f"out of memory ({self.out_of_memory.splitlines()[0]})"
        else:
            outcome = f"peak {_mib(self.peak)}, {self.seconds * 1000:.1f} ms a step"
        return f"<verified {self.option} at batch size {self.batch_size}: {outcome}>"


def verify(step, batch_size, option="as_is", *, modules=(), optimizers=(), scalers=(), objects=(), device=None,
           limit=None, steps=1, repeat=2, time_forwards=None):
    """Runs ``step(batch_size)`` for real with ``option`` applied and measures it; then restores
    the state the step changed. Returns a ``Verified``.

    option: ``"as_is"``, ``"autocast"`` (bf16 autocast over the step, for a step in fp32),
        ``{"kind": "autocast", "dtype": "bfloat16"}``, or
        ``{"kind": "checkpoint", "model": model, "paths": ["layers.0", ...]}`` (``checkpointed``).
    modules, optimizers, scalers, objects: what the step changes, as for ``capture``: each is put
        back bit for bit after every run (same objects, version counters, RNG).
    device: the GPU (torch's current one by default). limit: caps torch's allocations while it
        runs (the scope's ``limit``), so that "does it fit 24GiB" is answered for real.
    steps: calls in a row in one run (state carries over within a run). repeat: runs, each
        from the same restored state; the first warms up and is left out of the time and the
        peak when there are more (it makes cuBLAS's workspaces, which verify frees first, as a
        step in a training loop finds them made). The peak is the highest of the others.
    time_forwards: ``(model, ["layers.0", ...])``: one more run after those, with CUDA events as
        each named module's forward starts and saves tensors for backward, gives
        ``forward_seconds`` (the GPU time to its last save: what checkpointing it would run again
        in the backward); that run counts in neither the time nor the peak.
    An out-of-memory error ends the runs: ``out_of_memory`` says so, and the state is restored.
    GPU only. If restoring fails, ``RestoreFailed`` names what could not be put back.
    """
    torch = imported_torch("verify")
    _core.check_step(step, "verify(train_step, 64)")
    count(batch_size, "batch_size", "verify(train_step, 64)")
    count(steps, "steps", "verify(train_step, 64, steps=2)")
    count(repeat, "repeat", "verify(train_step, 64, repeat=3)")
    timed = None if time_forwards is None else _forwards_to_time(time_forwards)
    if not torch.cuda.is_available():
        raise RuntimeError(
            "verify runs the step for real on a GPU and measures torch's CUDA allocator, but torch sees no "
            "CUDA GPU here (torch.cuda.is_available() is False): predict without it (verify=False), or run "
            "on a machine with a GPU"
        )
    label, applied = _option(torch, option)
    index = torch.cuda.current_device() if device is None else device_indices(device, argument="device")[0]
    saved = dict(modules=modules, optimizers=optimizers, scalers=scalers, objects=objects)
    state = capture(**saved)  # bad arguments fail here, before anything runs
    try:
        scope, _start, _replaced, interrupted = _core.open_scope(
            f"verify {label} bs={batch_size}", gpu=True, devices=[index], cell_log=False,
            limit=size(limit, "limit"), tool=True,
        )
    except BaseException:
        state.restore()
        raise
    watch_torch_peak_resets()
    before = _allocated_by_tensors(torch, index)
    peaks, times, out_of_memory, stranded, notes, forward_seconds = [], [], None, None, [], None
    try:
        for run in range(repeat + (timed is not None)):
            state = state if run == 0 else capture(**saved)
            try:
                if run < repeat:
                    out_of_memory, stranded = _run(torch, index, step, batch_size, steps, applied, peaks, times)
                else:
                    forward_seconds = _timed_forwards(torch, index, step, batch_size, steps, applied, timed)
            finally:
                state.restore()
            if out_of_memory:
                break
    finally:
        gc.collect()
        leftover = _allocated_by_tensors(torch, index) - before
        torch.cuda.empty_cache()
        reports, held = _core.finish(scope, during_reset=False)
    if leftover > 0:
        notes.append(f"{_mib(leftover)} more is allocated after verify than before: "
                     "something the step made is still referenced (gpuexp.holders() shows what)")
    if interrupted or held:
        raise KeyboardInterrupt("gpuexp held this interrupt until verify had restored the state")
    peaks, times = _after_warm_up(peaks), _after_warm_up(times)
    return Verified(label, batch_size, max(peaks) if peaks else None, min(times) if times else None,
                    out_of_memory, leftover, reports[-1], notes, stranded, forward_seconds)


def _forwards_to_time(time_forwards):
    """``(model, paths)`` checked as ``checkpointed`` checks them: the paths and their modules."""
    try:
        model, paths = time_forwards
    except (TypeError, ValueError):
        raise TypeError(f"time_forwards is (model, ['layers.0', ...]); got {time_forwards!r}") from None
    chosen = _chosen_modules(model, paths)  # a bad list fails here, naming the fix
    return [path for path, _ in chosen], [module for _, module in chosen]


def _timed_forwards(torch, index, step, batch_size, steps, applied, timed):
    """One run with CUDA events recorded on the device's stream as each module's forward starts
    and as it saves a tensor for backward: ``{path: seconds}`` of GPU time from its start to its
    last save, summed over its calls and divided by the steps. That is what a checkpoint's
    recompute runs: it stops early once every saved tensor is back (torch's default), so a block
    that ends in a matmul whose output nothing saves (a transformer's MLP) does not run it again.
    A launch-bound forward counts the gaps the GPU waits, as a recompute would. None where the
    run ran out of memory."""
    paths, modules = timed
    clock = _ForwardClock(torch, torch.cuda.current_stream(index), _checkpoint_stops_early())
    hooks = []
    for path, module in zip(paths, modules):
        hooks += [module.register_forward_pre_hook(lambda _m, _a, path=path: clock.started(path)),
                  module.register_forward_hook(lambda _m, _a, _o, path=path: clock.ended(path))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(clock.saved, _unpacked), applied():
            for _ in range(steps):
                step(batch_size)
        torch.cuda.synchronize(index)
    except torch.cuda.OutOfMemoryError as error:
        error.__traceback__ = None  # its frames hold the step's tensors
        return None
    finally:
        for hook in hooks:
            hook.remove()
    return {path: clock.seconds(path) / steps for path in paths}


class _ForwardClock:
    """CUDA events of the timed modules' forwards: each call's start, and its last save for
    backward so far (or its end, where the recompute would run the whole forward)."""

    def __init__(self, torch, stream, stops_early):
        self.torch, self.stream, self.stops_early = torch, stream, stops_early
        self.open, self.spans = {}, {}

    def mark(self):
        event = self.torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def started(self, path):
        self.open.setdefault(path, []).append([self.mark(), None])

    def saved(self, tensor):
        if self.open and self.stops_early:
            event = self.mark()
            for calls in self.open.values():
                for call in calls:
                    call[1] = event
        return tensor

    def ended(self, path):
        calls = self.open.get(path)
        if not calls:
            return
        start, last_save = calls.pop()
        if not calls:
            del self.open[path]
        self.spans.setdefault(path, []).append((start, last_save or self.mark()))

    def seconds(self, path):
        return sum(start.elapsed_time(end) for start, end in self.spans.get(path, [])) / 1000


def _checkpoint_stops_early():
    """Whether checkpoint's recompute stops at the last saved tensor: torch's default, unless
    ``torch.utils.checkpoint.set_checkpoint_early_stop(False)`` is in force."""
    import torch.utils.checkpoint  # a torch submodule, imported only once the user has torch

    return getattr(torch.utils.checkpoint, "_enable_checkpoint_early_stop", None) is not False


def _unpacked(tensor):
    return tensor


def _after_warm_up(runs):
    """The runs' figures without the first run's, when there are others."""
    return runs[1:] if len(runs) > 1 else runs


def _allocated_by_tensors(torch, index):
    """torch's allocated bytes on the device without cuBLAS's workspaces. torch makes one per
    thread and stream the first time a matmul runs there and keeps it (32 to 65 MiB on an H200):
    checkpointing's recompute runs the forward's matmuls in autograd's own thread, whose first
    one would otherwise count as memory the step left behind. They are remade when next needed."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    torch.cuda.synchronize(index)
    if clear is not None:
        clear()
    return torch.cuda.memory_allocated(index)


def _run(torch, index, step, batch_size, steps, applied, peaks, times):
    """One run: the peak and the time, or the out-of-memory message (the frames it held dropped)
    with the bytes reserved but unallocated as it ran out. Returns that pair, or (None, None)."""
    torch.cuda.synchronize(index)
    torch.cuda.reset_peak_memory_stats(index)
    start = torch.cuda.memory_allocated(index)
    began = time.perf_counter()
    try:
        with applied():
            for _ in range(steps):
                step(batch_size)
        torch.cuda.synchronize(index)
    except torch.cuda.OutOfMemoryError as error:
        message = str(error)
        # Read while the error's frames still hold the step's tensors, as torch gave up.
        stranded = max(torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index), 0)
        error.__traceback__ = None  # its frames hold the step's tensors
        peaks.append(torch.cuda.max_memory_allocated(index) - start)
        return message, stranded
    times.append((time.perf_counter() - began) / steps)
    peaks.append(torch.cuda.max_memory_allocated(index) - start)
    return None, None


def _option(torch, option):
    """The option's label and a function giving the context that applies it."""
    if option == "as_is" or option is None:
        return "as is", contextlib.nullcontext
    if option == "autocast":
        option = {"kind": "autocast"}
    if isinstance(option, dict) and option.get("kind") == "autocast":
        dtype = option.get("dtype", "bfloat16")
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"autocast dtype must be a torch dtype such as 'bfloat16'; got {option.get('dtype')!r}")
        return f"autocast {str(dtype).removeprefix('torch.')}", lambda: torch.autocast("cuda", dtype=dtype)
    if isinstance(option, dict) and option.get("kind") == "checkpoint":
        model, paths = option.get("model"), option.get("paths")
        _chosen_modules(model, paths)  # bad paths fail before anything runs
        paths = [paths] if isinstance(paths, str) else list(paths)
        return f"checkpoint {', '.join(paths)}", lambda: checkpointed(model, paths)
    raise ValueError(
        "option must be 'as_is', 'autocast', {'kind': 'autocast', 'dtype': 'bfloat16'} or "
        f"{{'kind': 'checkpoint', 'model': model, 'paths': ['layers.0']}}; got {option!r}"
    )


def _mib(count):
    return f"{count / 2**20:.2f} MiB"
