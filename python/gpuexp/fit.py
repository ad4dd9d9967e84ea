"""``gpuexp.fit``: what to change so a step fits. The step runs under fake tensors through
``estimate`` (nothing allocated, everything it reaches put back), once instrumented (what each
module saves for backward, its forward FLOPs) and once per option (checkpointing, autocast,
gradient accumulation, the optimizer's loop); the core (``rust/src/fit``) picks the checkpoint
plan and the micro-batch, ranks the options and shows them. This file only drives torch: module
hooks, saved-tensor hooks and the flop counter are torch's instrumentation, which is Python.
"""

import json
import sys
import time

from . import _core

__all__ = ["fit"]

_FUSABLE = ("Adam", "AdamW", "SGD", "Adagrad")


def fit(step, batch_size, *, limit=None, verify=False, device=None, model=None):
    """What to change so that ``step(batch_size)`` fits: its predicted peak against the budget
    (the device's free memory, or ``limit="24GiB"``), what makes it up by category and by module
    (the bytes each block saves for its backward), and the options ranked by what each saves,
    each predicted under fake tensors with its cost and the code that applies it: activation
    checkpointing of the blocks that make it fit at the least recompute, autocast to bfloat16,
    gradient accumulation, the optimizer without ``foreach`` temporaries, the largest batch that
    fits as the step is. Nothing is allocated, and the model, its gradients, the optimizer state,
    any GradScaler and the RNG are left exactly as they were.

    verify: also run the best option (or ``"checkpoint"``, ``"autocast"``) for one real step on
        the GPU, next to the step as it is, and show the predicted and measured peak and step
        time side by side; the state is restored bit for bit after each run.
    device: as for ``estimate``. model: the model whose blocks may be checkpointed; by default
        the largest module the step reaches.
    Returns a ``FitReport`` (tables in text and HTML, ``to_dict()``). Raises ``NoEstimate`` when
    the step itself can't run under fake tensors.
    """
    from . import _holder_memory
    from .experiment import count, size

    _core.check_step(step, "fit(train_step, 64)")
    count(batch_size, "batch_size", "fit(train_step, 64)")
    if verify not in (False, True, "checkpoint", "autocast"):
        raise ValueError(f"verify is True, False, 'checkpoint' or 'autocast'; got {verify!r}")
    limit = size(limit, "limit")  # bytes, as estimate takes it
    memory = _holder_memory(device)
    torch = sys.modules.get("torch")
    if torch is None:
        return _core.estimate(step, batch_size, memory=memory, limit=limit)  # raises: import torch first
    if verify and memory is None:
        raise ValueError("verify runs the option for one real step on a GPU, and this step runs on the host: "
                         "fit(..., verify=False)")
    started = time.perf_counter()
    reached = _Reached(step, torch, model)
    gathered = _Gathered(step, batch_size, memory, limit, reached, torch)
    found = gathered.gather()
    if verify:
        found["verified"] = _verify(step, batch_size, memory, limit, reached, gathered, verify)
    found["seconds"] = time.perf_counter() - started
    return _core.fit_report(json.dumps(found))


def finder_hint(step, wanted, limit, device, answer):
    """What ``find_batch_size`` says when its answer is below the batch wanted: which options
    raise it, and to about what (``fit`` at the batch wanted, nothing allocated)."""
    return fit(step, wanted, limit=limit, device=device).raises(answer)


