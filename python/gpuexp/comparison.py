"""Draws ``gpuexp.compare(...).plot()``: the core decides what is shown (each layer's peaks
against a param, the levels, the fit); matplotlib draws it."""

GIB = 1 << 30


def draw(spec):
    """A matplotlib Figure of a comparison's plot (``Comparison.plot`` computes ``spec``). It is
    closed in pyplot, so a notebook shows it once, as the cell's result, and only then."""
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.8))
    for series in spec["series"]:
        axes.plot(series["x"], [y / GIB for y in series["y"]], marker="o", label=series["label"])
    for level, style in zip(spec["levels"], ("--", "-.", ":", (0, (5, 1)))):
        axes.axhline(level["y"] / GIB, color="tab:red", linestyle=style, linewidth=1, label=level["label"])
    fit = spec["fit"]
    if fit is not None:
        axes.plot(fit["x"], [y / GIB for y in fit["y"]], color="tab:gray", linestyle=":", label=fit["label"])
        if fit["largest"] is not None and fit["largest"] <= fit["x"][1]:
            axes.axvline(fit["largest"], color="tab:gray", linewidth=0.8)
    axes.set_xlabel(spec["x"])
    axes.set_ylabel("peak (GiB)")
    axes.set_ylim(bottom=0)
    axes.set_title(spec["title"])
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small", loc="best")
    if spec["notes"]:
        figure.text(0.01, 0.01, "\n".join(spec["notes"]), fontsize="x-small", va="bottom")
        figure.tight_layout(rect=(0, 0.04 * len(spec["notes"]), 1, 1))
    else:
        figure.tight_layout()
    plt.close(figure)
    return figure
