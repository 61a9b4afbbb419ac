"""The k3 KL penalty towards the reference policy, by hand (one token)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.rl.grpo.loss import GRPOLossConfig, LossInputs, grpo_loss
from megatron.rl.grpo.terms.reference_kl import ReferenceKL


def t(x: float) -> torch.Tensor:
    return torch.tensor([[x]], dtype=torch.float64)


def inputs(p_theta, p_inf, adv=1.0, p_old=None, w=None, p_ref=None, entropy=None):
    trainer = t(math.log(p_theta)).requires_grad_()
    return trainer, LossInputs(
        trainer_logprobs=trainer,
        inference_logprobs=t(math.log(p_inf)),
        advantages=torch.tensor([adv], dtype=torch.float64),
        loss_mask=t(1.0),
        old_logprobs=None if p_old is None else t(math.log(p_old)),
        is_weights=None if w is None else t(w),
        ref_logprobs=None if p_ref is None else t(math.log(p_ref)),
        entropy=None if entropy is None else t(entropy),
    )


CLIP = dict(clamp_eps_lower=0.2, clamp_eps_upper=0.3)


@pytest.mark.parametrize(
    "p_theta, p_ref, beta",
    [
        pytest.param(0.4, 0.4, 0.1, id="kl-zero-at-reference"),
        pytest.param(0.2, 0.4, 0.1, id="reference-twice-as-likely"),
        pytest.param(0.5, 0.25, 0.05, id="reference-half-as-likely"),
    ],
)
def test_k3_kl_penalty(p_theta, p_ref, beta):
    # advantage 0: only the penalty remains; k3 = q - ln q - 1 with q = pi_ref / pi_theta
    trainer, x = inputs(p_theta, p_theta, adv=0.0, p_ref=p_ref)
    out = grpo_loss(x, GRPOLossConfig(**CLIP, terms=(ReferenceKL(beta),)))
    q = p_ref / p_theta
    assert out.term_sums["ref_kl"].item() == pytest.approx(q - math.log(q) - 1)
    assert out.loss_sum.item() == pytest.approx(beta * (q - math.log(q) - 1))
    out.loss_sum.backward()
    assert trainer.grad.item() == pytest.approx(beta * (1 - q))


def test_a_negative_beta_is_refused():
    with pytest.raises(ValueError, match=">= 0"):
        ReferenceKL(-0.1)