class _Gathered:
    """The estimates fit runs, and what they found, as the core reads it."""

    def __init__(self, step, batch_size, memory, limit, reached, torch):
        self.step, self.batch_size, self.memory, self.limit = step, batch_size, memory, limit
        self.reached, self.torch = reached, torch
        self.found, self.peak_phase = {}, None

    def estimate(self, step, batch_size):
        self.found["estimates"] += 1
        return _core.estimate(_wrapped(step, self.step), batch_size, memory=self.memory, limit=self.limit).to_dict()

    def run(self, option, step, batch_size=None, **fields):
        """An option's estimate; its error, naming the operator, where it has none."""
        try:
            estimated = self.estimate(step, batch_size or self.batch_size)
        except _core.NoEstimate as error:
            self.found["runs"].append({"option": option, "peak": None, "error": str(error), **fields})
            return None
        run = {"option": option, "peak": estimated["peak"],
               "gradients_at_peak": estimated["categories"]["gradients"], **fields}
        self.found["runs"].append(run)
        return run

    def gather(self):
        torch, model = self.torch, self.reached.model
        probe = _Probe(torch, model)
        self.found = {"estimates": 0, "runs": [], "skipped": [], "notes": []}
        try:
            base = self.estimate(probe.run_step(self.step), self.batch_size)
        except _core.NoEstimate as error:
            raise _core.NoEstimate(
                f"{error}; fit predicts every option from this estimate, so it can't offer any: "
                "find_batch_size(step, estimate=False) finds the batch that fits by real trials"
            ) from error
        found, self.peak_phase = self.found, base["peak_phase"]
        found.update(
            batch_size=self.batch_size, device=base["device"], now=base["now"], fits=base["fits"],
            peak=base["peak"], categories=base["categories"], notes=list(base["notes"]),
            modules=probe.modules(), saves=probe.saves, step_flops=probe.step_flops,
            model=self.reached.model_seen(), optimizer=self.reached.optimizer_seen(),
            gradient_bytes=self.reached.gradient_bytes(), half=None, last_oom_cached=_last_oom_cached(),
            verified=None,
        )
        if self.batch_size >= 2:
            half = self.batch_size // 2
            try:
                estimated = self.estimate(self.step, half)
                found["half"] = {"batch_size": half, "peak": estimated["peak"],
                                 "gradients_at_peak": estimated["categories"]["gradients"]}
            except _core.NoEstimate as error:
                found["notes"].append(f"no estimate at batch size {half}: {error}")
        self.checkpointing()
        self.autocast()
        self.accumulation()
        self.foreach_off()
        return found

    def checkpointing(self):
        model = self.reached.model
        if model is None:
            self.found["skipped"].append(["checkpoint", "the step reaches no torch.nn.Module"])
            return
        from .fit_apply import checkpointed

        plan = _core.fit_checkpoint_plan(json.dumps(self.found), 0)
        if not plan["paths"]:
            self.found["skipped"].append(["checkpoint", "no block of the model saves more than its inputs"])
            return
        run = self.run("checkpoint", _checkpointing(self.step, checkpointed, model, plan["paths"]), paths=plan["paths"])
        budget = _budget(self.found)
        if run is None or budget is None or run["peak"] <= budget or not plan["enough"]:
            return
        # Under fake tensors the plan fell short of its prediction: one more try, saving the rest too.
        wider = _core.fit_checkpoint_plan(json.dumps(self.found), run["peak"] - budget)
        if wider["paths"] != plan["paths"]:
            self.found["runs"].remove(run)
            self.run("checkpoint", _checkpointing(self.step, checkpointed, model, wider["paths"]), paths=wider["paths"])

    def widen_checkpointing(self, stranded):
        """After the plan's real step ran out of memory with ``stranded`` bytes reserved but
        unallocated (fragmentation, which fake tensors can't see): the core's plan that saves that
        much more, estimated in place of the plan. Whether there was a wider one."""
        from .fit_apply import checkpointed

        run = next(r for r in self.found["runs"] if r["option"] == "checkpoint")
        budget = _budget(self.found)
        short = 0 if budget is None or run["peak"] is None else max(run["peak"] - budget, 0)
        wider = _core.fit_checkpoint_plan(json.dumps(self.found), short + stranded)
        if not wider["paths"] or set(wider["paths"]) <= set(run["paths"]):
            return False
        runs = self.found["runs"]
        runs.remove(run)
        model = self.reached.model
        if self.run("checkpoint", _checkpointing(self.step, checkpointed, model, wider["paths"]),
                    paths=wider["paths"]) is None:
            # No estimate of the wider plan (its refusal is in the last run): the plan stays.
            runs[-1] = run
            return False
        return True

    def autocast(self):
        dtype = self.reached.model_seen()["dtype"] if self.reached.model is not None else "float32"
        if dtype != "float32":
            self.found["skipped"].append(["autocast", f"the model's parameters are {dtype} already"])
            return
        device_type = "cpu" if self.memory is None else "cuda"
        self.run("autocast", _autocasting(self.step, self.torch, device_type))

    def accumulation(self):
        plan = _core.fit_accumulation(json.dumps(self.found))
        if plan is None:
            reason = "no micro-batch that divides the batch fits" if self.found["half"] else "no second estimate"
            self.found["skipped"].append(["accumulate", reason])
            return
        # The step's peak at the micro-batch from the estimates already made (at bs/2, or the
        # line through bs/2 and bs): no estimate of its own, so that fit stays within 8.
        self.found["runs"].append({"option": "accumulate", "peak": plan["step_peak"],
                                   "micro_batch": plan["micro_batch"], "gradients_at_peak": plan["gradients_at_peak"]})

    def foreach_off(self):
        optimizer = self.reached.optimizer
        if optimizer is None or not self.reached.optimizer_seen()["foreach"]:
            return
        if self.peak_phase != "optimizer":
            # foreach=False changes only the optimizer's step, and the step peaks outside it: the
            # option's peak is the step's own, exactly, with no estimate of its own.
            self.found["runs"].append({"option": "foreach_off", "peak": self.found["peak"],
                                       "gradients_at_peak": self.found["categories"]["gradients"]})
            return
        self.run("foreach_off", _foreach_off(self.step, optimizer))


