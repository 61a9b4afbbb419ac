"""Loss functions of ``Policy.train`` (``megatron/trainer/train/policy.py``): the GRPO loss the
training loop uses, and a token-mean negative log-likelihood (supervised fine-tuning)."""

from __future__ import annotations

from dataclasses import fields

import torch

from megatron.rl.grpo.batch import TrainBatch
from megatron.rl.grpo.importance import MISMATCH_SUMS, mismatch_metrics
from megatron.rl.grpo.loss import variant_metrics
from megatron.trainer.train.step import (
    LossFunction,
    MicroBatch,
    MicroBatchCache,
    MicroBatchLoss,
    NamedSums,
    StepConfig,
    TeacherLogprobs,
    micro_batch_loss,
)


class GRPOLoss(LossFunction):
    """The GRPO loss of ``step.micro_batch_loss`` (``megatron/rl/grpo/loss.py``) for one global
    batch, with its pi_old and pi_ref when computed up front.

    ``old_logprobs`` / ``ref_logprobs`` / ``teacher``: (B, T) ``Policy.get_logprobs`` /
    ``get_reference_policy_logprobs`` / ``get_teacher_logprobs`` of the ``data`` given to
    ``train``; a micro-batch's cache takes its rows the first time it is trained (pi_old otherwise
    comes from that first forward).
    """

    def __init__(
        self,
        config: StepConfig,
        old_logprobs: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
        teacher: TeacherLogprobs | None = None,
    ) -> None:
        self.config = config
        self.old_logprobs = old_logprobs
        self.ref_logprobs = ref_logprobs
        self.teacher = teacher

    @property
    def needs_entropy(self) -> bool:
        """Whether a loss term reads the entropy."""
        return self.config.needs_entropy

    def metric_keys(self) -> tuple[str, ...]:
        """The surrogate's statistics and each term's metric, sorted."""
        return tuple(k for k in self.config.metric_keys() if k != "loss")

    def support_ids(self, micro: MicroBatch) -> torch.Tensor | None:
        """With the top-k distillation variant, the (b, t, k) teacher's top-k ids of ``micro``
        (from its cache, else its rows of the up-front tensors; the forward moves them to its
        device, and the cache is filled on the loss's device by ``__call__``)."""
        if self.config.distill is None or self.config.distill.topk is None:
            return None
        if micro.cache.teacher is not None:
            return micro.cache.teacher.topk_ids
        if self.teacher is None or self.teacher.topk_ids is None:
            return None
        return self.teacher.topk_ids[micro.rows, : micro.data.input_ids.shape[1]]

    def __call__(
        self,
        micro: MicroBatch,
        logprobs: torch.Tensor,
        entropy: torch.Tensor | None,
        support: torch.Tensor | None = None,
    ) -> MicroBatchLoss:
        """The GRPO loss sums of ``micro`` (filling its cache from the up-front tensors)."""
        cache = self._cached(micro, logprobs.device)
        out = micro_batch_loss(logprobs, entropy, micro.data, self.config, cache, support)
        sums = out.metric_sums()
        del sums["loss"]
        return MicroBatchLoss(out.loss_sum, sums)

    def _cached(self, micro: MicroBatch, device: torch.device) -> MicroBatchCache:
        """``micro``'s cache, its empty entries filled with its rows of the up-front tensors."""
        cache, rows, width = micro.cache, micro.rows, micro.data.input_ids.shape[1]
        if cache.old_logprobs is None and self.old_logprobs is not None:
            cache.old_logprobs = self.old_logprobs[rows, :width].to(device)
        if cache.ref_logprobs is None and self.ref_logprobs is not None:
            cache.ref_logprobs = self.ref_logprobs[rows, :width].to(device)
        if cache.teacher is None and self.teacher is not None:
            parts = (getattr(self.teacher, f.name) for f in fields(self.teacher))
            cache.teacher = TeacherLogprobs(
                *(None if x is None else x[rows, :width].to(device) for x in parts)
            )
        return cache

    def normalizer(self, data: TrainBatch) -> int:
        """The denominator of ``--loss-agg-mode`` (``megatron/rl/grpo/aggregation.py``): the
        global batch's loss tokens, or its sequences with loss tokens."""
        return self.config.loss.aggregation.denominator(data)

    def extra_sums(self, caches: list[MicroBatchCache]) -> NamedSums | None:
        """With the IS correction, the mismatch sums of the micro-batches (measured once)."""
        if self.config.importance is None:
            return None
        keys = tuple(sorted(MISMATCH_SUMS))
        mismatch = [NamedSums.of(c.mismatch, keys).values for c in caches if c.mismatch is not None]
        total = torch.stack(mismatch).sum(0) if mismatch else NamedSums.zeros(keys).values
        return NamedSums(keys, total)

    def metrics(self, sums: dict[str, float], num_tokens: int) -> dict[str, float]:
        """Per-token means of the metric sums (``distill/*`` included), the policy-loss
        variants' per-sequence metrics (their sums with a ``/`` in the name) and the ``is_*``
        metrics of the IS correction."""
        denom = max(num_tokens, 1)
        per_token = [k for k in self.metric_keys() if "/" not in k or k.startswith("distill/")]
        metrics = {k: sums[k] / denom for k in per_token}
        metrics.update(variant_metrics(sums, self.config.loss))
        if self.config.importance is not None:
            metrics.update(mismatch_metrics(sums, self.config.importance))
        return metrics


class TokenMeanNLL(LossFunction):
    """Supervised fine-tuning: -log pi(target) of the loss-mask tokens, averaged over the global
    batch's loss tokens (at each row's temperature: use 1 for plain likelihood)."""

    def metric_keys(self) -> tuple[str, ...]:
        """No metric besides the loss."""
        return ()

    def __call__(
        self,
        micro: MicroBatch,
        logprobs: torch.Tensor,
        entropy: torch.Tensor | None,
        support: torch.Tensor | None = None,
    ) -> MicroBatchLoss:
        """Sum of -log pi over the micro-batch's loss tokens."""
        mask = micro.data.loss_mask.to(logprobs.device)  # (b, t)
        return MicroBatchLoss(-(logprobs * mask).sum(), {})
