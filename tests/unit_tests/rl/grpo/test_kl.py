"""The k3 KL estimator and the per-token reference penalty, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.rl.grpo.kl import k3, reference_kl


@pytest.mark.parametrize(
    "log_ratio, expected",
    [
        pytest.param(0.0, 0.0, id="equal-policies"),
        pytest.param(math.log(2.0), 2.0 - math.log(2.0) - 1.0, id="ratio-2"),
        pytest.param(math.log(0.5), 0.5 - math.log(0.5) - 1.0, id="ratio-half"),
    ],
)
def test_k3_values(log_ratio, expected):
    assert k3(torch.tensor(log_ratio, dtype=torch.float64)).item() == pytest.approx(expected)


def test_reference_kl_is_zero_on_identical_logprobs_and_masked_tokens():
    logp = torch.log(torch.tensor([[0.2, 0.5, 0.9]], dtype=torch.float64))
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    assert torch.equal(reference_kl(logp, logp, mask), torch.zeros_like(logp))
    ref = torch.log(torch.tensor([[0.4, 0.5, 1e-30]], dtype=torch.float64))
    kl = reference_kl(logp, ref, mask)
    # token 0: pi_ref / pi_theta = 2 -> 2 - ln 2 - 1; token 1: equal -> 0; token 2: masked -> 0
    assert kl.tolist()[0] == pytest.approx([1.0 - math.log(2.0), 0.0, 0.0])


def test_reference_kl_gradient():
    # d/d logp [exp(ref - logp) - (ref - logp) - 1] = 1 - pi_ref / pi_theta
    logp = torch.log(torch.tensor([[0.2, 0.5]], dtype=torch.float64)).requires_grad_()
    ref = torch.log(torch.tensor([[0.4, 0.25]], dtype=torch.float64))
    reference_kl(logp, ref, torch.ones_like(ref)).sum().backward()
    assert logp.grad.tolist()[0] == pytest.approx([1.0 - 2.0, 1.0 - 0.5])