def _budget(found):
    """The bytes the peak may reach, as the core reads the estimate's answers."""
    rooms = [fit["room"] + found["peak"] - fit["needed"] for fit in found["fits"]]
    return min(rooms) if rooms else None


def _wrapped(step, original):
    """``step`` as estimate walks it: ``__wrapped__`` leads to the user's step, whose closure and
    globals estimate swaps and puts back."""
    if step is not original:
        step.__wrapped__ = original
    return step


def _checkpointing(step, checkpointed, model, paths):
    def checkpointing_step(batch_size):
        with checkpointed(model, paths):
            return step(batch_size)

    return checkpointing_step


def _foreach_off(step, optimizer):
    """``step`` with the optimizer's per-tensor loop. Set inside the step, so that the estimate's
    one state saving puts the param groups back after it, as it does whatever a step changes."""

    def foreach_off_step(batch_size):
        for group in optimizer.param_groups:
            group["foreach"] = False
        return step(batch_size)

    return foreach_off_step


def _autocasting(step, torch, device_type):
    def autocasting_step(batch_size):
        with torch.autocast(device_type, dtype=torch.bfloat16):
            return step(batch_size)

    return autocasting_step


class _Probe:
    """What the instrumented estimate records: per module of the model its inputs' storages and
    forward FLOPs, and every tensor autograd saves with the module whose forward saved it.
    Estimate puts back every container it reaches from the step after it, but passes over
    gpuexp's own objects (``step_state.rs``'s walk), so the records outlive it."""

    __slots__ = ("torch", "paths", "stack", "saves", "inputs", "flops", "started", "counter", "skip", "step_flops",
                 "model")

    def __init__(self, torch, model):
        self.torch, self.model = torch, model
        self.paths = {} if model is None else {id(m): p for p, m in model.named_modules()}
        self.stack, self.saves, self.inputs, self.flops, self.started = [], [], {}, {}, {}
        self.counter, self.skip, self.step_flops = None, set(), 0

    def run_step(self, step):
        probe = self

        def instrumented_step(batch_size):
            return probe.run(step, batch_size)

        return instrumented_step

    def run(self, step, batch_size):
        torch = self.torch
        from torch.utils.flop_counter import FlopCounterMode

        modules = torch.nn.modules.module
        if self.model is not None:
            # The fakes estimate swapped in: tensors the step saves that are weights are no activations.
            held = [*self.model.parameters(), *self.model.buffers()]
            self.skip = {id(t.untyped_storage()) for t in held}
        hooks = [modules.register_module_forward_pre_hook(self.entered),
                 modules.register_module_forward_hook(self.left)]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, _unpacked):
                with FlopCounterMode(display=False) as counter:
                    self.counter = counter
                    return step(batch_size)
        finally:
            for hook in hooks:
                hook.remove()
            self.step_flops = self.counter.get_total_flops() if self.counter is not None else 0
            self.counter = None

    def total_flops(self):
        return self.counter.get_total_flops() if self.counter is not None else 0

    def entered(self, module, args):
        path = self.paths.get(id(module))
        if path is None:
            return
        self.stack.append(path)
        tensors = [a for a in args if isinstance(a, self.torch.Tensor)]
        self.inputs[path] = [[id(t.untyped_storage()), t.untyped_storage().nbytes()] for t in tensors]
        self.started[path] = self.total_flops()

    def left(self, module, args, output):
        path = self.paths.get(id(module))
        if path is None or not self.stack or self.stack[-1] != path:
            return
        self.stack.pop()
        self.flops[path] = self.flops.get(path, 0) + self.total_flops() - self.started.pop(path, 0)

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        if id(storage) not in self.skip:
            self.saves.append({"storage": id(storage), "bytes": storage.nbytes(),
                               "path": self.stack[-1] if self.stack else ""})
        return tensor

    def modules(self):
        if self.model is None:
            return []
        return [{"path": path, "class": type(module).__name__, "parent": any(True for _ in module.children()),
                 "parameters": sum(p.numel() * p.element_size() for p in module.parameters()),
                 "forward_flops": self.flops.get(path, 0), "inputs": self.inputs.get(path, [])}
                for path, module in self.model.named_modules()]


