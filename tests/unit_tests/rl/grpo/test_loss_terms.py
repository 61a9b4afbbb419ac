"""The optional inputs of ``grpo_loss`` (ratio against pi_old, IS weights) and its terms together.

Every case is one generated token whose values are chosen so the loss is easy to compute by
hand; the default path (no optional inputs) is covered by ``test_grpo_loss.py``, each term alone
by ``terms/test_<term>.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron.rl.grpo.loss import GRPOLossConfig, LossInputs, grpo_loss
from megatron.rl.grpo.terms import loss_terms
from megatron.rl.grpo.terms.entropy_bonus import EntropyBonus
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


def test_ratio_is_taken_against_old_logprobs_when_given():
    # pi_theta = 0.44, pi_old = 0.4 -> r = 1.1 (the inference logprob 0.1 would give r = 4.4)
    _, x = inputs(0.44, 0.1, adv=2.0, p_old=0.4)
    out = grpo_loss(x, GRPOLossConfig(**CLIP))
    assert out.ratio_sum.item() == pytest.approx(1.1)
    assert out.loss_sum.item() == pytest.approx(-2.2)
    assert out.clipped_tokens.item() == 0


def test_ratio_is_exactly_one_when_old_equals_current():
    trainer, x = inputs(0.37, 0.2, adv=1.5)
    x = LossInputs(**{**x.__dict__, "old_logprobs": trainer.detach()})
    out = grpo_loss(x, GRPOLossConfig(**CLIP))
    assert out.ratio_sum.item() == 1.0 and out.mismatch_kl_sum.item() == 0.0
    out.loss_sum.backward()
    assert trainer.grad.item() == pytest.approx(-1.5)  # d(-A r)/d logp = -A r at r = 1


@pytest.mark.parametrize(
    "w, loss, grad",
    [
        pytest.param(1.0, -2.2, -2.2, id="weight-one-is-the-plain-surrogate"),
        pytest.param(0.5, -1.1, -1.1, id="weight-half"),
        pytest.param(2.0, -4.4, -4.4, id="weight-truncated-at-two"),
    ],
)
def test_importance_weight_scales_the_surrogate(w, loss, grad):
    trainer, x = inputs(0.44, 0.3, adv=2.0, p_old=0.4, w=w)
    out = grpo_loss(x, GRPOLossConfig(**CLIP))
    assert out.loss_sum.item() == pytest.approx(loss)
    out.loss_sum.backward()
    assert trainer.grad.item() == pytest.approx(grad)


def test_all_terms_together():
    # r = 1.1, w = 0.5, A = 2, k3 with q = 0.5 / 0.44, entropy 1.5
    _, x = inputs(0.44, 0.8, adv=2.0, p_old=0.4, w=0.5, p_ref=0.5, entropy=1.5)
    out = grpo_loss(x, GRPOLossConfig(**CLIP, terms=(ReferenceKL(0.1), EntropyBonus(0.02))))
    q = 0.5 / 0.44
    assert out.loss_sum.item() == pytest.approx(
        -0.5 * 2.2 + 0.1 * (q - math.log(q) - 1) - 0.02 * 1.5
    )
    assert set(out.metric_sums()) == {
        "loss",
        "clip_fraction",
        "ratio_mean",
        "mismatch_kl",
        "ref_kl",
        "entropy",
    }


@pytest.mark.parametrize(
    "config, missing",
    [
        pytest.param(
            GRPOLossConfig(**CLIP, terms=(ReferenceKL(0.1),)),
            "ref_logprobs",
            id="kl-without-reference",
        ),
        pytest.param(
            GRPOLossConfig(**CLIP, terms=(EntropyBonus(0.1),)), "entropy", id="entropy-missing"
        ),
    ],
)
def test_missing_inputs_of_an_enabled_term_raise(config, missing):
    _, x = inputs(0.4, 0.4)
    with pytest.raises(ValueError, match=missing):
        grpo_loss(x, config)


def test_every_term_module_is_discovered_with_its_flag():
    terms = loss_terms()
    assert [t.name for t in terms] == ["entropy", "ref_kl"]
    assert [t.flag for t in terms] == ["--grpo-entropy-term-weight", "--grpo-kl-beta"]
    assert all(t.help for t in terms)


@pytest.mark.parametrize("term", loss_terms(), ids=lambda t: t.name)
def test_a_term_weight_must_be_finite(term):
    with pytest.raises(ValueError, match="finite"):
        term(float("nan"))
