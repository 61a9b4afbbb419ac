"""The policy-loss registry (``megatron/rl/grpo/policy_loss``): the variants are found by their
modules without importing them, and every variant keeps the contract the loss relies on (its
declared sums, a (B, T) objective, nothing from the tokens outside the loss mask). A new variant
is checked here without any edit."""

from __future__ import annotations

import pytest
import torch
from grpo_testing.probes import loads_torch

from megatron.rl.grpo.loss import GRPOLossConfig, LossInputs, grpo_loss, variant_metrics
from megatron.rl.grpo.policy_loss import DEFAULT_POLICY_LOSS, load_policy_loss, policy_losses


def test_the_variants_are_the_modules_found_without_torch():
    probe = "from megatron.rl.grpo.policy_loss import policy_losses\nprint(policy_losses())"
    assert loads_torch(probe) == (str(policy_losses()), False)
    assert policy_losses()[0] == DEFAULT_POLICY_LOSS == "vanilla"
    assert {"vanilla", "gspo", "cispo"} <= set(policy_losses())
    assert "base" not in policy_losses()


def test_an_unknown_variant_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"policy_loss must be one of \('vanilla'"):
        GRPOLossConfig(0.2, 0.28, policy_loss="ppo")


def batch(seed: int, padding: float = 0.0) -> tuple[torch.Tensor, LossInputs]:
    """Three rows (one fully masked); ``padding`` is added to the trainer's logprobs off the
    loss mask."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    old = -torch.rand(3, 4, generator=g, dtype=torch.float64) - 0.5
    trainer = old + 0.3 * torch.randn(3, 4, generator=g, dtype=torch.float64)
    trainer = (trainer + padding * (1 - mask)).requires_grad_()
    inputs = LossInputs(
        trainer_logprobs=trainer,
        inference_logprobs=old,
        advantages=torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64),
        loss_mask=mask.double(),
    )
    return trainer, inputs


@pytest.mark.parametrize("name", policy_losses())
def test_every_variant_keeps_the_contract(name):
    config = GRPOLossConfig(0.2, 0.28, policy_loss=name)
    variant = load_policy_loss(name)
    assert variant.name == name and config.variant is variant
    trainer, inputs = batch(0)
    out = grpo_loss(inputs, config)
    assert set(out.variant_sums) == set(variant.sums) == set(config.sum_keys())
    assert torch.isfinite(out.loss_sum) and 0 <= out.clipped_tokens.item() <= 5
    out.loss_sum.backward()
    assert torch.all(trainer.grad[inputs.loss_mask == 0] == 0)
    _, padded = batch(0, padding=3.0)  # off-mask logprobs must not matter
    again = grpo_loss(padded, config)
    assert again.loss_sum.item() == pytest.approx(out.loss_sum.item(), rel=1e-12)
    assert again.clipped_tokens.item() == out.clipped_tokens.item()
    sums = {k: float(v) for k, v in out.variant_sums.items()}
    assert all(isinstance(v, float) for v in variant_metrics(sums, config).values())
