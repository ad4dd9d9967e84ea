"""GPUs as the user names them (``0``, ``'cuda:1'``, ``'cuda'``, ``torch.device('cuda', 1)``), as torch indices."""

import sys


def device_indices(devices, argument="devices"):
    """Torch indices from an int, a 'cuda:N' string, a torch.device, or a list of them; None stays None.
    ``argument`` is the keyword the caller took them as, for the error."""
    if devices is None:
        return None
    given = devices
    if isinstance(devices, (int, str)) or hasattr(devices, "type") or not hasattr(devices, "__iter__"):
        devices = [devices]
    indices = []
    for device in devices:
        index = _device_index(device)
        if index is None:
            example = "[0, 1]" if argument == "devices" else "0"
            raise ValueError(
                f"{argument}={given!r}: use GPU indices as torch numbers them, "
                f"e.g. {argument}={example}, {argument}='cuda:1' or {argument}=torch.device('cuda', 1)"
            )
        if index in indices:
            raise ValueError(f"{argument}={given!r} names GPU {index} twice: name each GPU once, e.g. "
                             f"{argument}={sorted(set(indices))}")
        indices.append(index)
    return indices


# Past any index a machine gives a GPU: larger ones are refused as no GPU, never overflow.
_MOST_GPUS = 1 << 16


def _device_index(device):
    if isinstance(device, bool):
        return None
    if isinstance(device, int):
        return device if 0 <= device < _MOST_GPUS else None
    if isinstance(device, str):
        text = device.strip().lower()
        if text == "cuda":
            return _current_cuda_index()
        text = text[len("cuda:"):] if text.startswith("cuda:") else text
        return _device_index(int(text)) if text.isdigit() else None
    if getattr(device, "type", None) == "cuda":
        return _current_cuda_index() if device.index is None else device.index
    return None


def _current_cuda_index():
    """What torch means by a bare 'cuda': its current device, once it has initialised CUDA
    (asking earlier would initialise it); before that, the first GPU."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return cuda.current_device()
    return 0
