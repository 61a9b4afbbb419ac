"""The loss of a distilling step (``distilled.py``): the sampled-token variant's teacher term in
the advantage, the top-k variant's reverse KL added to each token's loss, summed like the
surrogate, with the ``distill/*`` sums."""

from __future__ import annotations

import math

import pytest
import torch
from grpo_testing.batches import build_train_batch
from grpo_testing.rollouts import synthetic_groups

from megatron.rl.grpo.aggregation import LossAggregation
from megatron.rl.grpo.distill import DISTILL_SUMS, TOPK_SUMS, DistillConfig, topk_reverse_kl
from megatron.rl.grpo.loss import GRPOLossConfig, LossInputs, grpo_loss
from megatron.trainer.train.cache import MicroBatchCache, TeacherLogprobs
from megatron.trainer.train.distilled import distilled_loss
from megatron.trainer.train.losses import GRPOLoss
from megatron.trainer.train.step import MicroBatch, StepConfig

TARGETS = torch.tensor([[3, 1, 2], [0, 2, 2]])  # (B=2, T=3)
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def inputs() -> LossInputs:
    """Ratio 1 everywhere, sequence advantages 1 and -0.5."""
    g = torch.Generator().manual_seed(0)
    trainer = torch.log_softmax(torch.randn(2, 3, 4, generator=g), -1)
    logprobs = trainer.gather(-1, TARGETS[..., None])[..., 0].requires_grad_()
    return LossInputs(
        trainer_logprobs=logprobs,
        inference_logprobs=logprobs.detach().clone(),
        advantages=torch.tensor([1.0, -0.5]),
        loss_mask=MASK,
    )


def teacher(k: int | None) -> TeacherLogprobs:
    """A teacher over 4 ids; with ``k``, its top-k."""
    log_q = torch.log_softmax(torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1)), -1)
    logprobs = log_q.gather(-1, TARGETS[..., None])[..., 0]
    if k is None:
        return TeacherLogprobs(logprobs, log_q.argmax(-1))
    top = log_q.topk(k, dim=-1)
    return TeacherLogprobs(logprobs, top.indices[..., 0], top.values, top.indices)


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param("token-mean", id="token-mean"),
        pytest.param("seq-mean-token-sum-norm", id="dr-grpo"),
    ],
)
def test_top_k_adds_coef_times_the_kl_summed_like_the_surrogate(mode):
    loss = GRPOLossConfig(0.2, 0.2, aggregation=LossAggregation(mode, 3.0))
    distill, view = DistillConfig(0.5, topk=2), teacher(2)
    support = torch.randn(2, 3, 2, generator=torch.Generator().manual_seed(2)).requires_grad_()
    out = distilled_loss(inputs(), TARGETS, support, distill, loss, MicroBatchCache(teacher=view))
    kl = topk_reverse_kl(support, view.topk_logprobs, MASK)
    surrogate = grpo_loss(inputs(), loss).loss_sum  # no teacher term in the advantage
    expected = surrogate + loss.aggregation.micro_batch_sum(0.5 * kl, MASK)
    assert out.loss_sum.item() == pytest.approx(expected.item())
    assert set(DISTILL_SUMS + TOPK_SUMS) <= set(out.variant_sums)
    assert out.variant_sums["distill/topk_kl"].item() == pytest.approx((kl * MASK).sum().item())
    out.loss_sum.backward()
    assert support.grad[0, 2].abs().sum() == 0 and support.grad.abs().sum() > 0  # loss tokens


def test_sampled_token_variant_puts_the_gap_in_the_advantage():
    view = teacher(None)
    loss = GRPOLossConfig(0.2, 0.2)
    base = inputs()
    cache = MicroBatchCache(teacher=view)
    out = distilled_loss(base, TARGETS, None, DistillConfig(1.0), loss, cache)
    gap = (view.logprobs - base.trainer_logprobs.detach()) * MASK  # pi_old: this forward's
    # ratio 1: the loss is -sum (A_i + gap_t) over the loss tokens
    expected = -((base.advantages[:, None] + gap) * MASK).sum()
    assert out.loss_sum.item() == pytest.approx(expected.item())
    assert torch.equal(cache.old_logprobs, base.trainer_logprobs.detach())  # pi_old kept


@pytest.mark.parametrize(
    "support, view, message",
    [
        pytest.param(None, teacher(2), "top-k distillation loss needs", id="no-support"),
        pytest.param(torch.zeros(2, 3, 2), teacher(None), "top-k distillation", id="no-top-k"),
        pytest.param(None, None, "needs the teacher's logprobs", id="no-teacher"),
    ],
)
def test_missing_inputs_are_errors_that_say_what_is_missing(support, view, message):
    config = DistillConfig(1.0, topk=2)
    with pytest.raises(ValueError, match=message):
        distilled_loss(
            inputs(),
            TARGETS,
            support,
            config,
            GRPOLossConfig(0.2, 0.2),
            MicroBatchCache(teacher=view),
        )


def test_a_teacher_equal_to_the_student_on_its_top_k_adds_nothing():
    view = teacher(2)
    support = (view.topk_logprobs + math.log(0.5)).requires_grad_()  # proportional: same shape
    loss = GRPOLossConfig(0.2, 0.2)
    config = DistillConfig(1.0, reward=False, topk=2)
    out = distilled_loss(inputs(), TARGETS, support, config, loss, MicroBatchCache(teacher=view))
    assert out.variant_sums["distill/topk_kl"].item() == pytest.approx(0.0, abs=1e-6)
    out.loss_sum.backward()
    assert support.grad.abs().max().item() < 1e-6


def test_the_loss_names_the_top_k_ids_without_filling_the_cache_before_the_forward():
    """``GRPOLoss.support_ids`` runs before the forward: it must not fill the micro-batch's cache
    (which ``__call__`` fills on the device of the forward's outputs, a GPU on CUDA)."""
    data = build_train_batch(synthetic_groups(1, 4, 8, seed=0), pad_id=0)
    rows, width = data.num_rows, data.input_ids.shape[1]
    ids = torch.arange(rows * width * 2).view(rows, width, 2) % 8
    view = TeacherLogprobs(torch.zeros(rows, width), ids[..., 0], torch.zeros(rows, width, 2), ids)
    config = StepConfig(GRPOLossConfig(0.2, 0.2), 8, 2, 1.0, distill=DistillConfig(1.0, topk=2))
    micro = MicroBatch(data.rows(1, 3, trim=False), slice(1, 3), MicroBatchCache())
    got = GRPOLoss(config, teacher=view).support_ids(micro)
    assert torch.equal(got, ids[1:3]) and micro.cache.teacher is None
    plain = StepConfig(GRPOLossConfig(0.2, 0.2), 8, 2, 1.0, distill=DistillConfig(1.0))
    assert GRPOLoss(plain, teacher=view).support_ids(micro) is None  # sampled-token: no support
