"""The IPython extension (``%load_ext gpuexp``; importing gpuexp in a notebook loads it): the
cell events that notice ``del exp``, run the cell log (its live view included) and rescue a
CUDA out-of-memory error, and the ``%gpuexp`` magics."""

import ast
import sys

from . import _core, live, module_paths
from .experiment import GPUExperiment, finish_unreachable, open_experiment, tracked
from .grown_holders import grown_holders
from .ipython import (
    ShellNamespace,
    hold_interrupt,
    in_sight,
    listened_shells,
    names_the_cell_binds,
    raise_held_interrupt,
    running_cell,
    shell,
    show,
)
from .torch_peaks import watch_torch_peak_resets

# The diagnosis of the last CUDA out-of-memory error the rescue showed, for gpuexp.fit's hint.
last_oom = None


def register(ip):
    """Listens to the shell's cell events and adds the ``%gpuexp`` magics (once per shell)."""
    if ip is None or id(ip) in listened_shells:
        return
    ip.events.register("pre_run_cell", _before_cell)
    ip.events.register("post_run_cell", _after_cell)
    ip.register_magics(_magics())
    listened_shells.add(id(ip))
    # Registered by an import, not `%load_ext`: IPython should still know, so that
    # `%unload_ext gpuexp` works and `%load_ext gpuexp` has nothing to do.
    loaded = getattr(getattr(ip, "extension_manager", None), "loaded", None)
    if isinstance(loaded, set):
        loaded.add(__package__)


def unregister(ip):
    """Stops listening to the shell's cell events, removes the ``%gpuexp`` magics and turns the
    standalone cell log off."""
    if ip is None or id(ip) not in listened_shells:
        return
    ip.events.unregister("pre_run_cell", _before_cell)
    ip.events.unregister("post_run_cell", _after_cell)
    for kind in ("line", "cell"):
        ip.magics_manager.magics[kind].pop("gpuexp", None)
    _core.set_standalone_log(False)
    listened_shells.discard(id(ip))


# ---- cell events ---------------------------------------------------------------------------


def _before_cell(info=None):
    module_paths.arm()  # a traced cell's new models get their paths
    _core.arm_recorder()  # from the first cell that starts with CUDA initialised
    if _core.cell_log_active():
        watch_torch_peak_resets()
        live.start()  # before the cell's window opens: the thread's own memory is not the cell's
        _core.begin_cell()


def _after_cell(result=None):
    # Most cells end here with nothing to rescue, show or finish: that path does the least.
    error = getattr(result, "error_in_exec", None)
    if error is None:
        _core.mark_step("cell")  # what grows after it counts towards the next cell's OOM
    # Rescue first: the cell's memory block then shows what the failed cell really kept.
    if error is not None and (ip := shell()) is not None:
        ended = _runs_ended_by(error)
        diagnosis = _core.rescue_oom(error, ShellNamespace(ip))
        if diagnosis is not None:
            global last_oom
            last_oom = diagnosis  # gpuexp.fit reads what it showed of fragmentation
            show(diagnosis)
        for experiment in ended:  # after the rescue: their reports show what came back
            experiment.finish()
    if error is None and _core.cell_log_active() and (ip := shell()) is not None:
        _core.cell_grew(grown_holders(running_cell(), ip.user_ns))  # for the creep note
    # The block shows only when something moved (the core decides), in place of the live view.
    record, live_view = live.end_cell(getattr(result, "execution_count", None) or 0)
    if record is not None or live_view is not None:
        # The cell that turned the log off (`%gpuexp log off`, `del exp`) is recorded, not shown.
        live.replace(live_view, record if _core.cell_log_active() else None)
    # Ids only: an experiment held in a list here would count as referenced.
    scope_ids = list(tracked())
    if scope_ids and (ip := shell()) is not None:
        _finish_unreferenced(scope_ids, ShellNamespace(ip))
    if (scope_ids or _core.unreachable_waiting()) and (ip := shell()) is not None:
        _note_sightings(ShellNamespace(ip))
        # The teardowns that waited for this point.
        if finish_unreachable("cell_end"):
            hold_interrupt(KeyboardInterrupt("gpuexp held this interrupt until the experiments had finished"))
    raise_held_interrupt(result)


def _note_sightings(namespace):
    """Tells the core which open experiments one of the user's names still leads to, and what the
    cell bound: for one found unreachable later, the names that came after it was last seen are
    kept. A function of its own, so that its references to the experiments are gone before any
    teardown collects garbage."""
    alive = tracked()
    sighted = in_sight(alive, namespace)
    # The cell's own bindings matter only to experiments not seen at its end (parsing costs).
    unseen = len(sighted) < len(alive) or _core.unreachable_waiting()
    _core.cell_ended_for_scopes(namespace, sighted, names_the_cell_binds() if unseen else set())


