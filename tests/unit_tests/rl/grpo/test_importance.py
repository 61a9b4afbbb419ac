"""Truncated importance weights and the train/inference mismatch sums, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.rl.grpo.importance import (
    ImportanceConfig,
    importance_weights,
    mismatch_metrics,
    mismatch_sums,
)


def named(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """The sums without their ``is/`` prefix, as floats."""
    return {k.removeprefix("is/"): float(v) for k, v in sums.items()}


def logs(*probs):
    return torch.log(torch.tensor([probs], dtype=torch.float64))


def test_weight_is_exactly_one_when_inference_equals_train_logprobs():
    old = logs(0.3, 0.6, 0.01)
    mask = torch.ones_like(old)
    w = importance_weights(old, old.clone(), mask, ImportanceConfig.tis(2.0))
    assert torch.equal(w, torch.ones_like(old))
    sums = named(mismatch_sums(old, old.clone(), mask, ImportanceConfig.tis(1.0)))
    assert sums["abs_delta_p"] == 0 and sums["kl"] == 0 and sums["truncated_tokens"] == 0
    assert sums["weight"] == 3 and sums["tokens"] == 3


@pytest.mark.parametrize(
    "p_old, p_inf, coef, weight, truncated",
    [
        pytest.param(0.3, 0.6, 2.0, 0.5, False, id="below-one"),
        pytest.param(0.6, 0.4, 2.0, 1.5, False, id="above-one-below-c"),
        pytest.param(0.9, 0.3, 2.0, 2.0, True, id="truncated-at-c"),
        pytest.param(0.9, 0.3, None, 3.0, False, id="no-truncation"),
    ],
)
def test_weight_values(p_old, p_inf, coef, weight, truncated):
    config = ImportanceConfig.tis(coef)
    old, inf = logs(p_old), logs(p_inf)
    mask = torch.ones_like(old)
    assert importance_weights(old, inf, mask, config).item() == pytest.approx(weight)
    sums = named(mismatch_sums(old, inf, mask, config))
    r = p_old / p_inf
    assert sums["abs_delta_p"] == pytest.approx(abs(p_old - p_inf))
    assert sums["kl"] == pytest.approx(r - 1 - math.log(r))
    assert sums["truncated_tokens"] == float(truncated)
    assert sums["truncated_sequences"] == float(truncated)


def test_masked_tokens_and_empty_rows_do_not_count():
    old = torch.log(torch.tensor([[0.9, 0.9], [0.5, 0.5]], dtype=torch.float64))
    inf = torch.log(torch.tensor([[0.3, 0.1], [0.5, 0.1]], dtype=torch.float64))
    mask = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    w = importance_weights(old, inf, mask, ImportanceConfig.tis(2.0))
    assert w.tolist() == [[2.0, 1.0], [1.0, 1.0]]
    sums = named(mismatch_sums(old, inf, mask, ImportanceConfig.tis(2.0)))
    assert sums["tokens"] == 1 and sums["sequences"] == 1
    assert sums["truncated_tokens"] == 1 and sums["truncated_sequences"] == 1
    assert sums["abs_delta_p"] == pytest.approx(0.6)


def test_truncation_coef_must_be_positive():
    with pytest.raises(ValueError, match="truncation_coef"):
        ImportanceConfig.tis(0.0)


def test_metrics_divide_token_sums_by_tokens_and_sequence_sums_by_sequences():
    sums = {
        "is/tokens": 4.0,
        "is/sequences": 2.0,
        "is/abs_delta_p": 1.0,
        "is/kl": 0.2,
        "is/truncated_tokens": 1.0,
        "is/truncated_sequences": 1.0,
        "is/weight": 3.0,
    }
    assert mismatch_metrics(sums) == {
        "is_abs_delta_p": 0.25,
        "is_kl": 0.05,
        "is_weight_mean": 0.75,
        "is_truncated_fraction": 0.25,
        "is_truncated_sequence_fraction": 0.5,
    }


# --- the rollout-IS modes (--rl-importance-sampling-mode) -------------------------------------

# Two rows of three tokens; ratios rho = pi_old / pi_inference per token:
#   row 0: 2.0, 0.5, 3.0 (product 3.0)   row 1: 1.5, 1.2, (masked 9.0) (product 1.8)
P_INF = [[0.2, 0.4, 0.1], [0.4, 0.5, 0.1]]
RHO = [[2.0, 0.5, 3.0], [1.5, 1.2, 9.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def two_rows():
    inf = torch.log(torch.tensor(P_INF, dtype=torch.float64))
    old = inf + torch.log(torch.tensor(RHO, dtype=torch.float64))
    return old, inf, torch.tensor(MASK, dtype=torch.float64)


# mode, C, C_min, weights (masked position: 1), truncated tokens/sequences, masked tokens/sequences
MODES = [
    pytest.param(
        "token_truncate",
        2.5,
        None,
        [[2.0, 0.5, 2.5], [1.5, 1.2, 1.0]],
        (1, 1),
        (0, 0),
        id="token-truncate-above",
    ),
    pytest.param(
        "token_truncate",
        2.5,
        0.8,
        [[2.0, 0.8, 2.5], [1.5, 1.2, 1.0]],
        (2, 1),
        (0, 0),
        id="token-truncate-both-bounds",
    ),
    pytest.param(
        "token_mask",
        2.5,
        None,
        [[2.0, 0.5, 0.0], [1.5, 1.2, 1.0]],
        (0, 0),
        (1, 1),
        id="token-mask-above-icepop",
    ),
    pytest.param(
        "token_mask",
        2.5,
        0.8,
        [[2.0, 0.0, 0.0], [1.5, 1.2, 1.0]],
        (0, 0),
        (2, 1),
        id="token-mask-range",
    ),
    pytest.param(
        "token_mask",
        1.4,
        1.25,
        [[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]],
        (0, 0),
        (5, 2),
        id="token-mask-narrow-range-masks-all",
    ),
    pytest.param(
        "sequence_truncate",
        2.0,
        None,
        [[2.0] * 3, [1.8, 1.8, 1.0]],
        (3, 1),
        (0, 0),
        id="sequence-truncate",
    ),
    pytest.param(
        "sequence_truncate",
        2.5,
        2.0,
        [[2.5] * 3, [2.0, 2.0, 1.0]],
        (5, 2),
        (0, 0),
        id="sequence-truncate-both-bounds",
    ),
    pytest.param(
        "sequence_mask",
        2.0,
        None,
        [[0.0] * 3, [1.8, 1.8, 1.0]],
        (0, 0),
        (3, 1),
        id="sequence-mask-above",
    ),
    pytest.param(
        "sequence_mask",
        5.0,
        2.0,
        [[3.0] * 3, [0.0, 0.0, 1.0]],
        (0, 0),
        (2, 1),
        id="sequence-mask-below",
    ),
]


@pytest.mark.parametrize("mode, coef, low, weights, truncated, masked", MODES)
def test_mode_weights_and_counts(mode, coef, low, weights, truncated, masked):
    old, inf, mask = two_rows()
    config = ImportanceConfig(coef, mode, low)
    got = importance_weights(old, inf, mask, config)
    torch.testing.assert_close(got, torch.tensor(weights, dtype=torch.float64))
    sums = named(mismatch_sums(old, inf, mask, config))
    assert (sums["truncated_tokens"], sums["truncated_sequences"]) == truncated
    assert (sums["masked_tokens"], sums["masked_sequences"]) == masked
    assert sums["weight"] == pytest.approx(
        sum(w * m for r, mr in zip(weights, MASK) for w, m in zip(r, mr))
    )
    metrics = mismatch_metrics({f"is/{k}": v for k, v in sums.items()}, config)
    assert ("is_masked_fraction" in metrics) == mode.endswith("mask")
    if mode.endswith("mask"):
        assert metrics["is_masked_fraction"] == pytest.approx(masked[0] / 5)
        assert metrics["is_masked_sequence_fraction"] == pytest.approx(masked[1] / 2)


@pytest.mark.parametrize(
    "mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
)
def test_every_mode_gives_weight_one_when_the_logprobs_agree(mode):
    old = logs(0.3, 0.6, 0.01)
    mask = torch.ones_like(old)
    w = importance_weights(old, old.clone(), mask, ImportanceConfig(2.0, mode, 0.5))
    assert torch.equal(w, torch.ones_like(old))


def test_a_fully_masked_row_keeps_weight_one_and_is_not_counted():
    old, inf = logs(0.9, 0.9), logs(0.1, 0.1)
    mask = torch.zeros_like(old)
    for mode in ("sequence_mask", "token_mask"):
        config = ImportanceConfig(2.0, mode, None)
        assert torch.equal(importance_weights(old, inf, mask, config), torch.ones_like(old))
        sums = named(mismatch_sums(old, inf, mask, config))
        assert sums["sequences"] == 0 and sums["masked_sequences"] == 0


def test_the_default_mode_is_the_truncated_weight_of_before():
    old, inf, mask = two_rows()
    explicit = ImportanceConfig(2.5, "token_truncate", None)
    assert ImportanceConfig.tis(2.5) == explicit
    expected = torch.exp((old - inf) * mask).clamp(max=2.5)
    assert torch.equal(importance_weights(old, inf, mask, explicit), expected)


@pytest.mark.parametrize(
    "coef, mode, low, message",
    [
        pytest.param(2.0, "tokens", None, "mode must be one of", id="unknown-mode"),
        pytest.param(2.0, "token_mask", -1.0, "clip_min", id="negative-lower-bound"),
        pytest.param(2.0, "token_mask", 2.0, "must be < truncation_coef", id="empty-range"),
        pytest.param(None, "sequence_mask", 0.5, "needs a truncation_coef", id="sequence-no-c"),
    ],
)
def test_invalid_modes_are_refused(coef, mode, low, message):
    with pytest.raises(ValueError, match=message):
        ImportanceConfig(coef, mode, low)
