"""A traced experiment's timeline drawn with matplotlib (imported only when asked): torch
allocated over time stacked by its top sites, the peak marked. The data and the inline SVG come
from the core; this only draws."""

from .files import save_figure


def figure(devices, title, path=None):
    """One panel per GPU from ``Timeline.to_dict()``; saved to ``path`` when given."""
    try:
        import matplotlib.pyplot as plt
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError("Timeline.figure() draws with matplotlib: pip install matplotlib") from error
    fig, axes = plt.subplots(len(devices), 1, figsize=(9, 3.2 * len(devices)), squeeze=False)
    gib = float(1 << 30)
    for ax, device in zip(axes[:, 0], devices):
        series = device["series"]
        ax.stackplot(device["x"], [[v / gib for v in s["y"]] for s in series], labels=[s["label"] for s in series])
        ax.plot(device["x"], [v / gib for v in device["total"]], color="black", linewidth=0.8, label="allocated")
        point = device.get("peak_point")
        if point is not None:
            ax.annotate("peak", (device["x"][point], device["total"][point] / gib), xytext=(0, 6),
                        textcoords="offset points", ha="center")
        ax.set_title(f"{title} · cuda:{device['device']}")
        ax.set_xlabel(device["x_label"])
        ax.set_ylabel("GiB")
        ax.legend(fontsize="small", loc="upper left")
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path)
    return fig
