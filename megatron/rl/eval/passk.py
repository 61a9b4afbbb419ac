"""The unbiased pass@k estimator (Chen et al. 2021, "Evaluating Large Language Models Trained on
Code"): with n samples of a problem of which c are correct,

    pass@k = 1 - C(n - c, k) / C(n, k)

is the probability that at least one of k samples drawn without replacement from the n is correct.
Computed as a product, ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``, which never forms the large
binomials.
"""

from __future__ import annotations

import statistics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct out of ``n`` samples (1 <= k <= n)."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(correct_counts: list[int], n: int, k: int) -> float:
    """pass@k averaged over problems, each with ``n`` samples and its own correct count."""
    if not correct_counts:
        raise ValueError("no problems")
    return statistics.fmean(pass_at_k(n, c, k) for c in correct_counts)
