"""The GRPO train step both tiers share: micro-batches, the loss of a micro-batch, the results.

A step is one training iteration: one optimizer update on this rank's data-parallel shard of a
global batch (``collection.py`` cuts each collection into global batches). With the default
``StepConfig`` it is the plain clipped surrogate against the engine's logprobs. The options (see
``megatron/rl/grpo/loss.py``):

* ``old_logprobs`` (``--grpo-iterations`` > 1 or the IS correction): the ratio's denominator is
  pi_old, the policy that collected the batch, *before its collection's first update*. Each
  micro-batch's ``MicroBatchCache`` holds it across the iterations that reuse the batch: filled
  by the first forward when no update came before it (its ratio is then exactly 1), or computed
  up front (``Tier.fill_old_logprobs``) when a collection has several global batches.
* ``importance`` (``--rl-inference-logprobs-is-correction``): the ratio is against pi_old, and
  each token is weighted by min(pi_old / pi_inference, C); the mismatch metrics are measured the
  first time a micro-batch is trained.
* loss terms (``loss.terms``): a term that requires reference logprobs gets them from the
  reference model, computed once per micro-batch (no gradient) and cached for every iteration;
  one that requires the entropy gets it from the same forward as the logprobs.
* ``packing_capacity`` (``--rl-use-sequence-packing``): each micro-batch runs packed
  (``megatron/rl/grpo/packing.py``); per-token outputs are unpacked before the loss.

Metrics travel by name (``LossOutput.metric_sums``): each update adds its micro-batches' sums as
one float64 vector in sorted key order (``NamedSums``), the IS mismatch sums of its micro-batches
are appended, and the vector is all-reduced over data parallelism (and the
pipeline on CUDA) before each sum is divided by the global number of loss tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.rl.grpo.batch import TrainBatch
from megatron.rl.grpo.entropy import token_entropy
from megatron.rl.grpo.importance import (
    MISMATCH_SUMS,
    ImportanceConfig,
    importance_weights,
    mismatch_metrics,
    mismatch_sums,
)
from megatron.rl.grpo.logprobs import token_logprobs
from megatron.rl.grpo.loss import GRPOLossConfig, LossInputs, LossOutput, grpo_loss
from megatron.rl.grpo.packing import pack_sequences
from megatron.trainer.initialize import ParallelContext

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

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether the ratio is taken against the trainer's pre-update policy."""
        return self.old_logprobs or self.importance is not None

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
        return tuple(sorted((*BASE_METRICS, *(t.name for t in self.loss.terms))))


@dataclass
class MicroBatchCache:
    """Per-micro-batch tensors computed once per collection and reused by its iterations."""

    old_logprobs: torch.Tensor | None = None
    """(b, t) log pi_old, detached."""
    ref_logprobs: torch.Tensor | None = None
    """(b, t) log pi_ref."""
    mismatch: dict[str, torch.Tensor] | None = None
    """Train/inference mismatch sums (``importance.mismatch_sums``)."""


@dataclass(frozen=True)
class NamedSums:
    """Float64 sums by name, stored as one vector in a fixed key order (for one reduction)."""

    keys: tuple[str, ...]
    values: torch.Tensor
    """(K,) float64 on the CPU."""

    @classmethod
    def zeros(cls, keys: tuple[str, ...]) -> NamedSums:
        """All-zero sums of ``keys``."""
        return cls(keys, torch.zeros(len(keys), dtype=torch.float64))

    @classmethod
    def of(cls, sums: dict[str, torch.Tensor], keys: tuple[str, ...]) -> NamedSums:
        """The scalar tensors of ``sums`` in the order of ``keys`` (which must match exactly)."""
        if set(sums) != set(keys):
            raise ValueError(f"metric sums {sorted(sums)} do not match the expected {list(keys)}")
        return cls(keys, torch.stack([sums[k].detach().double().cpu() for k in keys]))

    def __add__(self, other: NamedSums) -> NamedSums:
        if other.keys != self.keys:
            raise ValueError(f"cannot add sums of {other.keys} to sums of {self.keys}")
        return NamedSums(self.keys, self.values + other.values)

    def as_dict(self) -> dict[str, float]:
        """Name -> value."""
        return dict(zip(self.keys, self.values.tolist()))


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
    """Per-loss-token means of the other metrics by name: ``clip_fraction``, ``ratio_mean``,
    ``mismatch_kl``, each loss term's metric, and the ``is_*`` metrics of the IS correction."""


def data_parallel_micro_batches(
    batch: TrainBatch, ctx: ParallelContext, size: int, fixed_width: bool = False
) -> list[TrainBatch]:
    """This rank's shard of ``batch`` in micro-batches of ``size`` rows (all of ``batch`` when it
    already is this rank's shard: ``TrainBatch.is_shard``).

    Each micro-batch is trimmed to its longest row, or, with ``fixed_width``, keeps the batch's
    full width (pipeline stages exchange activations of one fixed shape).
    """
    per_rank = batch.num_rows if batch.is_shard else batch.num_rows // ctx.dp_size
    first = 0 if batch.is_shard else ctx.dp_rank * per_rank
    return [
        batch.rows(s, s + size, trim=not fixed_width) for s in range(first, first + per_rank, size)
    ]


