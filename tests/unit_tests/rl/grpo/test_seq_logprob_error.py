"""Sequence-level logprob error: mean exp(|trainer - inference|) per sequence, metrics and the
threshold mask, against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.rl.grpo.seq_logprob_error import (
    SeqLogprobErrorConfig,
    seq_logprob_errors,
    sequence_error_sums,
)

LN2, LN3 = math.log(2.0), math.log(3.0)


def test_error_sums_are_over_generated_tokens_only():
    trainer = torch.tensor([[0.0, -1.0, -2.0], [-1.0, -1.0, -1.0]])
    inference = torch.tensor([[5.0, -1.0 + LN2, -2.0 - LN3], [-1.0, -1.0, -1.0 + LN2]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the 5.0 and the last LN2: no token
    sums, counts = sequence_error_sums(trainer, inference, mask)
    assert sums.dtype == torch.float64
    assert sums.tolist() == pytest.approx([2.0 + 3.0, 1.0 + 1.0], rel=1e-6)
    assert counts.tolist() == [2.0, 2.0]


def result(threshold):
    # errors per row: 2.5 (5 / 2), 1, 4, 1.5, and a row without generated tokens
    sums = torch.tensor([5.0, 3.0, 4.0, 3.0, 0.0], dtype=torch.float64)
    counts = torch.tensor([2.0, 3.0, 1.0, 2.0, 0.0], dtype=torch.float64)
    rewards = torch.tensor([0.5, 0.0, 1.0, 0.0, 0.0], dtype=torch.float64)  # > 0: rewarded
    return seq_logprob_errors(sums, counts, rewards, SeqLogprobErrorConfig(threshold))


def test_metrics_without_a_threshold_mask_nothing():
    out = result(None)
    assert out.keep.tolist() == [True] * 5
    assert out.metrics == pytest.approx(
        {
            "seq_mult_prob_error_min": 1.0,
            "seq_mult_prob_error_mean": (2.5 + 1 + 4 + 1.5) / 4,  # the empty row is left out
            "seq_mult_prob_error_max": 4.0,
        }
    )


@pytest.mark.parametrize(
    "threshold, keep, masked, rewarded, after",
    [
        pytest.param(2.0, [False, True, False, True, True], 2, 1.0, (1.0, 1.25, 1.5), id="x2"),
        pytest.param(
            1.5, [False, True, False, True, True], 2, 1.0, (1.0, 1.25, 1.5), id="x1.5-kept"
        ),
        pytest.param(1.2, [False, True, False, False, True], 3, 2 / 3, (1.0, 1.0, 1.0), id="x1.2"),
        pytest.param(4.0, [True] * 5, 0, 0.0, (1.0, 2.25, 4.0), id="none-above"),
        pytest.param(1.0, [False, True, False, False, True], 3, 2 / 3, (1.0, 1.0, 1.0), id="x1"),
    ],
)
def test_threshold_masks_the_rows_above_it(threshold, keep, masked, rewarded, after):
    out = result(threshold)
    assert out.keep.tolist() == keep  # the row without tokens is never masked (nothing to mask)
    assert out.metrics["seq_logprob_error_masked_sequences"] == masked
    assert out.metrics["seq_logprob_error_masked_rewarded_fraction"] == pytest.approx(rewarded)
    low, mean, high = after
    assert out.metrics["seq_mult_prob_error_after_mask_min"] == pytest.approx(low)
    assert out.metrics["seq_mult_prob_error_after_mask_mean"] == pytest.approx(mean)
    assert out.metrics["seq_mult_prob_error_after_mask_max"] == pytest.approx(high)
    assert out.metrics["seq_mult_prob_error_max"] == 4.0  # before the mask


def test_every_row_masked_reports_zeros_after_the_mask():
    sums = torch.tensor([4.0, 6.0], dtype=torch.float64)
    counts = torch.tensor([2.0, 2.0], dtype=torch.float64)
    out = seq_logprob_errors(sums, counts, torch.zeros(2), SeqLogprobErrorConfig(1.5))
    assert out.keep.tolist() == [False, False]
    assert out.metrics["seq_mult_prob_error_after_mask_max"] == 0.0
    assert out.metrics["seq_logprob_error_masked_rewarded_fraction"] == 0.0


@pytest.mark.parametrize(
    "threshold",
    [
        pytest.param(0.99, id="below-one"),
        pytest.param(math.inf, id="inf"),
        pytest.param(math.nan, id="nan"),
    ],
)
def test_bad_thresholds_are_refused(threshold):
    with pytest.raises(ValueError, match="threshold"):
        SeqLogprobErrorConfig(threshold)
