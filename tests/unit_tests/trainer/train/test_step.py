"""The shared GRPO step (``megatron/trainer/train/step.py``) on the CPU tier: step-0 invariants, IS
correction, iterations sharing pi_old, packing, the KL term, named metrics.

All on one rank with a tiny GPT and synthetic rollouts; values are compared with what the
definitions give by hand (ratio exactly 1 and KL exactly 0 before any update, IS weight exactly 1
when the engine's logprobs equal the trainer's).
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch
from grpo_testing.batches import build_train_batch
from grpo_testing.models import VOCAB, tiny_args
from grpo_testing.rollouts import synthetic_groups
from grpo_testing.trainer import grpo_update, one_rank_context
from megatron.core import parallel_state

from megatron.rl.grpo.batch import TrainBatch
from megatron.rl.grpo.importance import ImportanceConfig
from megatron.rl.grpo.kl import reference_kl
from megatron.rl.grpo.loss import GRPOLossConfig
from megatron.rl.grpo.terms.entropy_bonus import EntropyBonus
from megatron.rl.grpo.terms.reference_kl import ReferenceKL
from megatron.trainer.checkpoint.directory import TrainState
from megatron.trainer.config import model_build, optimizer_settings, tier_config
from megatron.trainer.model.provider import build_model
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.runtime.initialize import set_seeds
from megatron.trainer.tiers.cpu import CPUPolicy, CPUTier
from megatron.trainer.tiers.reference import build_reference_model
from megatron.trainer.train.optimizer import build_optimizer
from megatron.trainer.train.policy import PolicyConfig
from megatron.trainer.train.step import (
    MicroBatchCache,
    StepConfig,
    micro_batch_loss,
    policy_outputs,
)

KL = (ReferenceKL(0.1),)
KL_AND_ENTROPY = (ReferenceKL(0.1), EntropyBonus(0.01))

pytestmark = pytest.mark.usefixtures("single_rank_world")
MICRO = 8


def run_args(**overrides) -> argparse.Namespace:
    args = tiny_args()
    args = args.with_flags(
        seed=5,
        lr=1e-2,
        min_lr=1e-3,
        lr_warmup_iters=0,
        lr_decay_style="cosine",
        train_iters=10,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.99,
        adam_eps=1e-8,
        grpo_kl_beta=0.1,
        ref_load=None,
    )
    args = args.with_flags(**overrides)
    return args


def context() -> ParallelContext:
    parallel_state.initialize_model_parallel()
    return one_rank_context()


def setup(ctx: ParallelContext, **overrides) -> tuple[TrainState, torch.nn.Module]:
    """Policy (from the seed) with its optimizer and scheduler, and its reference copy."""
    args = run_args(**overrides)
    set_seeds(args.training.seed, cuda=False)
    model = build_model(model_build(args), VOCAB, ctx.device)
    tier = CPUTier(tier_config(args), ctx)
    reference = build_reference_model(tier, model, VOCAB, needs_reference=True)
    return TrainState(model, *build_optimizer(model, optimizer_settings(args))), reference


def batch(seed: int = 0) -> TrainBatch:
    return build_train_batch(synthetic_groups(4, 4, VOCAB, seed=seed), pad_id=0)


def config(terms=(), micro_batch_size=MICRO, **options) -> StepConfig:
    loss = GRPOLossConfig(0.2, 0.28, terms=tuple(terms))
    return StepConfig(loss, VOCAB, micro_batch_size, clip_grad=1.0, **options)


def train_step(state, b, cfg, ctx, reference=None, caches=None):
    """One GRPO update through the CPU tier's policy."""
    policy = CPUPolicy(state, PolicyConfig.of(cfg), ctx, reference)
    return grpo_update(policy, b, cfg, caches)


def step(state, b, ctx, terms=(), reference=None, caches=None, **options):
    return train_step(state, b, config(terms, **options), ctx, reference, caches)


def test_first_micro_batch_has_ratio_one_and_zero_kl():
    ctx = context()
    state, reference = setup(ctx)
    micro = batch().rows(0, MICRO)
    cfg = config(KL, old_logprobs=True, importance=ImportanceConfig.tis(2.0))
    cache = MicroBatchCache()
    state.model.train()
    logprobs = policy_outputs(state.model, micro, VOCAB, ctx).logprobs
    with torch.no_grad():
        cache.ref_logprobs = policy_outputs(reference, micro, VOCAB, ctx).logprobs
    out = micro_batch_loss(logprobs, None, micro, cfg, cache)
    assert out.ratio_sum.item() == micro.num_loss_tokens  # pi / pi_old == 1 on every token
    assert out.clipped_tokens.item() == 0 and out.mismatch_kl_sum.item() == 0
    assert out.term_sums["ref_kl"].item() == 0.0  # reference == initial weights
    assert torch.equal(cache.ref_logprobs * micro.loss_mask, cache.old_logprobs * micro.loss_mask)


