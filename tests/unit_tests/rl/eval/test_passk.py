"""The unbiased pass@k estimator 1 - C(n-c, k) / C(n, k), against hand-computed values."""

from __future__ import annotations

from math import comb

import pytest

from megatron.rl.eval.passk import mean_pass_at_k, pass_at_k


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        pytest.param(8, 0, 1, 0.0, id="none-correct"),
        pytest.param(8, 8, 4, 1.0, id="all-correct"),
        pytest.param(8, 2, 1, 2 / 8, id="pass-at-1-is-the-fraction"),
        pytest.param(4, 1, 2, 1 - comb(3, 2) / comb(4, 2), id="n4-c1-k2"),  # 1 - 3/6 = 0.5
        pytest.param(5, 2, 2, 1 - comb(3, 2) / comb(5, 2), id="n5-c2-k2"),  # 1 - 3/10 = 0.7
        pytest.param(10, 3, 5, 1 - comb(7, 5) / comb(10, 5), id="n10-c3-k5"),  # 1 - 21/252
        pytest.param(4, 3, 2, 1.0, id="fewer-wrong-than-k"),
    ],
)
def test_pass_at_k(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_large_n_does_not_overflow():
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001)
    assert pass_at_k(1000, 10, 100) == pytest.approx(1 - comb(990, 100) / comb(1000, 100))


def test_mean_over_problems():
    assert mean_pass_at_k([0, 1, 4], 4, 2) == pytest.approx((0.0 + 0.5 + 1.0) / 3)


@pytest.mark.parametrize(
    "n, c, k",
    [
        pytest.param(4, 5, 1, id="c-above-n"),
        pytest.param(4, 1, 5, id="k-above-n"),
        pytest.param(4, 1, 0, id="k-zero"),
    ],
)
def test_invalid_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)
