"""Off-policy sequence masking (``--off-policy-mask-threshold``) by hand: which sequences are
masked, that the mask leaves the additive terms and the denominators alone, and the metric."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.rl.grpo.loss import GRPOLossConfig, LossInputs, grpo_loss, variant_metrics
from megatron.rl.grpo.off_policy_mask import OffPolicyMask, off_policy_keep, sequence_kl
from megatron.rl.grpo.terms.entropy_bonus import EntropyBonus

DELTA = 0.5
LN2 = math.log(2.0)


def logs(*probs) -> torch.Tensor:
    return torch.log(torch.tensor([probs], dtype=torch.float64))


# sampling probs, current probs, mask, advantage, KL_i, kept
CASES = [
    pytest.param((0.5, 0.5), (0.25, 0.25), (1, 1), -1.0, LN2, False, id="negative-adv-far-masked"),
    pytest.param((0.5, 0.5), (0.25, 0.5), (1, 1), -1.0, LN2 / 2, True, id="negative-adv-near-kept"),
    pytest.param((0.5, 0.5), (0.25, 0.25), (1, 1), 1.0, LN2, True, id="positive-adv-far-kept"),
    pytest.param(
        (0.5, 0.5), (0.1, 0.1), (1, 1), 0.0, math.log(5), True, id="all-equal-rewards-zero-adv-kept"
    ),
    pytest.param(
        (0.5, 0.5), (0.8, 0.8), (1, 1), -1.0, math.log(0.625), True, id="negative-kl-kept"
    ),
    pytest.param((0.5, 0.9), (0.25, 0.01), (1, 0), -1.0, LN2, False, id="padding-not-in-the-mean"),
    pytest.param((0.5,), (0.2,), (1,), -1.0, math.log(2.5), False, id="single-token-masked"),
    pytest.param((0.5, 0.5), (0.01, 0.01), (0, 0), -1.0, 0.0, True, id="fully-masked-row"),
]


@pytest.mark.parametrize("sampling, current, mask, adv, kl, kept", CASES)
def test_which_sequences_are_masked(sampling, current, mask, adv, kl, kept):
    m = torch.tensor([mask], dtype=torch.float64)
    got_kl = sequence_kl(logs(*current), logs(*sampling), m)
    assert got_kl.item() == pytest.approx(kl)
    keep, sums = off_policy_keep(
        logs(*current), logs(*sampling), torch.tensor([adv]).double(), m, OffPolicyMask(DELTA)
    )
    assert keep.item() == float(kept)
    has_tokens = float(sum(mask) > 0)
    assert sums["opsm/sequences"].item() == has_tokens
    assert sums["opsm/masked_sequences"].item() == float(not kept) * has_tokens


def test_the_mask_drops_the_surrogate_not_the_terms():
    """Row 0 (A = -1, KL ln 2 > 0.5) is masked: its loss keeps only the entropy bonus, and its
    gradient through the surrogate is 0; row 1 (A = 1) is unchanged."""
    sampling = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]], dtype=torch.float64))
    current = torch.log(torch.tensor([[0.25, 0.25], [0.25, 0.25]], dtype=torch.float64))
    trainer = current.clone().requires_grad_()
    inputs = LossInputs(
        trainer_logprobs=trainer,
        inference_logprobs=sampling,
        advantages=torch.tensor([-1.0, 1.0], dtype=torch.float64),
        loss_mask=torch.ones(2, 2, dtype=torch.float64),
        entropy=torch.full((2, 2), 2.0, dtype=torch.float64),
    )
    config = GRPOLossConfig(
        0.2, 0.28, terms=(EntropyBonus(0.1),), off_policy_mask=OffPolicyMask(DELTA)
    )
    out = grpo_loss(inputs, config)
    # row 1: ratio 0.5 < 0.8 with A = 1: min(0.5, 0.8) = 0.5 -> -0.5 per token; entropy -0.2 each
    assert out.loss_sum.item() == pytest.approx(4 * -0.2 + 2 * -0.5)
    assert out.variant_sums["opsm/masked_sequences"].item() == 1.0
    out.loss_sum.backward()
    torch.testing.assert_close(
        trainer.grad, torch.tensor([[0.0, 0.0], [-0.5, -0.5]], dtype=torch.float64)
    )


def test_metric_and_threshold_checks():
    config = GRPOLossConfig(0.2, 0.28, off_policy_mask=OffPolicyMask(0.1))
    sums = {"opsm/masked_sequences": 3.0, "opsm/sequences": 12.0}
    assert variant_metrics(sums, config) == {"opsm_masked_sequence_fraction": 0.25}
    assert config.sum_keys() == ("opsm/masked_sequences", "opsm/sequences")
    for bad in (-0.1, math.inf, math.nan):
        with pytest.raises(ValueError, match="threshold"):
            OffPolicyMask(bad)
