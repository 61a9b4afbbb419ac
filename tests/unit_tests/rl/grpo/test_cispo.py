"""CISPO (``--policy-loss cispo``) by hand: the capped stop-gradient weight times log pi_theta,
its gradient and the edge rows."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.rl.grpo.aggregation import LossAggregation
from megatron.rl.grpo.loss import GRPOLossConfig, LossInputs, grpo_loss

CISPO = GRPOLossConfig(clamp_eps_lower=0.2, clamp_eps_upper=0.28, policy_loss="cispo")  # cap 1.28
OLD_P = 0.4


def tokens(ratios: list[float], advantage: float, mask: list[float] | None = None):
    old = torch.full((1, len(ratios)), math.log(OLD_P), dtype=torch.float64)
    trainer = (old + torch.tensor([ratios], dtype=torch.float64).log()).requires_grad_()
    m = torch.ones_like(old) if mask is None else torch.tensor([mask], dtype=torch.float64)
    inputs = LossInputs(
        trainer_logprobs=trainer,
        inference_logprobs=old,
        advantages=torch.tensor([advantage], dtype=torch.float64),
        loss_mask=m,
    )
    return trainer, inputs


# ratio, advantage, capped weight, capped?
CASES = [
    pytest.param(1.1, 2.0, 1.1, False, id="inside-range"),
    pytest.param(1.5, 1.0, 1.28, True, id="above-cap-positive-adv"),
    pytest.param(1.5, -1.0, 1.28, True, id="above-cap-negative-adv-keeps-gradient"),
    pytest.param(0.5, -1.0, 0.5, False, id="no-lower-bound"),
    pytest.param(0.5, 2.0, 0.5, False, id="low-ratio-positive-adv"),
    pytest.param(3.0, 0.0, 1.28, True, id="all-equal-rewards-zero-advantage"),
]


@pytest.mark.parametrize("ratio, advantage, weight, capped", CASES)
def test_single_token_loss_and_gradient(ratio, advantage, weight, capped):
    trainer, inputs = tokens([ratio], advantage)
    out = grpo_loss(inputs, CISPO)
    logp = math.log(OLD_P * ratio)
    assert out.loss_sum.item() == pytest.approx(-weight * advantage * logp, abs=1e-12)
    assert out.clipped_tokens.item() == float(capped)
    assert out.variant_sums["cispo_weight_mean"].item() == pytest.approx(weight)
    out.loss_sum.backward()
    # d loss / d log pi = -sg(w) A: the weight carries no gradient, a capped token keeps one
    assert trainer.grad.item() == pytest.approx(-weight * advantage, abs=1e-12)


def test_masked_and_fully_masked_rows_contribute_nothing():
    trainer, inputs = tokens([1.5, 0.5, 9.0], 1.0, mask=[1.0, 1.0, 0.0])
    out = grpo_loss(inputs, CISPO)
    logps = [math.log(OLD_P * r) for r in (1.5, 0.5)]
    assert out.loss_sum.item() == pytest.approx(-(1.28 * logps[0] + 0.5 * logps[1]))
    assert out.clipped_tokens.item() == 1  # the masked ratio 9 is not counted
    out.loss_sum.backward()
    torch.testing.assert_close(
        trainer.grad, torch.tensor([[-1.28, -0.5, 0.0]], dtype=torch.float64)
    )
    trainer, inputs = tokens([1.5, 0.5], 1.0, mask=[0.0, 0.0])
    out = grpo_loss(inputs, CISPO)
    assert out.loss_sum.item() == 0.0 and out.clipped_tokens.item() == 0
    out.loss_sum.backward()
    assert torch.all(trainer.grad == 0)


def test_is_weights_and_aggregation_apply():
    """The rollout IS weight multiplies the objective; seq-mean-token-mean divides by n_i."""
    trainer, inputs = tokens([1.0, 1.0], 1.0)
    inputs = LossInputs(**{**inputs.__dict__, "is_weights": torch.tensor([[0.5, 1.0]]).double()})
    config = GRPOLossConfig(
        0.2, 0.28, policy_loss="cispo", aggregation=LossAggregation("seq-mean-token-mean", None)
    )
    out = grpo_loss(inputs, config)
    logp = math.log(OLD_P)
    assert out.loss_sum.item() == pytest.approx(-(0.5 * logp + logp) / 2)
    out.loss_sum.backward()
    torch.testing.assert_close(trainer.grad, torch.tensor([[-0.25, -0.5]], dtype=torch.float64))