def _unpacked(tensor):
    return tensor


class _Reached:
    """The model, optimizer and GradScalers the step reaches: from its closure, the globals its
    code loads, a bound method's object, a partial's arguments, each with the name it goes by."""

    def __init__(self, step, torch, model=None):
        self.torch = torch
        self.modules, self.optimizers, self.scalers = {}, {}, {}
        self._walk(step)
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, e.g. fit(step, 64, model=net); got {model!r}")
        if model is None and self.modules:
            model = max(self.modules.values(), key=lambda m: sum(p.numel() for p in m.parameters()))
        self.model = model
        self.model_name = next((n for n, m in self.modules.items() if m is model), "model")
        self.optimizer = next(iter(self.optimizers.values()), None)

    def _consider(self, name, value, depth=0):
        torch = self.torch
        if isinstance(value, torch.nn.Module):
            if all(value is not m for m in self.modules.values()):
                self.modules[name] = value
        elif isinstance(value, torch.optim.Optimizer):
            self.optimizers.setdefault(name, value)
        elif type(value).__name__ == "GradScaler":
            self.scalers.setdefault(name, value)
        elif depth == 0 and not callable(value) and isinstance(getattr(value, "__dict__", None), dict):
            for attribute, inner in list(vars(value).items()):
                self._consider(f"{name}.{attribute}", inner, depth + 1)

    def _walk(self, step):
        """Classifies the roots of the one walk of what a step reaches (``step_roots``)."""
        from .step_roots import step_roots

        roots, _, _ = step_roots(step)
        for name, value in roots:
            if name == "step.args":
                for index, argument in enumerate(value or ()):
                    self._consider(f"args[{index}]", argument)
            elif name == "step":
                if isinstance(value, self.torch.nn.Module):
                    self._consider(name, value)
            elif not isinstance(value, type):
                self._consider(name, value)

    def model_seen(self):
        model = self.model
        if model is None:
            return None
        dtypes = {}
        for parameter in model.parameters():
            dtypes[parameter.dtype] = dtypes.get(parameter.dtype, 0) + parameter.numel()
        dtype = max(dtypes, key=dtypes.get) if dtypes else self.torch.float32
        switch = None
        if callable(getattr(model, "gradient_checkpointing_enable", None)):
            switch = f"{self.model_name}.gradient_checkpointing_enable()"
        return {"name": self.model_name, "class": type(model).__name__, "library_switch": switch,
                "dtype": str(dtype).removeprefix("torch.")}

    def optimizer_seen(self):
        optimizer = self.optimizer
        if optimizer is None:
            return None
        torch = self.torch
        choose = sys.modules["torch.optim.optimizer"]._default_to_fused_or_foreach
        state = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor))
        params = [p for group in optimizer.param_groups for p in group["params"]]
        foreach = False
        for group in optimizer.param_groups:
            if group.get("fused"):
                continue
            chosen = group.get("foreach")
            if chosen is None:
                chosen = choose(group["params"], bool(group.get("differentiable")))[1]
            foreach = foreach or bool(chosen)
        name = next(n for n, o in self.optimizers.items() if o is optimizer)
        return {"name": name, "class": type(optimizer).__name__, "state_bytes": state,
                "parameter_bytes": sum(p.numel() * p.element_size() for p in params), "foreach": foreach,
                "fusable": type(optimizer).__name__ in _FUSABLE}

    def gradient_bytes(self):
        if self.model is None:
            return 0
        return sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)


