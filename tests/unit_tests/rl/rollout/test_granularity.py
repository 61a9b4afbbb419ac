"""The streaming arithmetic against hand-computed values: Megatron-LM's gate capacity (Python's
round, half to even), the lag from an in-flight limit or the engine's slots, each group's
staleness, and the refused (submission, consumption) pairs."""

from __future__ import annotations

import pytest

from megatron.rl.rollout.granularity import (
    autotuned_lag,
    gate_capacity,
    group_staleness,
    lag_from_inflight,
    pair_problems,
    units_per_batch,
)


@pytest.mark.parametrize(
    "lag, units, capacity",
    [
        pytest.param(0, 8, 8, id="lag-0-groups"),
        pytest.param(2, 1, 3, id="lag-2-batches"),
        pytest.param(0.5, 8, 12, id="half-a-batch-more"),
        pytest.param(0.5, 1, 2, id="1.5-rounds-to-2"),
        pytest.param(1.5, 1, 2, id="2.5-rounds-half-to-even"),
        pytest.param(0.25, 2, 2, id="2.5-groups-to-2"),
        pytest.param(-1, 8, 1, id="minus-1-one-unit"),
        pytest.param(-0.99, 8, 1, id="at-least-one"),
        pytest.param(19, 4, 80, id="megatron-lm-lag-19"),
    ],
)
def test_gate_capacity(lag, units, capacity):
    assert gate_capacity(lag, units) == capacity


def test_a_lag_below_minus_1_is_refused():
    with pytest.raises(ValueError, match=">= -1"):
        gate_capacity(-1.5, 8)


def test_units_per_batch():
    assert [units_per_batch(g, 8, 4) for g in ("B", "G", "R")] == [1, 8, 32]


@pytest.mark.parametrize(
    "inflight, groups, size, lag",
    [
        pytest.param(64, 8, 8, 0.0, id="one-batch"),
        pytest.param(96, 8, 8, 0.5, id="one-and-a-half"),
        pytest.param(8, 8, 8, -0.875, id="one-group"),
    ],
)
def test_lag_from_inflight(inflight, groups, size, lag):
    assert lag_from_inflight(inflight, groups, size) == lag


@pytest.mark.parametrize(
    "slots, groups, size, lag",
    [
        pytest.param(64, 8, 8, 0.0, id="a-batch-of-slots"),
        pytest.param(16, 2, 2, 3.0, id="four-batches"),
        pytest.param(320, 8, 8, 4.0, id="lag-sweep-engine"),
        pytest.param(4, 8, 8, -0.875, id="fewer-slots-than-a-group-still-one-group"),
    ],
)
def test_autotuned_lag(slots, groups, size, lag):
    assert autotuned_lag(slots, groups, size) == lag


@pytest.mark.parametrize(
    "u, capacity, groups, staleness",
    [
        pytest.param(3, 12, 8, 0, id="first-batch"),
        pytest.param(8, 12, 8, 1, id="submitted-at-start"),
        pytest.param(12, 12, 8, 1, id="after-group-0"),
        pytest.param(16, 12, 8, 2, id="after-group-4"),
        pytest.param(20, 12, 8, 1, id="after-group-8"),
        pytest.param(9, 1, 8, 0, id="one-in-flight-same-batch"),
        pytest.param(8, 1, 8, 1, id="one-in-flight-next-batch"),
    ],
)
def test_group_staleness(u, capacity, groups, staleness):
    assert group_staleness(u, capacity, groups) == staleness


@pytest.mark.parametrize(
    "sub, con, partial, problem",
    [
        pytest.param("B", "B", False, None, id="B/B"),
        pytest.param("G", "G", True, None, id="G/G"),
        pytest.param("G", "B", True, None, id="G/B"),
        pytest.param("G", "G", False, "needs --rl-partial-rollouts", id="G-without-partial"),
        pytest.param("B", "G", False, "finer than --rl-submission-granularity B", id="B/G"),
        pytest.param("G", "R", True, "R is not supported", id="R-consumption"),
        pytest.param("R", "G", True, "R is not implemented here yet", id="R/G"),
    ],
)
def test_pair_problems(sub, con, partial, problem):
    problems = pair_problems(sub, con, partial)
    assert problems == [] if problem is None else any(problem in p for p in problems)
