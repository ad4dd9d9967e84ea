"""How precise a bench's median is, for verdicts that noisy machines can't flip by chance."""

import statistics


def median_error(values):
    """The standard error of the median of `values`: 1.2533 σ / √n, with σ taken from the middle
    half's spread (IQR / 1.349), so that a stray slow run does not inflate it."""
    if len(values) < 2:
        return float("inf")
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return 1.2533 * (q3 - q1) / 1.349 / len(values) ** 0.5


def significantly_above(values, target):
    """Whether the median of `values` less two standard errors is over `target`."""
    if len(values) < 2:
        return statistics.median(values) > target
    return statistics.median(values) - 2 * median_error(values) > target