def _runs_ended_by(error):
    """The training runs still open when an error reached the cell: their trainer raised it
    (HF Trainer has no hook for it). Each notes the error, and the OOM diagnosis where it stood."""
    in_flight = _core.runs_in_flight()
    experiments = tracked() if in_flight else {}
    ended = []
    for run_id in in_flight:
        if run_id in experiments:
            _core.note_run_error(run_id, error)
            ended.append(experiments[run_id])
    return ended


def _finish_unreferenced(scope_ids, namespace):
    """Finishes the experiments that nothing refers to any more but IPython's caches (Out, _,
    _N): ``del exp``, ``exp = None``. One that anything else holds (a name, a list, a class, a
    closure, a running thread) stays open: ``runs = [start("a")]`` keeps its experiment."""
    for scope_id in scope_ids:
        experiment = open_experiment(scope_id)
        if experiment is None:
            continue
        # Counted against a fresh object held the same way, so that this frame's own references
        # (the local, the call's argument) cancel out on every CPython.
        probe = object()
        others = sys.getrefcount(experiment) - sys.getrefcount(probe) - namespace.cache_refs(experiment)
        if others <= 0:
            try:
                experiment.finish()
            except KeyboardInterrupt as error:
                hold_interrupt(error)
        experiment = None


# ---- magics --------------------------------------------------------------------------------

USAGE = """\
%gpuexp status           the current state (gpuexp.snapshot())
%gpuexp log on           a memory block after each cell where memory moved (gpuexp.config(cell_log_min_change=...))
%gpuexp log all          a memory block after every cell
%gpuexp log off          stop the cell log
%%gpuexp [name]          run one cell as a whole experiment: scope, teardown, report
%%gpuexp --trace [name]  the same, and where in the code it peaked (GPUExperiment(trace=True))
%%gpuexp --trace=host [name]  which lines grew the host's memory (--trace=all: both)"""


def _magics():
    """The ``%gpuexp`` magics; IPython is imported only once a shell exists."""
    from IPython.core.error import UsageError
    from IPython.core.magic import Magics, line_cell_magic, magics_class

    @magics_class
    class GpuexpMagics(Magics):
        @line_cell_magic
        def gpuexp(self, line, cell=None):
            if cell is not None:
                words = line.split()
                # `--trace` is True; `--trace=host` hands "host" on, for the core to check.
                traces = [True if w == "--trace" else w.removeprefix("--trace=") for w in words
                          if w == "--trace" or w.startswith("--trace=")]
                trace = traces[-1] if traces else None
                line = " ".join(w for w in words if w != "--trace" and not w.startswith("--trace="))
                return _run_as_experiment(self.shell, line, cell, trace=trace)
            words = line.split()
            if words == ["status"]:
                show(_core.snapshot(True))
            elif words in (["log", "on"], ["log", "all"]):
                _core.set_standalone_log(True, every_cell=words[1] == "all")
            elif words == ["log", "off"]:
                _core.set_standalone_log(False)
            else:
                raise UsageError(f"%gpuexp {line}: unknown command. Use one of:\n{USAGE}")

    return GpuexpMagics


def _unquoted(name):
    """``%%gpuexp "bs=64, lr=3e-4"``: the name inside the quotes, so that its params read."""
    if len(name) >= 2 and name[0] == name[-1] and name[0] in "'\"":
        return name[1:-1].strip()
    return name


def _ends_with_semicolon(ip, cell):
    """Whether the cell ends with `;`, which silences its last expression as in a plain cell."""
    try:
        return ip.displayhook.semicolon_at_end_of_expression(cell)
    except Exception:  # a cell the tokenizer rejects raised already, as a SyntaxError, in ast_parse
        return False


def _run_as_experiment(ip, line, cell, trace=None):
    tree = ip.compile.ast_parse(ip.transform_cell(cell))
    # The body starts on the cell's second line, below `%%gpuexp`: its line numbers say so.
    ast.increment_lineno(tree, 1)
    # Registered as the running cell's text, so that a traceback shows the user's lines.
    whole = f"%%gpuexp {line}\n{cell}"
    number = len(getattr(ip.history_manager, "input_hist_raw", [])) - 1
    filename = ip.compile.cache(whole, number if number > 0 else ip.execution_count, raw_code=whole)
    # The last expression is displayed as a plain cell's is (Out, `_`; not after a `;`), before
    # the experiment finishes: its teardown then clears those references to what it created.
    shows_last = tree.body and isinstance(tree.body[-1], ast.Expr) and not _ends_with_semicolon(ip, cell)
    last = tree.body.pop() if shows_last else None
    code = compile(tree, filename, "exec", flags=ip.compile.flags, dont_inherit=True)
    shown = last and compile(ast.Expression(last.value), filename, "eval", flags=ip.compile.flags, dont_inherit=True)
    experiment = GPUExperiment(_unquoted(line.strip()) or None, trace=trace)
    try:
        exec(code, ip.user_global_ns, ip.user_ns)
        if shown is not None:
            ip.displayhook(eval(shown, ip.user_global_ns, ip.user_ns))
    finally:
        experiment.finish()
