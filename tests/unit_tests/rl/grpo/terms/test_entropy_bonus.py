"""The entropy bonus, by hand (one token)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.rl.grpo.loss import GRPOLossConfig, LossInputs, grpo_loss
from megatron.rl.grpo.terms.entropy_bonus import EntropyBonus


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


def test_entropy_bonus_is_subtracted():
    _, x = inputs(0.4, 0.4, adv=1.0, entropy=2.0)
    out = grpo_loss(x, GRPOLossConfig(**CLIP, terms=(EntropyBonus(0.01),)))
    assert out.loss_sum.item() == pytest.approx(-1.0 - 0.01 * 2.0)
    assert out.term_sums["entropy"].item() == pytest.approx(2.0)