def _last_oom_cached():
    """Torch's reserved-but-unallocated bytes at the last out-of-memory error the rescue saw."""
    from . import extension

    diagnosis = getattr(extension, "last_oom", None)
    if diagnosis is None:
        return None
    found = diagnosis.to_dict()
    reserved, allocated = found.get("torch_reserved_before"), found.get("torch_allocated_before")
    return None if reserved is None or allocated is None else max(reserved - allocated, 0)


def _verify(step, batch_size, memory, limit, reached, gathered, which):
    """The chosen option for one real step, then the step as it is (``fit_apply.verify``), with
    the checkpointed blocks' forwards timed in it for the core's prediction of the recompute.
    A checkpointing plan whose step runs out of memory with bytes stranded by fragmentation is
    widened once by them (``_Gathered.widen_checkpointing``), and the wider plan is what runs."""
    from .fit_apply import verify

    found = gathered.found
    kinds = ("checkpoint", "autocast") if which is True else (which,)
    chosen = _chosen(found, kinds)
    if chosen is None:
        found["notes"].append(f"verify: no {' or '.join(kinds)} option was estimated, so none ran")
        return None
    state = dict(modules=reached.modules, optimizers=reached.optimizers, scalers=reached.scalers, device=memory)
    measured, widened = _verify_option(verify, step, batch_size, limit, reached, chosen, state), None
    if chosen["option"] == "checkpoint" and measured.out_of_memory and measured.stranded:
        first = chosen
        if gathered.widen_checkpointing(measured.stranded):
            chosen = _chosen(found, ("checkpoint",))
            widened = {"paths": first["paths"], "stranded": measured.stranded}
            measured = _verify_option(verify, step, batch_size, limit, reached, chosen, state)
    # The step as it is, with the checkpointed blocks' forwards timed in it: what their recompute costs.
    paths = chosen.get("paths", [])
    as_is = verify(step, batch_size, "as_is", time_forwards=(reached.model, paths) if paths else None, **state)
    found["notes"].extend(f"verify: {note}" for note in [*as_is.notes, *measured.notes])
    return {"option": chosen["option"], "predicted_peak": chosen["peak"], "measured_peak": measured.peak or 0,
            "baseline_peak": None if as_is.out_of_memory else as_is.peak, "seconds": measured.seconds,
            "baseline_seconds": None if as_is.out_of_memory else as_is.seconds,
            "forward_seconds": as_is.forward_seconds or {}, "error": measured.out_of_memory,
            "stranded": measured.stranded, "paths": paths, "widened": widened}


def _chosen(found, kinds):
    """The best option of ``kinds`` the core ranks, one that fits first; None where none was estimated."""
    report = json.loads(_core.fit_report(json.dumps({**found, "seconds": 0})).to_json())
    options = [o for o in report["options"] if o["option"] in kinds and o["peak"] is not None]
    return next((o for o in options if o["fits"]), options[0] if options else None)


def _verify_option(verify, step, batch_size, limit, reached, chosen, state):
    if chosen["option"] == "checkpoint":
        option = {"kind": "checkpoint", "model": reached.model, "paths": chosen["paths"]}
    else:
        option = {"kind": "autocast", "dtype": "bfloat16"}
    return verify(step, batch_size, option, limit=limit, **state)
