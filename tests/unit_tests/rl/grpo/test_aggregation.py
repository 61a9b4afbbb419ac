"""The loss aggregations (``--loss-agg-mode``) by hand: numerators, denominators, the edge rows
(a fully masked sequence, a single-token completion, a truncated completion that fills the whole
width) and independence of how the rows are cut into micro-batches."""

from __future__ import annotations

import pytest
import torch

from megatron.rl.grpo.aggregation import TOKEN_MEAN, LossAggregation
from megatron.rl.grpo.loss import GRPOLossConfig, LossInputs, grpo_loss
from megatron.rl.grpo.names import AGG_MODES, DEFAULT_AGG_MODE

# Per-token losses of four rows of width 3 (masked values must not count):
#   row 0: truncated completion, every column a loss token: 1, 2, 3  (n = 3, sum 6, mean 2)
#   row 1: single-token completion: 4                                 (n = 1, sum 4, mean 4)
#   row 2: fully masked (placeholder / masked row): 100, 100, 100     (n = 0)
#   row 3: two tokens then padding: -1, 3                             (n = 2, sum 2, mean 1)
PER_TOKEN = torch.tensor(
    [[1.0, 2.0, 3.0], [4.0, 50.0, 50.0], [100.0, 100.0, 100.0], [-1.0, 3.0, 70.0]],
    dtype=torch.float64,
)
MASK = torch.tensor(
    [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64
)
TOKENS, SEQUENCES = 6, 3


class Counts:
    """A global batch's counts; the token mean must not read the sequences (a shard's counts
    may lack them)."""

    global_loss_tokens = TOKENS

    def __init__(self, sequences: bool = True) -> None:
        self.sequences = sequences

    @property
    def global_loss_sequences(self) -> int:
        if not self.sequences:
            raise AssertionError("the token mean read the sequences")
        return SEQUENCES


@pytest.mark.parametrize(
    "mode, scale, numerator, denominator",
    [
        pytest.param("token-mean", None, 1 + 2 + 3 + 4 - 1 + 3, TOKENS, id="token-mean"),
        pytest.param("seq-mean-token-mean", None, 2 + 4 + 1, SEQUENCES, id="seq-mean-token-mean"),
        pytest.param("seq-mean-token-sum", None, 6 + 4 + 2, SEQUENCES, id="seq-mean-token-sum"),
        pytest.param(
            "seq-mean-token-sum-norm", 4.0, (6 + 4 + 2) / 4, SEQUENCES, id="dr-grpo-constant-4"
        ),
        pytest.param(
            "seq-mean-token-sum-norm", 3.0, (6 + 4 + 2) / 3, SEQUENCES, id="dr-grpo-constant-3"
        ),
    ],
)
def test_numerator_and_denominator_by_hand(mode, scale, numerator, denominator):
    agg = LossAggregation(mode, scale)
    assert agg.micro_batch_sum(PER_TOKEN, MASK).item() == pytest.approx(numerator)
    assert agg.denominator(Counts(sequences=agg.per_sequence)) == denominator
    assert agg.per_sequence == (mode != "token-mean")


def test_the_default_is_the_token_mean_spelled_once():
    assert DEFAULT_AGG_MODE == "token-mean" == TOKEN_MEAN.mode
    assert GRPOLossConfig(0.2, 0.28).aggregation == TOKEN_MEAN


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize(
    "cuts",
    [
        pytest.param([(0, 4)], id="one-micro-batch"),
        pytest.param([(0, 2), (2, 4)], id="two-rows-each"),
        pytest.param([(0, 1), (1, 2), (2, 3), (3, 4)], id="one-row-each"),
        pytest.param([(0, 3), (3, 4)], id="uneven"),
    ],
)
def test_micro_batch_sums_add_up_to_the_whole_batch(mode, cuts):
    agg = LossAggregation(mode, 5.0)
    whole = agg.micro_batch_sum(PER_TOKEN, MASK)
    parts = sum(agg.micro_batch_sum(PER_TOKEN[a:b], MASK[a:b]) for a, b in cuts)
    assert parts.item() == pytest.approx(whole.item(), abs=1e-12)


def test_a_fully_masked_batch_sums_to_zero_in_every_mode():
    for mode in AGG_MODES:
        agg = LossAggregation(mode, 2.0)
        assert agg.micro_batch_sum(PER_TOKEN[2:3], MASK[2:3]).item() == 0.0


def test_the_gradient_of_a_sequence_mean_weighs_each_sequence_alike():
    """seq-mean-token-mean: d L / d l_it = 1 / n_i (before the global 1/|S|); token-mean: 1."""
    per_token = PER_TOKEN.clone().requires_grad_()
    LossAggregation("seq-mean-token-mean", None).micro_batch_sum(per_token, MASK).backward()
    expected = MASK / MASK.sum(dim=1, keepdim=True).clamp(min=1)
    torch.testing.assert_close(per_token.grad, expected)
    per_token.grad = None
    LossAggregation("token-mean", None).micro_batch_sum(per_token, MASK).backward()
    torch.testing.assert_close(per_token.grad, MASK)


@pytest.mark.parametrize(
    "mode, scale, message",
    [
        pytest.param("seq-mean", None, "mode must be one of", id="unknown-mode"),
        pytest.param("seq-mean-token-sum-norm", None, "scale_factor", id="norm-without-c"),
        pytest.param("seq-mean-token-sum-norm", 0.0, "scale_factor", id="norm-c-zero"),
    ],
)
def test_invalid_aggregations_are_refused(mode, scale, message):
    with pytest.raises(ValueError, match=message):
        LossAggregation(mode, scale)


def test_the_loss_applies_the_aggregation_to_surrogate_and_weights():
    """Through ``grpo_loss``: ratio 1 everywhere, so each token's loss is -A (times its IS
    weight); rows: A = 1 over 3 tokens, A = -2 on 1 token."""
    logp = torch.log(torch.full((2, 3), 0.5, dtype=torch.float64))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    inputs = LossInputs(
        trainer_logprobs=logp.clone(),
        inference_logprobs=logp,
        advantages=torch.tensor([1.0, -2.0], dtype=torch.float64),
        loss_mask=mask,
        is_weights=torch.tensor([[1.0, 0.5, 0.5], [2.0, 1.0, 1.0]], dtype=torch.float64),
    )
    want = {
        "token-mean": -(1 + 0.5 + 0.5) + 4.0,
        "seq-mean-token-mean": -(2.0 / 3) + 4.0,
        "seq-mean-token-sum": -2.0 + 4.0,
        "seq-mean-token-sum-norm": (-2.0 + 4.0) / 4,
    }
    for mode, value in want.items():
        config = GRPOLossConfig(0.2, 0.28, aggregation=LossAggregation(mode, 4.0))
        assert grpo_loss(inputs, config).loss_sum.item() == pytest.approx(value), mode
