"""Across ranks: every rank's latest report of an experiment in one table.

In each rank nothing changes: ``GPUExperiment(name)`` works as anywhere, and once
torch.distributed is initialised (or RANK and WORLD_SIZE are set) its finished report carries
the rank and is published to torch.distributed's own store. The gathering, the stores and the
table live in ``gpuexp._core``.
"""

import atexit
import os

from . import _core, ipython

STORE_ENV = "GPUEXP_RANKS_STORE"


def ranks(name=None, timeout=10.0):
    """The latest experiment called ``name`` (by default the latest of any name) from every rank.

    Works in the notebook that launched the ranks (from its store, which ranks find through
    ``GPUEXP_RANKS_STORE``) and in any rank (from that store, or without one, from the process
    group's). No collective is used: the store is polled, so a rank that died or hangs can't
    block anyone; one that has not reported after ``timeout`` seconds is named missing.

    Returns a ``Ranks``: a table with one row per rank (host, GPU, torch allocated and reserved
    peaks, NVML process peak, host RSS peak, OOMs, duration), then min, median and max, and flags
    for a peak more than 10% over the median, an OOM with its diagnosis, and missing ranks.
    ``.reports`` has one ``Report`` per rank in rank order (None where missing);
    ``.to_dict()``, ``.to_json()``, ``.to_pandas()``.
    """
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be an experiment's name such as 'train', got {type(name).__name__}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise ValueError(f"timeout must be a number of seconds, e.g. timeout=10; got {timeout!r}")
    return _core.ranks(name, float(timeout))


def host_ranks_store(address="127.0.0.1", port=0):
    """Hosts a TCPStore in this kernel for ranks to publish to, and names it in
    ``GPUEXP_RANKS_STORE`` for the processes it starts from now on. It listens on ``address``
    only: loopback unless you name another (``"0.0.0.0"`` for every interface; the store has no
    authentication, so only on a network you trust). Returns the address ranks on other machines
    set ``GPUEXP_RANKS_STORE`` to, e.g. ``tcp://127.0.0.1:40123``.
    """
    url = _core.host_ranks_store(address, port)
    os.environ[STORE_ENV] = url
    return url


def _name_the_kernel_store():
    """In a notebook kernel: a private directory (mode 0700) for the ranks it launches, named in
    the environment they inherit. Nothing listens anywhere. An existing setting is kept.
    Importing gpuexp never fails for want of that directory: ranks from the notebook are then
    off, and one note says why and how to fix it."""
    if STORE_ENV in os.environ or ipython.shell() is None:
        return
    try:
        os.environ[STORE_ENV] = _core.kernel_ranks_store()
    except (OSError, RuntimeError, ValueError) as error:
        ipython.warn(str(error))
        return
    atexit.register(_core.remove_kernel_ranks_store)


# The core's own hook sees every fork; this one forgets the bindings' state not yet kept per
# process (the registry, the open scopes' pins) in a child.
os.register_at_fork(after_in_child=_core.after_fork_in_child)
_name_the_kernel_store()
