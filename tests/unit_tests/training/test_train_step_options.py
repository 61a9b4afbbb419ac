"""The optional parts of a GRPO step: step-0 invariants, IS correction, iterations, packing, KL.

All on one rank with a tiny GPT and synthetic rollouts; values are compared with what the
definitions give by hand (ratio exactly 1 and KL exactly 0 before any update, IS weight exactly 1
when the engine's logprobs equal the trainer's).
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch
from grpo_testing.models import VOCAB, tiny_args
from grpo_testing.rollouts import synthetic_groups
from megatron.core import parallel_state

from megatron.rl.grpo.batch import TrainBatch, build_train_batch
from megatron.rl.grpo.importance import ImportanceConfig
from megatron.rl.grpo.loss import GRPOLossConfig
from megatron.training.initialize import ParallelContext, set_seeds
from megatron.training.model_provider import build_model
from megatron.training.optimizer import build_optimizer
from megatron.training.reference import build_reference_model
from megatron.training.train_step import (
    MicroBatchTerms,
    StepOptions,
    forward_backward_step,
    policy_logprobs,
    train_step,
)

pytestmark = pytest.mark.usefixtures("single_rank_world")
MICRO = 8


def run_args(**overrides) -> argparse.Namespace:
    args = tiny_args()
    args.__dict__.update(
        seed=5, lr=1e-2, min_lr=1e-3, lr_warmup_iters=0, lr_decay_style="cosine", train_iters=10,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.99, adam_eps=1e-8, grpo_kl_beta=0.1,
        ref_load=None,
    )  # fmt: skip
    args.__dict__.update(overrides)
    return args


def context() -> ParallelContext:
    parallel_state.initialize_model_parallel()
    return ParallelContext(
        rank=0, world_size=1, device=torch.device("cpu"), tp_rank=0, tp_size=1, dp_rank=0,
        dp_size=1, tp_group=parallel_state.get_tensor_model_parallel_group(),
        dp_group=parallel_state.get_data_parallel_group(),
    )  # fmt: skip


def setup(ctx: ParallelContext, **overrides):
    """Policy (from the seed), its reference copy, optimizer and scheduler."""
    args = run_args(**overrides)
    set_seeds(args.seed, cuda=False)
    model = build_model(args, VOCAB, ctx.device)
    reference = build_reference_model(args, model, VOCAB, ctx)
    optimizer, scheduler = build_optimizer(model, args)
    return model, reference, optimizer, scheduler


def batch(seed: int = 0) -> TrainBatch:
    return build_train_batch(synthetic_groups(4, 4, VOCAB, seed=seed), pad_id=0)


def step(model, optimizer, scheduler, b, ctx, loss=GRPOLossConfig(), **options):
    return train_step(
        model, optimizer, scheduler, b, MICRO, 1.0, loss, VOCAB, ctx, StepOptions(**options)
    )


def test_first_micro_batch_has_ratio_one_and_zero_kl():
    ctx = context()
    model, reference, *_ = setup(ctx)
    micro = batch().rows(0, MICRO)
    options = StepOptions(iterations=2, reference_model=reference, importance=ImportanceConfig(2.0))
    terms = MicroBatchTerms()
    model.train()
    out = forward_backward_step(
        model, micro, GRPOLossConfig(kl_beta=0.1), micro.num_loss_tokens, VOCAB, ctx,
        options, terms,
    )  # fmt: skip
    assert out.ratio_sum.item() == micro.num_loss_tokens  # pi / pi_old == 1 on every token
    assert out.clipped_tokens.item() == 0 and out.mismatch_kl_sum.item() == 0
    assert out.ref_kl_sum.item() == 0.0  # reference == initial weights
    assert torch.equal(terms.ref_logprobs * micro.loss_mask, terms.old_logprobs * micro.loss_mask)


def test_is_weight_is_one_when_inference_logprobs_equal_train_logprobs():
    ctx = context()
    model, _, optimizer, scheduler = setup(ctx)
    b = batch()
    width = b.input_ids.shape[1]
    with torch.no_grad():  # the micro-batches train_step will run, padded back to full width
        parts = [policy_logprobs(model, b.rows(s, s + MICRO), VOCAB, ctx)[0] for s in (0, 8)]
    logprobs = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])
    same = dataclasses.replace(b, inference_logprobs=logprobs * b.loss_mask)
    corrected = step(model, optimizer, scheduler, same, ctx, importance=ImportanceConfig(2.0))
    assert corrected.extra["is_weight_mean"] == 1.0
    assert corrected.extra["is_abs_delta_p"] == 0.0 and corrected.extra["is_kl"] == 0.0
    assert corrected.extra["is_truncated_fraction"] == 0.0
    assert corrected.ratio_mean == 1.0

    plain_model, _, plain_opt, plain_sched = setup(ctx)
    plain = step(plain_model, plain_opt, plain_sched, same, ctx)
    assert corrected.loss == pytest.approx(plain.loss, rel=1e-6, abs=1e-9)
    assert corrected.grad_norm == pytest.approx(plain.grad_norm, rel=1e-6)


def test_mismatch_metrics_are_measured_against_the_engine_logprobs():
    ctx = context()
    model, _, optimizer, scheduler = setup(ctx)
    result = step(model, optimizer, scheduler, batch(), ctx, importance=ImportanceConfig(1.5))
    extra = result.extra
    assert extra["is_abs_delta_p"] > 0 and extra["is_kl"] > 0
    assert 0 < extra["is_truncated_fraction"] <= extra["is_truncated_sequence_fraction"] <= 1
    assert extra["is_weight_mean"] <= 1.5
    assert result.ratio_mean == 1.0  # one iteration: every ratio is against pi_old == pi_theta


def test_iterations_reuse_the_batch_with_one_schedule_step():
    ctx = context()
    model, _, optimizer, scheduler = setup(ctx)
    result = step(model, optimizer, scheduler, batch(), ctx, iterations=3)
    assert scheduler.num_steps == 1  # the LR schedule advances once per step
    assert optimizer.state[next(iter(model.parameters()))]["step"].item() == 3  # three updates
    assert result.ratio_mean != 1.0  # iterations 2 and 3 moved away from pi_old
    assert result.trained_tokens == 3 * int(batch().lengths.sum())


def test_packed_step_matches_unpacked_step():
    ctx = context()
    results = []
    for capacity in (None, 32):
        model, reference, optimizer, scheduler = setup(ctx)
        loss = GRPOLossConfig(kl_beta=0.1, entropy_weight=0.01)
        r = step(
            model, optimizer, scheduler, batch(), ctx, loss, reference_model=reference,
            packing_capacity=capacity,
        )  # fmt: skip
        r2 = step(model, optimizer, scheduler, batch(1), ctx, loss, reference_model=reference,
                  packing_capacity=capacity)  # fmt: skip
        results.append((r, r2))
    (a, a2), (b, b2) = results
    for x, y in ((a, b), (a2, b2)):
        assert x.loss == pytest.approx(y.loss, abs=1e-5)
        assert x.grad_norm == pytest.approx(y.grad_norm, rel=1e-5)
        assert x.extra["entropy"] == pytest.approx(y.extra["entropy"], abs=1e-5)
        assert x.extra["ref_kl"] == pytest.approx(y.extra["ref_kl"], abs=1e-6)


def test_kl_penalty_pulls_towards_the_reference():
    ctx = context()
    model, reference, optimizer, scheduler = setup(ctx)
    loss = GRPOLossConfig(kl_beta=0.1)
    first = step(model, optimizer, scheduler, batch(), ctx, loss, reference_model=reference)
    second = step(model, optimizer, scheduler, batch(1), ctx, loss, reference_model=reference)
    assert first.extra["ref_kl"] == 0.0  # one update, computed before it: still the reference
    assert second.extra["ref_kl"] > 0.0
    for p, q in zip(reference.parameters(), setup(ctx)[0].parameters()):
        assert torch.equal(p, q)  # the reference never trains


def test_kl_without_reference_model_is_an_error():
    ctx = context()
    model, _, optimizer, scheduler = setup(ctx)
    with pytest.raises(ValueError, match="reference_model"):
        step(model, optimizer, scheduler, batch(), ctx, GRPOLossConfig(kl_beta=0.1))


def options_steps(rank: int, world_size: int, tp: int):
    """Two steps with every optional term on, on ``world_size`` gloo ranks with TP ``tp``."""
    from megatron.training.initialize import initialize_distributed

    args = run_args(tensor_model_parallel_size=tp, distributed_timeout_minutes=1)
    ctx = initialize_distributed(args)
    model = build_model(args, VOCAB, ctx.device)
    reference = build_reference_model(args, model, VOCAB, ctx)
    optimizer, scheduler = build_optimizer(model, args)
    options = StepOptions(
        iterations=2, reference_model=reference, importance=ImportanceConfig(1.5),
        packing_capacity=16,
    )  # fmt: skip
    loss = GRPOLossConfig(kl_beta=0.1, entropy_weight=0.01)
    results = []
    for seed in range(2):
        r = train_step(model, optimizer, scheduler, batch(seed), 4, 1.0, loss, VOCAB, ctx, options)
        results.append((r.loss, r.grad_norm, r.ratio_mean, r.extra))
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
