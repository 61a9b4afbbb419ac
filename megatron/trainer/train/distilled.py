"""The GRPO loss of a distilling step (``--distill-teacher``): the teacher's term in each token's
advantage (sampled-token variant) or the top-k reverse KL added to each token's loss, and the
``distill/*`` sums (``megatron/rl/grpo/distill.py``)."""

from __future__ import annotations

import dataclasses

import torch

from megatron.rl.grpo.distill import (
    DistillConfig,
    distill_sums,
    sequence_advantages,
    teacher_advantages,
    topk_reverse_kl,
    topk_sums,
)
from megatron.rl.grpo.loss import GRPOLossConfig, LossInputs, LossOutput, grpo_loss
from megatron.trainer.train.cache import MicroBatchCache


def distilled_loss(
    inputs: LossInputs,
    targets: torch.Tensor,
    support: torch.Tensor | None,
    distill: DistillConfig,
    loss: GRPOLossConfig,
    cache: MicroBatchCache,
) -> LossOutput:
    """The loss of one micro-batch from its ``inputs``, (b, t) ``targets`` and, for the top-k
    variant, the policy's (b, t, k) differentiable logprobs of the teacher's top-k ids.

    pi_old (the student's logprob in the teacher term and the metrics) is the cache's, or this
    forward's on first use (no update came before it).
    """
    teacher = cache.teacher
    if teacher is None:
        raise ValueError(
            "distillation needs the teacher's logprobs (Policy.get_teacher_logprobs), but none "
            "were given"
        )
    if cache.old_logprobs is None:  # first use: pi_old is the current policy
        cache.old_logprobs = inputs.trainer_logprobs.detach()
    student, mask = cache.old_logprobs, inputs.loss_mask
    token_advantages = None
    if distill.topk is None:
        token_advantages = teacher_advantages(teacher.logprobs, student, mask, distill)
    inputs = dataclasses.replace(
        inputs,
        advantages=sequence_advantages(inputs.advantages, distill),
        token_advantages=token_advantages,
    )
    out = grpo_loss(inputs, loss)
    sums = distill_sums(teacher.logprobs, student, teacher.argmax, targets, mask)
    if distill.topk is None:
        return dataclasses.replace(out, variant_sums={**out.variant_sums, **sums})
    if support is None or teacher.topk_logprobs is None:
        raise ValueError(
            "the top-k distillation loss needs the policy's and the teacher's logprobs of the "
            "teacher's top-k ids, but none were given"
        )
    kl = topk_reverse_kl(support, teacher.topk_logprobs, mask)  # (b, t)
    sums.update(topk_sums(kl, support, teacher.topk_logprobs, mask))
    return dataclasses.replace(
        out,
        loss_sum=out.loss_sum + loss.aggregation.micro_batch_sum(distill.coef * kl, mask),
        variant_sums={**out.variant_sums, **sums},
    )
