"""Which tensors torch's modules and optimizers hold, read from their own containers.

The leak hunter (``bindings/api/holders.rs``) asks this for the modules and optimizers its walk
reached; the core then says what each storage is to training (``report::Role``) and sums them.
Torch is never imported here: without it there is nothing to read.
"""

from __future__ import annotations

import sys
from typing import Any


def owned_tensors(owners: list[Any]) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    """The tensors ``owners`` hold directly: their parameters, buffers, gradients and optimizer
    state, in that order. A module's are its own (``_parameters``, ``_buffers``), not its
    children's: each child module is an owner of its own."""
    parameters: list[Any] = []
    buffers: list[Any] = []
    gradients: list[Any] = []
    state: list[Any] = []
    torch = sys.modules.get("torch")
    if torch is None:
        return parameters, buffers, gradients, state

    def parameter(value: Any) -> None:
        parameters.append(value)
        gradients.append(getattr(value, "grad", None))

    for owner in owners:
        own_parameters = getattr(owner, "_parameters", None)
        own_buffers = getattr(owner, "_buffers", None)
        if own_parameters is not None and own_buffers is not None:
            for value in own_parameters.values():
                parameter(value)
            buffers.extend(own_buffers.values())
            continue
        for group in owner.param_groups:
            for value in group.get("params", ()):
                parameter(value)
        for values in owner.state.values():
            if isinstance(values, dict):
                state.extend(values.values())

    def tensors(values: list[Any]) -> list[Any]:
        return [value for value in values if isinstance(value, torch.Tensor)]

    return tensors(parameters), tensors(buffers), tensors(gradients), tensors(state)
