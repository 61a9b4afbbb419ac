"""GSPO (``--policy-loss gspo``) by hand: the sequence ratio, its clipping, the stop-gradient
token form's gradient, the metrics and the edge rows."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.rl.grpo.aggregation import LossAggregation
from megatron.rl.grpo.loss import GRPOLossConfig, LossInputs, grpo_loss, variant_metrics
from megatron.rl.grpo.policy_loss import gspo

GSPO = GRPOLossConfig(clamp_eps_lower=0.2, clamp_eps_upper=0.3, policy_loss="gspo")  # [0.8, 1.3]
OLD_P = 0.4


def row(ratios: list[float], advantage: float, mask: list[float] | None = None):
    """One row whose tokens have the ratios pi_theta / pi_old ``ratios``."""
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


def geo_mean(ratios):
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


# ratios, advantage, s_i, sequence clipped, per-token loss value, per-token gradient
CASES = [
    pytest.param(
        [1.2, 0.9],
        1.0,
        math.sqrt(1.08),
        False,
        -math.sqrt(1.08),
        -math.sqrt(1.08),
        id="inside-range",
    ),
    pytest.param(
        [1.5, 0.8],
        1.0,
        math.sqrt(1.2),
        False,
        -math.sqrt(1.2),
        -math.sqrt(1.2),
        id="token-clipped-but-sequence-not",
    ),
    pytest.param([2.0, 2.0], 1.0, 2.0, True, -1.3, 0.0, id="above-upper-positive-adv-clipped"),
    pytest.param([2.0, 2.0], -1.0, 2.0, False, 2.0, 2.0, id="above-upper-negative-adv-kept"),
    pytest.param([0.5, 0.5], -1.0, 0.5, True, 0.8, 0.0, id="below-lower-negative-adv-clipped"),
    pytest.param([0.7], 2.0, 0.7, False, -1.4, -1.4, id="single-token-completion"),
    pytest.param(
        [1.7, 0.6, 1.1],
        0.0,
        geo_mean([1.7, 0.6, 1.1]),
        False,
        0.0,
        0.0,
        id="all-equal-rewards-zero-advantage",
    ),
]


@pytest.mark.parametrize("ratios, advantage, s, clipped, value, grad", CASES)
def test_sequence_ratio_clipping_and_gradient(ratios, advantage, s, clipped, value, grad):
    trainer, inputs = row(ratios, advantage)
    out = grpo_loss(inputs, GSPO)
    n = len(ratios)
    assert out.loss_sum.item() == pytest.approx(n * value, abs=1e-12)
    assert out.variant_sums["gspo/ratio"].item() == pytest.approx(s)
    assert out.variant_sums["gspo/clipped_sequences"].item() == float(clipped)
    assert out.variant_sums["gspo/sequences"].item() == 1.0
    assert out.clipped_tokens.item() == (n if clipped else 0)
    out.loss_sum.backward()
    # every token gets d(-s_it A)/d log pi_t = -s_i A (0 once the sequence is clipped)
    torch.testing.assert_close(trainer.grad, torch.full_like(trainer, grad), atol=1e-12, rtol=0)


def test_masked_tokens_do_not_enter_the_sequence_ratio():
    """A truncated row with trailing padding: only the loss tokens make s_i."""
    trainer, inputs = row([1.2, 0.9, 5.0], 1.0, mask=[1.0, 1.0, 0.0])
    out = grpo_loss(inputs, GSPO)
    assert out.variant_sums["gspo/ratio"].item() == pytest.approx(math.sqrt(1.08))
    out.loss_sum.backward()
    expected = torch.tensor([[-math.sqrt(1.08)] * 2 + [0.0]], dtype=torch.float64)
    torch.testing.assert_close(trainer.grad, expected)


def test_a_fully_masked_sequence_contributes_and_counts_nothing():
    trainer, inputs = row([3.0, 3.0], 1.0, mask=[0.0, 0.0])
    out = grpo_loss(inputs, GSPO)
    assert out.loss_sum.item() == 0.0 and out.clipped_tokens.item() == 0
    assert {k: v.item() for k, v in out.variant_sums.items()} == {
        "gspo/ratio": 0.0,
        "gspo/clipped_sequences": 0.0,
        "gspo/sequences": 0.0,
    }
    out.loss_sum.backward()
    assert torch.all(trainer.grad == 0)


def test_the_token_form_has_the_sequence_objectives_gradient():
    """With seq-mean-token-mean, the stop-gradient token form's gradient equals the gradient of
    the paper's objective (1/G) sum_i min(s_i A_i, clip(s_i) A_i) with s_i differentiable."""
    torch.manual_seed(0)
    old = torch.log(torch.rand(4, 5, dtype=torch.float64) * 0.8 + 0.1)
    trainer = (old + 0.15 * torch.randn(4, 5, dtype=torch.float64)).requires_grad_()
    mask = torch.tensor(
        [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.float64
    )
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64)
    config = GRPOLossConfig(
        0.05, 0.05, policy_loss="gspo", aggregation=LossAggregation("seq-mean-token-mean", None)
    )
    inputs = LossInputs(
        trainer_logprobs=trainer, inference_logprobs=old, advantages=adv, loss_mask=mask
    )
    grpo_loss(inputs, config).loss_sum.backward()
    token_form = trainer.grad.clone()
    trainer.grad = None
    s = torch.exp(((trainer - old) * mask).sum(1) / mask.sum(1))
    paper = -torch.minimum(s * adv, s.clamp(0.95, 1.05) * adv).sum()
    paper.backward()
    torch.testing.assert_close(token_form, trainer.grad)
    assert torch.any(token_form == 0) and torch.any(token_form != 0)  # some rows clipped


def test_metrics_are_per_sequence():
    sums = {"gspo/ratio": 3.3, "gspo/clipped_sequences": 1.0, "gspo/sequences": 3.0}
    assert variant_metrics(sums, GSPO) == pytest.approx(
        {"gspo_ratio_mean": 1.1, "gspo_clipped_sequence_fraction": 1 / 3}
    )
    assert gspo.metrics({k: 0.0 for k in sums}) == {
        "gspo_ratio_mean": 0.0,
        "gspo_clipped_sequence_fraction": 0.0,
    }
    assert GSPO.sum_keys() == gspo.SUMS


def test_the_ratio_is_against_pi_old_when_given():
    """With ``old_logprobs`` (--grpo-iterations > 1, the IS correction) s_i is pi_theta / pi_old,
    and the IS weights multiply the objective."""
    logp = torch.log(torch.tensor([[0.2, 0.3]], dtype=torch.float64))
    old = logp - math.log(2.0)  # every token's ratio against pi_old is 2
    inputs = LossInputs(
        trainer_logprobs=logp.clone().requires_grad_(),
        inference_logprobs=logp,  # ratio 1 against the engine: ignored
        advantages=torch.tensor([-1.0], dtype=torch.float64),
        loss_mask=torch.ones(1, 2, dtype=torch.float64),
        old_logprobs=old,
        is_weights=torch.tensor([[0.5, 1.0]], dtype=torch.float64),
    )
    out = grpo_loss(inputs, GSPO)
    assert out.variant_sums["gspo/ratio"].item() == pytest.approx(2.0)
    assert out.loss_sum.item() == pytest.approx(0.5 * 2.0 + 1.0 * 2.0)
