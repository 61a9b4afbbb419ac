"""Confidence intervals of an accuracy measured on a finite held-out set.

``wilson_interval(correct, n)`` is the Wilson score interval (Wilson 1927) of a binomial
proportion: the set of true accuracies p for which ``correct`` of ``n`` is not significant at the
chosen level under the normal approximation,

    (p_hat + z^2 / 2n  +/-  z sqrt(p_hat (1 - p_hat) / n + z^2 / 4n^2)) / (1 + z^2 / n),

with p_hat = correct / n. Unlike the textbook ``p_hat +/- z sqrt(p_hat (1 - p_hat) / n)`` it stays
inside [0, 1] and is not empty at 0 or n correct, which is where small evaluation sets often sit.
"""

from __future__ import annotations

import math

Z_95 = 1.959963984540054
"""The two-sided 95% quantile of the standard normal distribution."""


def wilson_interval(correct: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval (low, high) of ``correct`` successes out of ``n`` trials
    (``z = Z_95``: 95% confidence); ``n >= 1`` and ``0 <= correct <= n``."""
    if n < 1:
        raise ValueError(f"need n >= 1 trials, got {n}")
    if not 0 <= correct <= n:
        raise ValueError(f"need 0 <= correct <= n, got correct={correct}, n={n}")
    if z <= 0:
        raise ValueError(f"need z > 0, got {z}")
    p = correct / n
    z2 = z * z
    scale = 1.0 + z2 / n
    center = (p + z2 / (2 * n)) / scale
    half = z * math.sqrt(p * (1.0 - p) / n + z2 / (4 * n * n)) / scale
    low = 0.0 if correct == 0 else center - half  # exactly the bound there, without rounding
    high = 1.0 if correct == n else center + half
    return low, high
