"""The Wilson score interval of an accuracy, against values computed by hand.

With z = 1.959964 (z^2 = 3.841459) the interval of c correct out of n is
(p + z^2/2n +/- z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n), p = c/n; each case below writes out
its center and half-width.
"""

from __future__ import annotations

import pytest

from megatron.rl.eval.confidence import Z_95, wilson_interval


@pytest.mark.parametrize(
    "correct, n, low, high",
    [
        # 1 + z^2/10 = 1.384146; center (0.5 + 0.192073) / 1.384146 = 0.5;
        # half 1.959964 x sqrt(0.025 + 0.009604) / 1.384146 = 0.263407
        pytest.param(5, 10, 0.236593, 0.763407, id="half-of-10"),
        # center = half = 0.192073 / 1.384146 = 0.138767: (0, 0.277533), never below 0
        pytest.param(0, 10, 0.0, 0.277533, id="none-of-10"),
        pytest.param(10, 10, 0.722467, 1.0, id="all-of-10"),
        # 1 + z^2 = 4.841459; center 2.920729 / 4.841459 = 0.603275;
        # half 1.959964 x sqrt(3.841459 / 4) / 4.841459 = 0.396725
        pytest.param(1, 1, 0.206549, 1.0, id="one-of-one"),
        pytest.param(0, 1, 0.0, 0.793451, id="none-of-one"),
        # 1 + z^2/4 = 1.960365; center (0.75 + 0.480182) / 1.960365 = 0.627528;
        # half 1.959964 x sqrt(0.046875 + 0.060023) / 1.960365 = 0.326886
        pytest.param(3, 4, 0.300642, 0.954413, id="three-of-four"),
        # 1 + z^2/20 = 1.192073; center (0.35 + 0.096036) / 1.192073 = 0.374169;
        # half 1.959964 x sqrt(0.011375 + 0.002401) / 1.192073 = 0.192977
        pytest.param(7, 20, 0.181192, 0.567146, id="seven-of-twenty"),
    ],
)
def test_wilson_interval_matches_hand_computed_values(correct, n, low, high):
    got = wilson_interval(correct, n)
    assert got == pytest.approx((low, high), abs=1e-6)
    assert 0.0 <= got[0] <= correct / n <= got[1] <= 1.0


def test_the_interval_narrows_with_more_trials_around_the_same_share():
    widths = [hi - lo for lo, hi in (wilson_interval(n // 2, n) for n in (4, 16, 64, 256))]
    assert widths == sorted(widths, reverse=True)
    assert widths[-1] == pytest.approx(2 * Z_95 * (0.25 / 256) ** 0.5, rel=0.01)  # ~ Wald's


def test_a_smaller_z_gives_a_narrower_interval():
    low, high = wilson_interval(3, 10, z=1.0)
    wide_low, wide_high = wilson_interval(3, 10)
    assert wide_low < low < 0.3 < high < wide_high


@pytest.mark.parametrize(
    "correct, n, z, needle",
    [
        pytest.param(0, 0, Z_95, "n >= 1", id="no-trials"),
        pytest.param(5, 4, Z_95, "correct <= n", id="more-correct-than-trials"),
        pytest.param(-1, 4, Z_95, "correct <= n", id="negative-correct"),
        pytest.param(1, 4, 0.0, "z > 0", id="zero-z"),
    ],
)
def test_invalid_counts_are_refused(correct, n, z, needle):
    with pytest.raises(ValueError, match=needle):
        wilson_interval(correct, n, z)
