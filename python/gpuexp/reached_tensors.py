"""The real tensors an estimate's step reaches outside the model and its optimizers (a lookup
table, a step counter, a metric's running sum, an EMA copy), swapped for fakes while the step
runs and put back after it, so that nothing is computed on them and nothing changes them.

Which containers and places hold them is the core's walk (``rust/src/step_state.rs``, through
``rust/src/bindings/instrumentation/step_state.rs``); this only swaps torch's tensors, which is
torch instrumentation, so Python. Torch is imported already when these run.
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
    of its value, so ``.item()`` still reads it. Returns ``(holder, key, real)`` for each swap,
    for ``put_back_reached``; the containers are also put back with the rest of the saved state."""
    torch = sys.modules["torch"]
    tensor = torch.Tensor
    from torch._subclasses.fake_tensor import FakeTensor

    fakes = {}  # id of a real tensor: its fake, so a tensor held twice stays one
    swapped = []

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

    def swap(holder, key, value, put):
        fake = fake_of(value)
        if fake is not None:
            put(fake)
            swapped.append((holder, key, value))

    for container in dicts:
        for key, value in list(container.items()):
            swap(container, key, value, lambda fake, c=container, k=key: c.__setitem__(k, fake))
    for container in lists:
        for index, value in enumerate(container):
            swap(container, index, value, lambda fake, c=container, i=index: c.__setitem__(i, fake))
    for holder, name in places:
        if name is None:
            value = getattr(holder, "cell_contents", None)
            swap(holder, None, value, lambda fake, h=holder: setattr(h, "cell_contents", fake))
        elif name in holder:
            swap(holder, name, holder[name], lambda fake, h=holder, n=name: h.__setitem__(n, fake))
    return swapped


def put_back_reached(swapped):
    """Puts back each real tensor ``fake_reached_tensors`` swapped out, where its fake still is
    (what the step rebound is the saved containers' to put back). Everything is tried before the
    first error met is raised."""
    errors = []
    for holder, key, real in reversed(swapped):
        try:
            if key is None:
                holder.cell_contents = real
            else:
                holder[key] = real
        except Exception as error:  # noqa: BLE001  (raised below, once the rest is back)
            errors.append(error)
    if errors:
        raise errors[0]
