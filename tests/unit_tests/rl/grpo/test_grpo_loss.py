"""Hand-computed per-token values and gradients of the clipped GRPO surrogate ``grpo_loss``."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.rl.grpo.loss import GRPOLossConfig, LossInputs, grpo_loss

CONFIG = GRPOLossConfig(clamp_eps_lower=0.2, clamp_eps_upper=0.3)  # clip range [0.8, 1.3]
BEHAVIOUR_P = 0.4  # behaviour probability of every token below


def one_token(ratio: float, advantage: float, mask: float = 1.0):
    """Loss inputs of one row with one token whose ratio pi_theta / pi_behaviour is ``ratio``."""
    trainer = torch.tensor([[math.log(BEHAVIOUR_P * ratio)]], dtype=torch.float64)
    trainer.requires_grad_()
    inputs = LossInputs(
        trainer_logprobs=trainer,
        inference_logprobs=torch.tensor([[math.log(BEHAVIOUR_P)]], dtype=torch.float64),
        advantages=torch.tensor([advantage], dtype=torch.float64),
        loss_mask=torch.tensor([[mask]], dtype=torch.float64),
    )
    return trainer, inputs


# ratio, advantage, expected loss, clipped, expected d loss / d trainer_logprob
CASES = [
    pytest.param(1.1, 2.0, -2.2, 0, -2.2, id="inside-range-positive-adv"),
    pytest.param(0.9, -1.0, 0.9, 0, 0.9, id="inside-range-negative-adv"),
    pytest.param(1.5, 1.0, -1.3, 1, 0.0, id="above-upper-positive-adv-clipped"),
    pytest.param(0.5, -1.0, 0.8, 1, 0.0, id="below-lower-negative-adv-clipped"),
    pytest.param(1.5, -1.0, 1.5, 0, 1.5, id="above-upper-negative-adv-not-clipped"),
    pytest.param(0.5, 2.0, -1.0, 0, -1.0, id="below-lower-positive-adv-not-clipped"),
    pytest.param(1.5, 0.0, 0.0, 0, 0.0, id="zero-advantage"),
]


@pytest.mark.parametrize("ratio, advantage, loss, clipped, grad", CASES)
def test_single_token_loss_clipping_and_gradient(ratio, advantage, loss, clipped, grad):
    trainer, inputs = one_token(ratio, advantage)
    out = grpo_loss(inputs, CONFIG)
    assert out.loss_sum.item() == pytest.approx(loss, abs=1e-9)
    assert out.clipped_tokens.item() == clipped
    assert out.ratio_sum.item() == pytest.approx(ratio, abs=1e-9)
    out.loss_sum.backward()
    # d(-A r)/d log pi_theta = -A r where unclipped; the clamp has no gradient where it binds
    assert trainer.grad.item() == pytest.approx(grad, abs=1e-9)


@pytest.mark.parametrize(
    "ratio, advantage",
    [
        pytest.param(1.5, 1.0, id="would-be-clipped-above"),
        pytest.param(0.5, -1.0, id="would-be-clipped-below"),
        pytest.param(1.1, 2.0, id="inside-range"),
    ],
)
def test_masked_token_contributes_nothing(ratio, advantage):
    trainer, inputs = one_token(ratio, advantage, mask=0.0)
    out = grpo_loss(inputs, CONFIG)
    assert out.loss_sum.item() == 0
    assert out.clipped_tokens.item() == 0
    assert out.ratio_sum.item() == 0
    assert out.mismatch_kl_sum.item() == 0
    out.loss_sum.backward()
    assert trainer.grad.item() == 0


def test_batch_sums_per_token_values_and_counts_clipped_tokens():
    # row 0 (A=1): ratios 1.1 (in range), 1.5 (clipped to 1.3), 2.0 but masked out
    # row 1 (A=-1): ratios 0.5 (clipped to 0.8), 1.5 (unclipped), 1.0 (masked prompt token)
    ratios = torch.tensor([[1.1, 1.5, 2.0], [0.5, 1.5, 1.0]], dtype=torch.float64)
    behaviour = torch.log(torch.tensor([[0.3, 0.5, 0.2], [0.6, 0.1, 0.9]], dtype=torch.float64))
    trainer = (behaviour + ratios.log()).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    inputs = LossInputs(
        trainer_logprobs=trainer,
        inference_logprobs=behaviour,
        advantages=torch.tensor([1.0, -1.0], dtype=torch.float64),
        loss_mask=mask,
    )
    out = grpo_loss(inputs, CONFIG)
    # per-token losses: -1.1, -1.3 | 0.8, 1.5
    assert out.loss_sum.item() == pytest.approx(-1.1 - 1.3 + 0.8 + 1.5, abs=1e-9)
    assert out.clipped_tokens.item() == 2
    assert out.ratio_sum.item() == pytest.approx(1.1 + 1.5 + 0.5 + 1.5, abs=1e-9)
    out.loss_sum.backward()
    expected = torch.tensor([[-1.1, 0.0, 0.0], [0.0, 1.5, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(trainer.grad, expected)


def test_default_config_uses_decoupled_clip_range():
    config = GRPOLossConfig(0.2, 0.28)
    assert (config.clamp_eps_lower, config.clamp_eps_upper) == (0.2, 0.28)
    _, inputs = one_token(1.5, 1.0)
    assert grpo_loss(inputs, config).loss_sum.item() == pytest.approx(-1.28, abs=1e-9)
    _, inputs = one_token(0.5, -1.0)
    assert grpo_loss(inputs, config).loss_sum.item() == pytest.approx(0.8, abs=1e-9)


def test_mismatch_kl_is_zero_when_logprobs_are_equal():
    logp = torch.log(torch.tensor([[0.2, 0.7, 0.05]], dtype=torch.float64))
    inputs = LossInputs(
        trainer_logprobs=logp.clone(),
        inference_logprobs=logp,
        advantages=torch.tensor([0.5], dtype=torch.float64),
        loss_mask=torch.ones(1, 3, dtype=torch.float64),
    )
    out = grpo_loss(inputs, CONFIG)
    assert out.mismatch_kl_sum.item() == 0
    assert out.ratio_sum.item() == pytest.approx(3.0, abs=1e-12)
    assert out.clipped_tokens.item() == 0


@pytest.mark.parametrize(
    "ratios, mask",
    [
        pytest.param([2.0], [1.0], id="one-token-ratio-2"),
        pytest.param([0.5, 1.5, 1.0], [1.0, 1.0, 1.0], id="three-tokens"),
        pytest.param([0.25, 3.0, 0.1], [1.0, 0.0, 1.0], id="masked-token-excluded"),
    ],
)
def test_mismatch_kl_matches_k3_formula(ratios, mask):
    r = torch.tensor([ratios], dtype=torch.float64)
    m = torch.tensor([mask], dtype=torch.float64)
    behaviour = torch.full_like(r, math.log(0.3))
    inputs = LossInputs(
        trainer_logprobs=behaviour + r.log(),
        inference_logprobs=behaviour,
        advantages=torch.tensor([1.0], dtype=torch.float64),
        loss_mask=m,
    )
    expected = sum(x - 1 - math.log(x) for x, keep in zip(ratios, mask) if keep)
    assert expected > 0
    assert grpo_loss(inputs, CONFIG).mismatch_kl_sum.item() == pytest.approx(expected, rel=1e-9)


def test_statistics_carry_no_gradient():
    trainer, inputs = one_token(1.1, 1.0)
    out = grpo_loss(inputs, CONFIG)
    assert out.loss_sum.requires_grad
    assert not out.ratio_sum.requires_grad
    assert not out.mismatch_kl_sum.requires_grad
    assert not out.clipped_tokens.requires_grad
