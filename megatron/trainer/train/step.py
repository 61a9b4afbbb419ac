"""The GRPO train step both tiers share: micro-batches, the loss of a micro-batch, the results.

A step is one training iteration: one optimizer update on this rank's data-parallel shard of a
global batch (``collection.py`` cuts each collection into global batches), run by the tier's
``Policy.train`` (``megatron/trainer/train/policy.py``) with a ``LossFunction`` of micro-batches (here,
below the policy that takes it), by default the GRPO loss (``losses.GRPOLoss`` over
``micro_batch_loss``). With the default ``StepConfig`` it is the plain clipped surrogate against
the engine's logprobs. The options (see ``megatron/rl/grpo/loss.py``):

* ``old_logprobs`` (``--grpo-iterations`` > 1 or the IS correction): the ratio's denominator is
  pi_old, the policy that collected the batch, *before its collection's first update*. Each
  micro-batch's ``MicroBatchCache`` holds it across the iterations that reuse the batch: filled
  by the first forward when no update came before it (its ratio is then exactly 1), or computed
  up front (``Policy.get_logprobs``) when a collection has several global batches.
* ``importance`` (``--rl-inference-logprobs-is-correction``): the ratio is against pi_old, and
  each token is weighted by min(pi_old / pi_inference, C); the mismatch metrics are measured the
  first time a micro-batch is trained.
* loss terms (``loss.terms``): a term that requires reference logprobs gets them from the
  reference model (``Policy.get_reference_policy_logprobs``, once per global batch of a
  collection, before its first update); one that requires the entropy gets it from the same
  forward as the logprobs.
* ``distill`` (``--distill-teacher``): each token's advantage gets the teacher term
  c * (log pi_teacher - log pi_old) (``megatron/rl/grpo/distill.py``; pi_old kept as above, but
  not the ratio's denominator unless ``old_logprobs`` or ``importance`` asks), or with its top-k
  variant the reverse KL on the teacher's top-k ids in each token's loss (the forward then also
  gives the policy's logprobs of those ids: ``LossFunction.support_ids``); the teacher's
  logprobs come like pi_ref (``Policy.get_teacher_logprobs``, once per global batch of a
  collection, before its first update), and the ``distill/*`` metrics are reported
  (``distilled.py``).
* ``packing_capacity`` (``--rl-use-sequence-packing``): each micro-batch runs packed
  (``megatron/trainer/train/forward.py``); per-token outputs are unpacked before the loss.

Metrics travel by name (``MicroBatchLoss.metric_sums``): each update adds its micro-batches' sums
as one float64 vector in sorted key order (``NamedSums``), the loss function's extra sums (the IS
mismatch sums of the micro-batches) are appended, and the vector is all-reduced over data
parallelism (and the pipeline on CUDA) before the loss function turns the sums into metrics
(divided by the global number of loss tokens).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.rl.grpo.batch import TrainBatch
from megatron.rl.grpo.distill import DistillConfig
from megatron.rl.grpo.importance import ImportanceConfig, importance_weights, mismatch_sums
from megatron.rl.grpo.loss import GRPOLossConfig, LossInputs, LossOutput, grpo_loss
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.train.cache import MicroBatchCache, TeacherLogprobs
from megatron.trainer.train.distilled import distilled_loss
from megatron.trainer.train.forward import TokenOutputs, forward_token_outputs, model_inputs
from megatron.trainer.train.sums import NamedSums

__all__ = ["MicroBatchCache", "TeacherLogprobs"]  # re-exported: the loss functions' cache

BASE_METRICS = ("clip_fraction", "loss", "mismatch_kl", "ratio_mean")
"""Metric sums every step reports (``LossOutput.metric_sums``), before the terms' own."""


