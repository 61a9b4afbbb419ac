"""The MoE part of the CPU tier's update: the aux loss's gradient is c times the gradient of the
mean aux loss over the micro-batches, and the step reports ``moe_aux_loss`` and
``moe_load_imbalance`` (only for MoE models)."""

from __future__ import annotations

import pytest
import torch
from grpo_testing.batches import build_train_batch
from grpo_testing.models import VOCAB
from grpo_testing.rollouts import synthetic_groups
from grpo_testing.trainer import grpo_update, one_rank_context, train_args
from megatron.core import parallel_state

from megatron.rl.grpo.loss import GRPOLossConfig
from megatron.rl.models.moe import set_aux_loss_scale
from megatron.trainer.checkpoint.directory import TrainState
from megatron.trainer.config import tier_config
from megatron.trainer.tiers.cpu import CPUTier
from megatron.trainer.train.policy import PolicyConfig, plan_updates
from megatron.trainer.train.step import StepConfig, policy_outputs

MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, disable_bias_linear=True)
COEFF = 0.5


def update_gradients(tier: CPUTier, weights: dict | None, batch):
    """One GRPO update of ``batch`` (4 micro-batches, no clipping); the gradients it applied and
    its result."""
    torch.manual_seed(3)
    model = tier.build_model(VOCAB)
    if weights is not None:
        model.load_state_dict(weights)
    state = TrainState(model, *tier.build_optimizer(model))
    grads: list[torch.Tensor] = []
    step = state.optimizer.step

    def keep_and_step(*args, **kwargs):
        grads.extend(p.grad.detach().clone() for p in model.parameters())
        return step(*args, **kwargs)

    state.optimizer.step = keep_and_step
    config = StepConfig(GRPOLossConfig(0.2, 0.28), VOCAB, 4, clip_grad=0.0)  # measure only
    result = grpo_update(tier.build_policy(state, PolicyConfig.of(config)), batch, config)
    return model, grads, result


@pytest.fixture
def world(single_rank_world):
    parallel_state.initialize_model_parallel()


def test_aux_gradient_is_the_mean_over_micro_batches_and_metrics_report_it(world):
    batch = build_train_batch(synthetic_groups(4, 4, VOCAB, seed=1), pad_id=0)
    ctx = one_rank_context()
    with_aux = CPUTier(tier_config(train_args(**MOE, moe_aux_loss_coeff=COEFF)), ctx)
    without = CPUTier(tier_config(train_args(**MOE, moe_aux_loss_coeff=0.0)), ctx)
    torch.manual_seed(3)
    weights = with_aux.build_model(VOCAB).state_dict()
    _, grads_aux, result = update_gradients(with_aux, weights, batch)
    _, grads_plain, plain = update_gradients(without, weights, batch)

    # by hand: c * d/dw (1/M) sum_m aux_m over the update's own micro-batches
    reference = with_aux.build_model(VOCAB)
    reference.load_state_dict(weights)
    reference.train()
    (update,) = plan_updates(batch, ctx, None, 4, None)
    micros = update.micro_batches
    assert len(micros) == 4
    set_aux_loss_scale(1.0 / len(micros), ctx.device)
    aux_values = []
    for micro in micros:
        logprobs = policy_outputs(reference, micro.data, VOCAB, ctx).logprobs
        (logprobs.sum() * 0).backward()  # only the aux loss's gradient
        routers = [layer.mlp.router for layer in reference.decoder.layers]
        aux_values.append(float(sum(r.last_aux_loss for r in routers)))
    expected = [p.grad for p in reference.parameters()]
    router_grads = 0
    for got, plain_grad, want in zip(grads_aux, grads_plain, expected):
        want = torch.zeros_like(got) if want is None else want
        torch.testing.assert_close(got - plain_grad, want, rtol=1e-4, atol=1e-7)
        router_grads += int(want.abs().sum() > 0)
    assert router_grads >= 2  # the aux loss reached both layers' routers

    assert result.metrics["moe_aux_loss"] == pytest.approx(sum(aux_values) / len(aux_values))
    assert result.metrics["moe_aux_loss"] > 0 and result.metrics["moe_load_imbalance"] >= 1.0
    assert "moe_aux_loss" not in plain.metrics and plain.metrics["moe_load_imbalance"] >= 1.0
    assert result.loss == pytest.approx(plain.loss, rel=1e-6)  # the aux loss is not in "loss"


def test_dense_step_has_no_moe_metrics(world):
    batch = build_train_batch(synthetic_groups(2, 4, VOCAB, seed=1), pad_id=0)
    tier = CPUTier(tier_config(train_args()), one_rank_context())
    _, _, result = update_gradients(tier, None, batch)
    assert not any(k.startswith("moe_") for k in result.metrics)