def token_outputs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(b, t) logprobs of ``targets`` and (b, t) entropies (or None) from (b, t, V/tp) logits."""
    logprobs = token_logprobs(logits, targets, vocab_size, temperature, tp_group)
    entropy = token_entropy(logits, vocab_size, temperature, tp_group) if with_entropy else None
    return logprobs, entropy


def policy_logprobs(
    model: torch.nn.Module,
    micro_batch: TrainBatch,
    vocab_size: int,
    ctx: ParallelContext,
    packing_capacity: int | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(b, t) logprobs of the targets (and (b, t) entropies) under ``model``, unpacked layout."""
    dev = ctx.device
    if packing_capacity is None:
        ids = micro_batch.input_ids.to(dev)  # (b, t)
        positions = torch.arange(ids.shape[1], device=dev)[None, :].expand_as(ids)  # (b, t)
        logits = model(ids, positions, None)  # (b, t, V/tp)
        targets, temperature = micro_batch.target_ids.to(dev), micro_batch.temperature.to(dev)
        return token_outputs(logits, targets, temperature, vocab_size, ctx.tp_group, with_entropy)
    layout = pack_sequences(micro_batch.lengths, packing_capacity)
    per_token_t = micro_batch.temperature[:, None].expand_as(micro_batch.input_ids)  # (b, t)
    ids = layout.pack(micro_batch.input_ids).to(dev)  # (r, s)
    mask = layout.attention_mask().to(dev)  # (r, 1, s, s)
    logits = model(ids, layout.position_ids.to(dev), mask)  # (r, s, V/tp)
    targets = layout.pack(micro_batch.target_ids).to(dev)  # (r, s)
    temperature = layout.pack(per_token_t, fill=1.0).to(dev)  # (r, s)
    logprobs, entropy = token_outputs(
        logits, targets, temperature, vocab_size, ctx.tp_group, with_entropy
    )
    width = micro_batch.input_ids.shape[1]
    logprobs = layout.unpack(logprobs, width)  # (b, t)
    entropy = None if entropy is None else layout.unpack(entropy, width)
    return logprobs, entropy


def micro_batch_loss(
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    micro_batch: TrainBatch,
    config: StepConfig,
    ctx: ParallelContext,
    cache: MicroBatchCache,
    reference: torch.nn.Module | None = None,
) -> LossOutput:
    """GRPO loss sums of a micro-batch from its (b, t) policy logprobs (and (b, t) entropies).

    ``cache`` keeps what the first use computes (pi_old, pi_ref, the mismatch sums) for the
    iterations that reuse the micro-batch; ``reference`` is the frozen reference policy when a loss term needs it.
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
        inputs = _with_cached_inputs(inputs, micro_batch, config, ctx, cache, reference)
    return grpo_loss(inputs, config.loss)


def _with_cached_inputs(
    inputs: LossInputs,
    micro_batch: TrainBatch,
    config: StepConfig,
    ctx: ParallelContext,
    cache: MicroBatchCache,
    reference: torch.nn.Module | None,
) -> LossInputs:
    """Fill pi_old, the IS weights and pi_ref (computing and caching them on first use)."""
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
        if reference is None:
            raise ValueError("a loss term needs the reference policy, but none was given")
        with torch.no_grad():
            cache.ref_logprobs, _ = policy_logprobs(
                reference, micro_batch, config.vocab_size, ctx, config.packing_capacity
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
    caches: list[MicroBatchCache],
    batch: TrainBatch,
    config: StepConfig,
    groups: list[dist.ProcessGroup],
    device: torch.device,
    start: float,
) -> StepResult:
    """The step's global results from the update's results on this rank.

    The sums are joined by the IS mismatch sums of the micro-batches this rank computed a loss
    for, then summed over ``groups`` in one all-reduce (on ``device``: NCCL reduces on the GPU).
    """
    sums = update.sums
    if config.importance is not None:
        keys = tuple(sorted(MISMATCH_SUMS))
        mismatch = [NamedSums.of(c.mismatch, keys).values for c in caches if c.mismatch is not None]
        total = torch.stack(mismatch).sum(0) if mismatch else NamedSums.zeros(keys).values
        sums = NamedSums(sums.keys + keys, torch.cat([sums.values, total]))
    if groups:
        values = sums.values.to(device)
        for group in groups:
            dist.all_reduce(values, group=group)
        sums = NamedSums(sums.keys, values.cpu())
    reduced = sums.as_dict()
    denom = max(batch.global_loss_tokens, 1)
    metrics = {k: reduced[k] / denom for k in update.sums.keys if k != "loss"}
    if config.importance is not None:
        metrics.update(mismatch_metrics(reduced))
    return StepResult(
        loss=reduced["loss"] / denom,
        grad_norm=update.grad_norm,
        lr=update.lr,
        loss_tokens=batch.global_loss_tokens,
        trained_tokens=batch.global_trained_tokens,
        seconds=time.perf_counter() - start,
        metrics=metrics,
    )