@dataclass(frozen=True)
class StepConfig:
    """What one train step does, independent of the tier."""

    loss: GRPOLossConfig
    """Clipping and the additive loss terms."""
    vocab_size: int
    """Real vocabulary size (padded embedding rows get probability 0)."""
    micro_batch_size: int
    """Rollouts per micro-batch (``--micro-batch-size``)."""
    clip_grad: float
    """Global gradient-norm clip (0: measure only)."""
    old_logprobs: bool = False
    """Take the ratio against pi_old (``--grpo-iterations`` > 1); implied by ``importance``."""
    importance: ImportanceConfig | None = None
    """Truncated IS correction with the engine's logprobs (None: off)."""
    packing_capacity: int | None = None
    """Tokens per packed row (None: no sequence packing)."""
    check_finite: bool = True
    """Refuse an update whose loss or gradient norm is not finite
    (``--check-for-nan-in-loss-and-grad``, ``nonfinite.py``)."""
    distill: DistillConfig | None = None
    """On-policy distillation's teacher term of the advantages (None: off)."""

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether the ratio is taken against the trainer's pre-update policy."""
        return self.old_logprobs or self.importance is not None

    @property
    def needs_pre_update_logprobs(self) -> bool:
        """Whether pi_old is kept per micro-batch: the ratio's denominator, or distillation's
        student logprobs."""
        return self.needs_old_logprobs or self.distill is not None

    @property
    def needs_reference(self) -> bool:
        """Whether a loss term reads the reference policy's logprobs."""
        return self.loss.requires("ref_logprobs")

    @property
    def needs_entropy(self) -> bool:
        """Whether a loss term reads the policy entropy."""
        return self.loss.requires("entropy")

    def metric_keys(self) -> tuple[str, ...]:
        """The names of one update's metric sums, in reduction order (every rank alike)."""
        names = (*BASE_METRICS, *(t.name for t in self.loss.terms), *self.loss.sum_keys())
        return tuple(sorted(names + (self.distill.sum_keys() if self.distill else ())))


@dataclass(frozen=True)
class Update:
    """One optimizer update's results on this rank."""

    sums: NamedSums
    """This rank's metric sums over its micro-batches."""
    grad_norm: float
    lr: float