def test_is_weight_is_one_when_inference_logprobs_equal_train_logprobs():
    ctx = context()
    state, _ = setup(ctx)
    b = batch()
    width = b.input_ids.shape[1]
    with torch.no_grad():  # the micro-batches train_step will run, padded back to full width
        parts = [
            policy_outputs(state.model, b.rows(s, s + MICRO), VOCAB, ctx).logprobs for s in (0, 8)
        ]
    logprobs = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])
    same = dataclasses.replace(b, inference_logprobs=logprobs * b.loss_mask)
    corrected = step(state, same, ctx, importance=ImportanceConfig.tis(2.0))
    assert corrected.metrics["is_weight_mean"] == 1.0
    assert corrected.metrics["is_abs_delta_p"] == 0.0 and corrected.metrics["is_kl"] == 0.0
    assert corrected.metrics["is_truncated_fraction"] == 0.0
    assert corrected.metrics["ratio_mean"] == 1.0

    plain_state, _ = setup(ctx)
    plain = step(plain_state, same, ctx)
    assert corrected.loss == pytest.approx(plain.loss, rel=1e-6, abs=1e-9)
    assert corrected.grad_norm == pytest.approx(plain.grad_norm, rel=1e-6)


def test_mismatch_metrics_are_measured_against_the_engine_logprobs():
    ctx = context()
    state, _ = setup(ctx)
    result = step(state, batch(), ctx, importance=ImportanceConfig.tis(1.5))
    extra = result.metrics
    assert extra["is_abs_delta_p"] > 0 and extra["is_kl"] > 0
    assert 0 < extra["is_truncated_fraction"] <= extra["is_truncated_sequence_fraction"] <= 1
    assert extra["is_weight_mean"] <= 1.5
    assert extra["ratio_mean"] == 1.0  # one iteration: every ratio is against pi_old == pi_theta


def test_iterations_over_one_batch_share_pi_old_and_each_step_the_schedule():
    ctx = context()
    state, _ = setup(ctx)
    b = batch()
    caches = [MicroBatchCache(), MicroBatchCache()]  # this batch's two micro-batches
    results = [step(state, b, ctx, old_logprobs=True, caches=caches) for _ in range(3)]
    assert state.scheduler.num_steps == 3  # the LR schedule advances every iteration
    first_param = next(iter(state.model.parameters()))
    assert state.optimizer.state[first_param]["step"].item() == 3  # three updates
    ratios = [r.metrics["ratio_mean"] for r in results]
    assert ratios[0] == 1.0 and ratios[1] != 1.0 and ratios[2] != ratios[1]  # against pi_old
    assert all(c.old_logprobs is not None for c in caches)
    assert [r.trained_tokens for r in results] == [int(b.lengths.sum())] * 3
    assert results[0].lr > results[1].lr > results[2].lr  # cosine decay, one step each


def test_packed_step_matches_unpacked_step():
    ctx = context()
    results = []
    for capacity in (None, 32):
        state, reference = setup(ctx)
        r = step(state, batch(), ctx, KL_AND_ENTROPY, reference, packing_capacity=capacity)
        r2 = step(state, batch(1), ctx, KL_AND_ENTROPY, reference, packing_capacity=capacity)
        results.append((r, r2))
    (a, a2), (b, b2) = results
    for x, y in ((a, b), (a2, b2)):
        assert x.loss == pytest.approx(y.loss, abs=1e-5)
        assert x.grad_norm == pytest.approx(y.grad_norm, rel=1e-5)
        assert x.metrics["entropy"] == pytest.approx(y.metrics["entropy"], abs=1e-5)
        assert x.metrics["ref_kl"] == pytest.approx(y.metrics["ref_kl"], abs=1e-6)


