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
    w = importance_weights(old, old.clone(), mask, ImportanceConfig(2.0))
    assert torch.equal(w, torch.ones_like(old))
    sums = named(mismatch_sums(old, old.clone(), mask, ImportanceConfig(1.0)))
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
    config = ImportanceConfig(coef)
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
    w = importance_weights(old, inf, mask, ImportanceConfig(2.0))
    assert w.tolist() == [[2.0, 1.0], [1.0, 1.0]]
    sums = named(mismatch_sums(old, inf, mask, ImportanceConfig(2.0)))
    assert sums["tokens"] == 1 and sums["sequences"] == 1
    assert sums["truncated_tokens"] == 1 and sums["truncated_sequences"] == 1
    assert sums["abs_delta_p"] == pytest.approx(0.6)


def test_truncation_coef_must_be_positive():
    with pytest.raises(ValueError, match="truncation_coef"):
        ImportanceConfig(0.0)


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
