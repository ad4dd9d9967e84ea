"""A timeline of the host and every visible GPU, recorded by a native thread (``gpuexp._core``)."""

import json

from . import _core
from .files import save_figure


def seconds(interval):
    """Seconds from 0.1, "100ms", "1s" or "2min" (a number is seconds); ValueError naming the fix otherwise."""
    return _core.parse_interval(interval)


class Monitor:
    """Records host CPU %, RSS and available memory, and for each visible GPU its utilisation,
    memory used, this process's memory, temperature and power, every ``interval``.

    ``path`` ending in ``.jsonl`` or ``.csv`` gets every sample as it is taken (flushed, so a
    crash loses at most one interval). Use it as ``with Monitor(...) as mon:`` or with
    ``start()`` and ``stop()``. The thread never takes the GIL. ``gpus=False`` records the host
    only.
    """

    def __init__(self, interval="100ms", path=None, *, gpus=True):
        self.interval = seconds(interval)
        """Seconds between samples."""
        self.path = None if path is None else str(path)
        """The file (``.jsonl`` or ``.csv``) each sample is also written to as it is taken; None: none."""
        _core.Monitor.check(self.interval, self.path)  # a bad path fails here, not at start()
        self.gpus = gpus
        """False: the host only."""
        self._native = None
        self._samples = None

    def start(self):
        """Starts recording on a native thread; returns the monitor. RuntimeError if it runs already."""
        if self._native is not None and self._native.running:
            raise RuntimeError("this monitor is already running: stop() it first")
        self._samples = None
        self._native = _core.Monitor(self.interval, self.path, self.gpus)
        return self

    def stop(self):
        """Stops recording and keeps the samples; returns the monitor. OSError if writing to
        ``path`` failed."""
        if self._native is not None:
            self._native.stop()
            self._samples = json.loads(self._native.samples_json())
            failure = self._native.failure
            self._native = None
            if failure:
                raise OSError(failure)
        return self

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info):
        self.stop()
        return False

    def samples(self):
        """Every sample so far, oldest first, as dicts (sizes in bytes, times in seconds)."""
        if self._native is not None:
            return json.loads(self._native.samples_json())
        return list(self._samples or [])

    def to_pandas(self):
        """One row per sample, one column per figure (``gpu0_used``, ``gpu0_utilization``, …)."""
        import pandas

        return pandas.DataFrame([_flat(sample) for sample in self.samples()])

    def plot(self, path=None, title="gpuexp monitor"):
        """One figure: memory used and utilisation over time per GPU, and host RSS."""
        return plot_samples(self.samples(), path=path, title=title)


def _flat(sample):
    row = {key: value for key, value in sample.items() if key != "gpus"}
    for i, gpu in enumerate(sample["gpus"]):
        for key, value in gpu.items():
            row[f"gpu{i}_{key}"] = value
    return row


def plot_samples(samples, path=None, title="gpuexp monitor"):
    """A matplotlib figure of a timeline; saved to ``path`` when one is given."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    gib = 1 << 30
    t = [s["t"] for s in samples]
    gpu_count = len(samples[0]["gpus"]) if samples else 0
    figure, axes = plt.subplots(gpu_count + 1, 1, figsize=(9, 2.6 * (gpu_count + 1)), sharex=True, squeeze=False)
    for i in range(gpu_count):
        memory_axis = axes[i][0]
        memory_axis.plot(t, [(s["gpus"][i]["used"] or 0) / gib for s in samples], label="device used")
        memory_axis.plot(t, [(s["gpus"][i]["process_used"] or 0) / gib for s in samples], label="this process")
        memory_axis.set_ylabel(f"GPU {i} GiB")
        utilization_axis = memory_axis.twinx()
        utilization = [s["gpus"][i]["utilization"] or 0 for s in samples]
        utilization_axis.plot(t, utilization, color="tab:green", alpha=0.5, label="utilisation")
        utilization_axis.set_ylim(0, 105)  # a busy GPU's 100% stays visible, not on the frame
        utilization_axis.set_ylabel("utilisation %")
        lines = memory_axis.get_lines() + utilization_axis.get_lines()
        memory_axis.legend(lines, [line.get_label() for line in lines], loc="upper left")
    host_axis = axes[gpu_count][0]
    host_axis.plot(t, [s["rss"] / gib for s in samples], color="tab:purple", label="host RSS")
    host_axis.set_ylabel("host RSS GiB")
    host_axis.set_xlabel("seconds")
    host_axis.legend(loc="upper left")
    figure.suptitle(title)
    figure.tight_layout()
    if path is not None:
        save_figure(figure, path, dpi=110)
    return figure