def distance_to_reference(model, reference, ctx) -> float:
    """Mean k3 KL(model || reference) over the generated tokens of a held-out batch."""
    held = batch(seed=99)
    with torch.no_grad():
        logprobs = policy_outputs(model, held, VOCAB, ctx).logprobs
        ref_logprobs = policy_outputs(reference, held, VOCAB, ctx).logprobs
    kl = reference_kl(logprobs, ref_logprobs, held.loss_mask)
    return float((kl * held.loss_mask).sum() / held.loss_mask.sum())


def test_kl_penalty_pulls_towards_the_reference():
    ctx = context()
    distances, logged = {}, {}
    for beta in (0.0, 1.0):
        state, reference = setup(ctx)
        terms = (ReferenceKL(beta),) if beta else ()
        results = [step(state, batch(s), ctx, terms, reference) for s in range(4)]
        distances[beta] = distance_to_reference(state.model, reference, ctx)
        logged[beta] = [r.metrics.get("ref_kl") for r in results]
        for p, q in zip(reference.parameters(), setup(ctx)[0].model.parameters()):
            assert torch.equal(p, q)  # the reference never trains
    assert logged[0.0] == [None] * 4  # no term, no metric
    assert logged[1.0][0] == 0.0  # one update, computed before it: still the reference
    assert all(kl > 0 for kl in logged[1.0][1:])
    assert 0 < distances[1.0] < 0.8 * distances[0.0]  # the penalty keeps the policy closer


def test_kl_without_reference_model_is_an_error():
    ctx = context()
    state, _ = setup(ctx)
    with pytest.raises(ValueError, match="no reference model"):
        step(state, batch(), ctx, KL)


def test_metrics_are_reported_by_name():
    ctx = context()
    state, reference = setup(ctx)
    result = step(
        state, batch(), ctx, KL_AND_ENTROPY, reference, importance=ImportanceConfig.tis(1.0)
    )
    assert set(result.metrics) == {
        "clip_fraction",
        "ratio_mean",
        "mismatch_kl",
        "entropy",
        "ref_kl",
        "is_abs_delta_p",
        "is_kl",
        "is_weight_mean",
        "is_truncated_fraction",
        "is_truncated_sequence_fraction",
    }
    plain = step(setup(ctx)[0], batch(), ctx)
    assert set(plain.metrics) == {"clip_fraction", "ratio_mean", "mismatch_kl"}


def options_steps(rank: int, world_size: int, tp: int):
    """Two steps with every optional term on, on ``world_size`` gloo ranks with TP ``tp``."""
    from megatron.trainer.runtime.initialize import initialize_distributed

    args = run_args(tensor_model_parallel_size=tp, distributed_timeout_minutes=1)
    ctx = initialize_distributed(args)
    model = build_model(model_build(args), VOCAB, ctx.device)
    tier = CPUTier(tier_config(args), ctx)
    reference = build_reference_model(tier, model, VOCAB, needs_reference=True)
    state = TrainState(model, *build_optimizer(model, optimizer_settings(args)))
    cfg = config(
        KL_AND_ENTROPY,
        micro_batch_size=4,
        old_logprobs=True,
        importance=ImportanceConfig.tis(1.5),
        packing_capacity=16,
    )
    results = []
    for seed in range(2):
        caches = None
        for _ in range(2):  # two iterations over the batch, sharing pi_old
            if caches is None:
                per_rank = 16 // ctx.dp_size // 4
                caches = [MicroBatchCache() for _ in range(per_rank)]
            r = train_step(state, batch(seed), cfg, ctx, reference, caches)
            metrics = dict(r.metrics)
            results.append((r.loss, r.grad_norm, metrics.pop("ratio_mean"), metrics))
    return results


@pytest.mark.parametrize(
    "world_size, tp",
    [pytest.param(2, 1, id="data-parallel-2"), pytest.param(2, 2, id="tensor-parallel-2")],
)
def test_optional_terms_are_invariant_to_the_parallel_layout(world_size, tp):
    from grpo_testing.distributed import run_on_ranks

    (reference,) = run_on_ranks(options_steps, 1, 1)
    for rank_result in run_on_ranks(options_steps, world_size, tp):
        for (loss, norm, ratio, extra), (want_loss, want_norm, want_ratio, want_extra) in zip(
            rank_result, reference
        ):
            assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
            assert norm == pytest.approx(want_norm, rel=1e-5)
            assert ratio == pytest.approx(want_ratio, rel=1e-6)
            assert extra.keys() == want_extra.keys()
            for key in extra:
                assert extra[key] == pytest.approx(want_extra[key], rel=1e-5, abs=1e-7), key
