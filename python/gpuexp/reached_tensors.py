"""The real tensors an estimate's step reaches outside the model and its optimizers (a lookup
table, a step counter, a metric's running sum, an EMA copy), swapped for fakes while the step
runs, so that nothing is computed on them and nothing changes them.

Which containers and places hold them is the core's walk (``rust/src/step_state.rs``, through
``rust/src/bindings/instrumentation/step_state.rs``), which saved them before and puts them back,
the real tensors with them, after the step; this only swaps torch's tensors in, which is torch
instrumentation, so Python. Torch is imported already when these run.
"""

import sys


def fake_reached_tensors(mode, dicts, lists, places):
    """Swaps every real tensor the step reaches for a fake of ``mode``: those in the containers
    the estimate saved (a GradScaler's scale, an EMA copy, a metric, a lookup table), ``dicts``
    and ``lists`` by their items, and those held by the globals the step loads and its closure
    cells, ``places`` as ``(namespace, name)`` or ``(cell, None)``. Given to the fake mode as they
    are, they would be computed with for real (a CPU table multiplied, a counter's ``add_`` run).
    A tensor that requires grad is left: it is a parameter the model's fakes stand for, and one
    the walk did not find stops the estimate. A scalar on the host becomes a fake holding a copy
    of its value, so ``.item()`` still reads it. Each holder was saved by the core before, and is
    put back, the real tensor in it, with the rest of the saved state."""
    torch = sys.modules["torch"]
    tensor = torch.Tensor
    from torch._subclasses.fake_tensor import FakeTensor

    fakes = {}  # id of a real tensor: its fake, so a tensor held twice stays one

    def fake_of(value):
        if not isinstance(value, tensor) or isinstance(value, FakeTensor) or value.requires_grad:
            return None
        fake = fakes.get(id(value))
        if fake is None:
            if value.numel() <= 1 and value.device.type == "cpu":
                converter = mode.fake_tensor_converter
                fake = converter.from_real_tensor(mode, value.clone(), make_constant=True)
            else:
                fake = mode.from_tensor(value)
            fakes[id(value)] = fake
        return fake

    for container in dicts:
        for key, value in list(container.items()):
            fake = fake_of(value)
            if fake is not None:
                container[key] = fake
    for container in lists:
        for index, value in enumerate(container):
            fake = fake_of(value)
            if fake is not None:
                container[index] = fake
    for holder, name in places:
        if name is None:
            fake = fake_of(getattr(holder, "cell_contents", None))
            if fake is not None:
                holder.cell_contents = fake
        elif name in holder:
            fake = fake_of(holder[name])
            if fake is not None:
                holder[name] = fake
