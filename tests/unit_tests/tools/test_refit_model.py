"""The step-time model of ``tools/benchmarks/refit_model.py`` against hand-computed values."""

from __future__ import annotations

import pytest

from tools.benchmarks.refit_model import collocated, non_collocated, speedup


def test_the_slower_side_sets_the_non_collocated_pace_at_the_best_split():
    # 6 device-seconds of generation, 2 of training on 4 devices: 3 generate (2 s), 1 trains (2 s)
    assert non_collocated(6.0, 2.0, 0.5, 4) == (2.5, 3)
    assert collocated(6.0, 2.0, 0.5, 4) == pytest.approx(6.0 / 2 + 0.5)


@pytest.mark.parametrize(
    "g, u, refit, expected",
    [
        # 64 devices, split in whole devices: 44.8 device-seconds of generation and 19.2 of
        # training; 45 generate, 19 train (19.2 / 19 s): no gain, and the refit is a loss
        pytest.param(0.7, 1.0, 0.0, 19 / 19.2, id="no-tail-no-gain"),
        pytest.param(0.7, 1.0, 0.05, 1 / (19.2 / 19 + 0.05), id="no-tail-pays-the-refit"),
        # busy work 17.92 + 19.2 device-seconds: 31 generate, 33 train (19.2 / 33 s)
        pytest.param(0.7, 0.4, 0.0, 33 / 19.2, id="tail"),
        # 16 + 32 device-seconds: 21 generate (16 / 21 s), 43 train
        pytest.param(0.5, 0.5, 0.0, 21 / 16, id="half-tail"),
    ],
)
def test_the_speedup_comes_from_the_synchronous_tail(g, u, refit, expected):
    assert speedup(g, u, refit) == pytest.approx(expected, rel=2e-3)