@dataclass(frozen=True)
class StepResult:
    """Global (all-reduced) results of one step."""

    loss: float
    grad_norm: float
    lr: float
    loss_tokens: int
    trained_tokens: int
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)
    """The loss function's other metrics by name (``LossFunction.metrics``); for GRPO the
    per-loss-token means of ``clip_fraction``, ``ratio_mean``, ``mismatch_kl``, each loss term's
    metric, and the ``is_*`` metrics of the IS correction."""


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a ``train`` call on this rank, as the loss function sees it."""

    data: TrainBatch
    """(b, t) its rows (trimmed to their longest row; the batch's width under PP)."""
    rows: slice
    """Where its rows are in the ``data`` given to ``train``."""
    cache: MicroBatchCache
    """Values kept across the calls that train these rows (pi_old, pi_ref, mismatch sums)."""


@dataclass(frozen=True)
class MicroBatchLoss:
    """What a loss function returns for one micro-batch."""

    loss_sum: torch.Tensor
    """Scalar, differentiable: the loss summed over the micro-batch's tokens (the policy divides
    by the global ``LossFunction.num_tokens``)."""
    metric_sums: dict[str, torch.Tensor]
    """Scalar sums by name, exactly the keys of ``LossFunction.metric_keys``."""


class LossFunction(ABC):
    """A loss of micro-batches, summed over tokens and averaged over a global batch's tokens."""

    needs_entropy: bool = False
    """Whether ``__call__`` reads the policy entropy (the forward computes it only then)."""

    @abstractmethod
    def metric_keys(self) -> tuple[str, ...]:
        """The names of ``MicroBatchLoss.metric_sums`` (not ``loss``: the policy adds it)."""

    @abstractmethod
    def __call__(
        self,
        micro: MicroBatch,
        logprobs: torch.Tensor,
        entropy: torch.Tensor | None,
        support: torch.Tensor | None = None,
    ) -> MicroBatchLoss:
        """The loss of ``micro`` from the policy's (b, t) logprobs of its targets (and its
        (b, t) entropies when ``needs_entropy``, its (b, t, k) logprobs of ``support_ids``),
        all differentiable."""

    def support_ids(self, micro: MicroBatch) -> torch.Tensor | None:
        """(b, t, k) token ids whose logprobs the loss of ``micro`` also reads (default: none)."""
        return None

    def num_tokens(self, data: TrainBatch) -> int:
        """The tokens of ``data`` the loss is averaged over (default: the loss-mask tokens of the
        global batch, also when ``data`` is one rank's shard of it)."""
        return data.global_loss_tokens

    def normalizer(self, data: TrainBatch) -> int:
        """What the loss sums of ``data``'s micro-batches are divided by (global, also when
        ``data`` is a shard): by default ``num_tokens``; a per-sequence aggregation of the loss
        divides by the global batch's sequences instead. The metrics stay per token."""
        return self.num_tokens(data)

    def extra_sums(self, caches: list[MicroBatchCache]) -> NamedSums | None:
        """Sums reduced with the update's, from this rank's caches (default: none)."""
        return None

    def metrics(self, sums: dict[str, float], num_tokens: int) -> dict[str, float]:
        """The reported metrics from the globally reduced sums (default: each metric sum per
        token)."""
        denom = max(num_tokens, 1)
        return {k: sums[k] / denom for k in self.metric_keys()}


def data_parallel_rows(
    num_rows: int, ctx: ParallelContext, size: int, shard: bool = False
) -> list[slice]:
    """The rows of this rank's micro-batches of ``size`` rows in a batch of ``num_rows`` rows:
    data-parallel rank r takes the r-th of ``dp_size`` equal consecutive shards (all of them when
    the batch is already this rank's ``shard``)."""
    if shard:
        return [slice(s, min(s + size, num_rows)) for s in range(0, num_rows, size)]
    if num_rows % ctx.dp_size:
        raise ValueError(
            f"a batch of {num_rows} rows does not split over {ctx.dp_size} data-parallel ranks"
        )
    per_rank = num_rows // ctx.dp_size
    first = ctx.dp_rank * per_rank
    last = first + per_rank
    return [slice(s, min(s + size, last)) for s in range(first, last, size)]


def data_parallel_micro_batches(
    batch: TrainBatch, ctx: ParallelContext, size: int, fixed_width: bool = False
) -> list[TrainBatch]:
    """This rank's shard of ``batch`` in micro-batches of ``size`` rows (all of ``batch`` when it
    already is this rank's shard: ``TrainBatch.is_shard``).

    Each micro-batch is trimmed to its longest row, or, with ``fixed_width``, keeps the batch's
    full width (pipeline stages exchange activations of one fixed shape).
    """
    return [
        batch.rows(r.start, r.stop, trim=not fixed_width)
        for r in data_parallel_rows(batch.num_rows, ctx, size, batch.is_shard)
    ]


def policy_outputs(
    model: torch.nn.Module,
    micro_batch: TrainBatch,
    vocab_size: int,
    ctx: ParallelContext,
    packing_capacity: int | None = None,
    with_entropy: bool = False,
    support: torch.Tensor | None = None,
) -> TokenOutputs:
    """The per-token outputs of ``micro_batch`` under ``model``, unpacked layout (one forward on
    this stage: the CPU tier's; megatron-core's schedule runs the CUDA tier's; a large
    vocabulary's output layer runs chunked, ``forward.forward_token_outputs``)."""
    inputs = model_inputs(micro_batch, ctx.device, packing_capacity)
    tp = ctx.tp_group
    return forward_token_outputs(
        model, micro_batch, inputs, vocab_size, tp, with_entropy, support=support
    )


def micro_batch_loss(
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    micro_batch: TrainBatch,
    config: StepConfig,
    cache: MicroBatchCache,
    support: torch.Tensor | None = None,
) -> LossOutput:
    """GRPO loss sums of a micro-batch from its (b, t) policy logprobs (and (b, t) entropies,
    (b, t, k) logprobs of the distillation teacher's top-k ids).

    ``cache`` keeps what the first use computes (pi_old, the mismatch sums) for the iterations
    that reuse the micro-batch; it must hold pi_ref when a loss term needs it.
    """
    dev = logprobs.device
    inputs = LossInputs(
        trainer_logprobs=logprobs,
        inference_logprobs=micro_batch.inference_logprobs.to(dev),
        advantages=micro_batch.advantages.to(dev),
        loss_mask=micro_batch.loss_mask.to(dev),
        entropy=entropy,
    )
    if config.needs_old_logprobs or config.needs_reference:
        inputs = _with_cached_inputs(inputs, config, cache)
    if config.distill is None:
        return grpo_loss(inputs, config.loss)
    targets = micro_batch.target_ids.to(dev)
    return distilled_loss(inputs, targets, support, config.distill, config.loss, cache)


def _with_cached_inputs(
    inputs: LossInputs, config: StepConfig, cache: MicroBatchCache
) -> LossInputs:
    """Fill pi_old, the IS weights (computing and caching them on first use) and pi_ref."""
    old = is_weights = None
    if config.needs_old_logprobs:
        if cache.old_logprobs is None:  # first iteration: pi_old is the current policy
            cache.old_logprobs = inputs.trainer_logprobs.detach()
        old = cache.old_logprobs
    if config.importance is not None:
        is_weights = importance_weights(
            old, inputs.inference_logprobs, inputs.loss_mask, config.importance
        )
        if cache.mismatch is None:
            cache.mismatch = mismatch_sums(
                old, inputs.inference_logprobs, inputs.loss_mask, config.importance
            )
    if cache.ref_logprobs is None and config.needs_reference:
        raise ValueError(
            "a loss term needs the reference policy's logprobs (Policy."
            "get_reference_policy_logprobs), but none were given"
        )
    return LossInputs(
        trainer_logprobs=inputs.trainer_logprobs,
        inference_logprobs=inputs.inference_logprobs,
        advantages=inputs.advantages,
        loss_mask=inputs.loss_mask,
        old_logprobs=old,
        is_weights=is_weights,
        ref_logprobs=cache.ref_logprobs,
        entropy=inputs.entropy,
    )


def step_result(
    update: Update,
    loss_fn: LossFunction,
    caches: list[MicroBatchCache],
    batch: TrainBatch,
    groups: list[dist.ProcessGroup],
    device: torch.device,
    start: float,
) -> StepResult:
    """The step's global results from the update's results on this rank.

    The sums are joined by the loss function's extra sums of this rank's ``caches`` (the IS
    mismatch sums of GRPO), then summed over ``groups`` in one all-reduce (on ``device``: NCCL
    reduces on the GPU), and turned into metrics by the loss function.
    """
    sums = update.sums
    extra = loss_fn.extra_sums(caches)
    if extra is not None:
        sums = NamedSums(sums.keys + extra.keys, torch.cat([sums.values, extra.values]))
    if groups:
        values = sums.values.to(device)
        for group in groups:
            dist.all_reduce(values, group=group)
        sums = NamedSums(sums.keys, values.cpu())
    reduced = sums.as_dict()
    num_tokens = loss_fn.num_tokens(batch)
    return StepResult(
        loss=reduced["loss"] / max(loss_fn.normalizer(batch), 1),
        grad_norm=update.grad_norm,
        lr=update.lr,
        loss_tokens=num_tokens,
        trained_tokens=batch.global_trained_tokens,
        seconds=time.perf_counter() - start,
        metrics=loss_fn.metrics(reduced, num_tokens),
    )
