"""One GRPO step: micro-batches -> DP gradient all-reduce -> clip -> AdamW -> LR step.

With the default ``StepOptions`` a step is one optimizer update with the plain clipped surrogate
against the engine's logprobs. The options add (see ``megatron/rl/grpo/loss.py``):

* ``iterations`` > 1 (``--grpo-iterations``): the batch is reused for that many optimizer updates.
  The ratio's denominator is pi_old, the policy *before the step's first update*: its logprobs are
  the detached logprobs of each micro-batch's forward in the first iteration (so the first
  iteration's ratio is exactly 1), cached for the later ones. The LR scheduler advances once per
  step, so every update of a step uses the same learning rate, and the policy version (forced-lag
  accounting) counts steps, not updates.
* ``importance`` (``--rl-inference-logprobs-is-correction``): the ratio is against pi_old too, and
  each token is weighted by min(pi_old / pi_inference, C); the mismatch metrics are measured on the
  first iteration.
* ``reference_model`` with ``kl_beta`` > 0 (``--grpo-kl-beta``): reference logprobs of each
  micro-batch are computed once (no gradient) and cached for every iteration.
* ``packing_capacity`` (``--rl-use-sequence-packing``): each micro-batch runs packed
  (``megatron/rl/grpo/packing.py``); per-token outputs are unpacked before the loss.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.rl.grpo.batch import TrainBatch
from megatron.rl.grpo.entropy import token_entropy
from megatron.rl.grpo.importance import (
    MISMATCH_FIELDS,
    ImportanceConfig,
    importance_weights,
    mismatch_sums,
)
from megatron.rl.grpo.logprobs import token_logprobs
from megatron.rl.grpo.loss import GRPOLossConfig, LossInputs, LossOutput, grpo_loss
from megatron.rl.grpo.packing import pack_sequences
from megatron.training.initialize import ParallelContext
from megatron.training.optimizer import allreduce_gradients, clip_grad_norm


@dataclass(frozen=True)
class StepOptions:
    """Optional parts of a GRPO step; the defaults give the plain clipped surrogate."""

    iterations: int = 1
    """Optimizer updates per batch (``--grpo-iterations``)."""
    reference_model: torch.nn.Module | None = None
    """Frozen reference policy; needed when the loss config's ``kl_beta`` > 0."""
    importance: ImportanceConfig | None = None
    """Truncated IS correction with the engine's logprobs (None: off)."""
    packing_capacity: int | None = None
    """Tokens per packed row (None: no sequence packing)."""

    def __post_init__(self) -> None:
        if self.iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {self.iterations}")

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether the ratio is taken against the trainer's pre-update policy."""
        return self.iterations > 1 or self.importance is not None


@dataclass
class MicroBatchTerms:
    """Per-micro-batch tensors computed in a step's first iteration and reused after it."""

    old_logprobs: torch.Tensor | None = None
    """(b, t) log pi_old, detached."""
    ref_logprobs: torch.Tensor | None = None
    """(b, t) log pi_ref."""
    mismatch: torch.Tensor | None = None
    """Train/inference mismatch sums (``importance.MISMATCH_FIELDS``)."""


@dataclass(frozen=True)
class StepResult:
    """Global (all-reduced) results of one step (means over its updates)."""

    loss: float
    grad_norm: float
    lr: float
    clip_fraction: float
    ratio_mean: float
    mismatch_kl: float
    loss_tokens: int
    trained_tokens: int
    seconds: float
    extra: dict[str, float] = field(default_factory=dict)
    """Metrics of the optional terms (``ref_kl``, ``entropy``, ``is_*``); empty by default."""


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
    else:
        layout = pack_sequences(micro_batch.lengths, packing_capacity)
        per_token_t = micro_batch.temperature[:, None].expand_as(micro_batch.input_ids)  # (b, t)
        ids = layout.pack(micro_batch.input_ids).to(dev)  # (r, s)
        mask = layout.attention_mask().to(dev)  # (r, 1, s, s)
        logits = model(ids, layout.position_ids.to(dev), mask)  # (r, s, V/tp)
        targets = layout.pack(micro_batch.target_ids).to(dev)  # (r, s)
        temperature = layout.pack(per_token_t, fill=1.0).to(dev)  # (r, s)
    logprobs = token_logprobs(logits, targets, vocab_size, temperature, ctx.tp_group)
    entropy = None
    if with_entropy:
        entropy = token_entropy(logits, vocab_size, temperature, ctx.tp_group)
    if packing_capacity is not None:
        width = micro_batch.input_ids.shape[1]
        logprobs = layout.unpack(logprobs, width)  # (b, t)
        entropy = None if entropy is None else layout.unpack(entropy, width)
    return logprobs, entropy


def forward_backward_step(
    model: torch.nn.Module,
    micro_batch: TrainBatch,
    loss_config: GRPOLossConfig,
    num_global_tokens: int,
    vocab_size: int,
    ctx: ParallelContext,
    options: StepOptions = StepOptions(),
    terms: MicroBatchTerms | None = None,
) -> LossOutput:
    """Forward one micro-batch, backward its share of the token-mean loss; returns its sums.

    ``terms`` caches what the first iteration computes for the later ones (needed with any
    optional term of ``options``/``loss_config``).
    """
    logprobs, entropy = policy_logprobs(
        model,
        micro_batch,
        vocab_size,
        ctx,
        options.packing_capacity,
        with_entropy=loss_config.entropy_weight != 0.0,
    )  # (b, t)
    out = micro_batch_loss(
        logprobs, entropy, micro_batch, loss_config, vocab_size, ctx, options, terms
    )
    (out.loss_sum / max(num_global_tokens, 1)).backward()
    return out


def micro_batch_loss(
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    micro_batch: TrainBatch,
    loss_config: GRPOLossConfig,
    vocab_size: int,
    ctx: ParallelContext,
    options: StepOptions = StepOptions(),
    terms: MicroBatchTerms | None = None,
) -> LossOutput:
    """GRPO loss sums of a micro-batch from its (b, t) policy logprobs (and (b, t) entropies).

    Shared by both tiers' train steps. ``terms`` caches what the first iteration computes for the
    later ones (needed with any optional term of ``options``/``loss_config``).
    """
    dev = logprobs.device
    inputs = LossInputs(
        trainer_logprobs=logprobs,
        inference_logprobs=micro_batch.inference_logprobs.to(dev),
        advantages=micro_batch.advantages.to(dev),
        loss_mask=micro_batch.loss_mask.to(dev),
        entropy=entropy,
    )
    if options.needs_old_logprobs or loss_config.kl_beta != 0.0:
        if terms is None:
            raise ValueError("the optional GRPO terms need a MicroBatchTerms cache")
        inputs = _with_cached_terms(inputs, micro_batch, vocab_size, ctx, options, terms)
    return grpo_loss(inputs, loss_config)


def metric_sums(out: LossOutput, extras: bool) -> torch.Tensor:
    """(4,) float64 loss, clipped-token, ratio and mismatch-KL sums; (6,) with ``extras`` (also
    reference KL and entropy sums), on the CPU."""
    parts = [out.loss_sum, out.clipped_tokens, out.ratio_sum, out.mismatch_kl_sum]
    if extras:
        parts += [out.ref_kl_sum, out.entropy_sum]
    return torch.stack([p.detach().double().cpu() for p in parts])


def _with_cached_terms(
    inputs: LossInputs,
    micro_batch: TrainBatch,
    vocab_size: int,
    ctx: ParallelContext,
    options: StepOptions,
    terms: MicroBatchTerms,
) -> LossInputs:
    """Fill pi_old, the IS weights and pi_ref (computing and caching them on first use)."""
    old = is_weights = None
    if options.needs_old_logprobs:
        if terms.old_logprobs is None:  # first iteration: pi_old is the current policy
            terms.old_logprobs = inputs.trainer_logprobs.detach()
        old = terms.old_logprobs
    if options.importance is not None:
        is_weights = importance_weights(
            old, inputs.inference_logprobs, inputs.loss_mask, options.importance
        )
        if terms.mismatch is None:
            terms.mismatch = mismatch_sums(
                old, inputs.inference_logprobs, inputs.loss_mask, options.importance
            )
    if terms.ref_logprobs is None and options.reference_model is not None:
        with torch.no_grad():
            terms.ref_logprobs, _ = policy_logprobs(
                options.reference_model, micro_batch, vocab_size, ctx, options.packing_capacity
            )
    return LossInputs(
        trainer_logprobs=inputs.trainer_logprobs,
        inference_logprobs=inputs.inference_logprobs,
        advantages=inputs.advantages,
        loss_mask=inputs.loss_mask,
        old_logprobs=old,
        is_weights=is_weights,
        ref_logprobs=terms.ref_logprobs,
        entropy=inputs.entropy,
    )


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: OptimizerParamScheduler,
    batch: TrainBatch,
    micro_batch_size: int,
    clip_grad: float,
    loss_config: GRPOLossConfig,
    vocab_size: int,
    ctx: ParallelContext,
    options: StepOptions = StepOptions(),
) -> StepResult:
    """Train on this rank's data-parallel shard of ``batch`` (the whole global batch)."""
    start = time.perf_counter()
    if loss_config.kl_beta != 0.0 and options.reference_model is None:
        raise ValueError("kl_beta > 0 needs options.reference_model")
    per_rank = batch.num_rows // ctx.dp_size
    first = ctx.dp_rank * per_rank
    micros = [
        batch.rows(s, s + micro_batch_size)
        for s in range(first, first + per_rank, micro_batch_size)
    ]
    terms = [MicroBatchTerms() for _ in micros]
    num_tokens = batch.num_loss_tokens  # global: every rank holds the whole batch
    extras = has_extras(loss_config, options)
    updates = []
    for iteration in range(options.iterations):
        sums, grad_norm, lr = _update(
            model, optimizer, scheduler, micros, terms, clip_grad, loss_config, vocab_size,
            num_tokens, ctx, options, advance_schedule=iteration == 0, extras=extras,
        )  # fmt: skip
        updates.append((sums, grad_norm, lr))
    groups = [ctx.dp_group] if ctx.dp_size > 1 else []
    return step_result(updates, terms, batch, loss_config, options, groups, ctx.device, start)


def step_result(
    updates: list[tuple[torch.Tensor, float, float]],
    terms: list[MicroBatchTerms],
    batch: TrainBatch,
    loss_config: GRPOLossConfig,
    options: StepOptions,
    groups: list[dist.ProcessGroup],
    device: torch.device,
    start: float,
) -> StepResult:
    """The step's global results from each update's (sums, grad norm, LR) on this rank.

    Sums are averaged over the updates, joined by the IS mismatch sums of the micro-batches this
    rank computed a loss for, then summed over ``groups`` (on ``device``: NCCL reduces on the GPU).
    """
    sums = torch.stack([u[0] for u in updates]).mean(0) if len(updates) > 1 else updates[0][0]
    with_mismatch = options.importance is not None
    if with_mismatch:
        mismatch = [t.mismatch for t in terms if t.mismatch is not None]
        zeros = torch.zeros(len(MISMATCH_FIELDS), dtype=torch.float64)
        sums = torch.cat([sums, torch.stack(mismatch).sum(0) if mismatch else zeros])
    if groups:
        sums = sums.to(device)
        for group in groups:
            dist.all_reduce(sums, group=group)
        sums = sums.cpu()
    num_tokens = batch.num_loss_tokens
    denom = max(num_tokens, 1)
    extras = has_extras(loss_config, options)
    return StepResult(
        loss=float(sums[0]) / denom,
        grad_norm=sum(u[1] for u in updates) / len(updates),
        lr=updates[0][2],
        clip_fraction=float(sums[1]) / denom,
        ratio_mean=float(sums[2]) / denom,
        mismatch_kl=float(sums[3]) / denom,
        loss_tokens=num_tokens,
        trained_tokens=int(batch.lengths.sum()) * options.iterations,
        seconds=time.perf_counter() - start,
        extra=_extra_metrics(sums, denom, loss_config, with_mismatch) if extras else {},
    )


def has_extras(loss_config: GRPOLossConfig, options: StepOptions) -> bool:
    """Whether the step reports more than the default metrics."""
    return (
        loss_config.kl_beta != 0.0
        or loss_config.entropy_weight != 0.0
        or options.importance is not None
        or options.iterations > 1
    )


def _update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: OptimizerParamScheduler,
    micros: list[TrainBatch],
    terms: list[MicroBatchTerms],
    clip_grad: float,
    loss_config: GRPOLossConfig,
    vocab_size: int,
    num_tokens: int,
    ctx: ParallelContext,
    options: StepOptions,
    advance_schedule: bool,
    extras: bool,
) -> tuple[torch.Tensor, float, float]:
    """One optimizer update over the micro-batches: this rank's sums, the grad norm, the LR."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    sums = torch.zeros(6 if extras else 4, dtype=torch.float64)  # loss, clipped, ratio, kl, ...
    for micro, micro_terms in zip(micros, terms):
        out = forward_backward_step(
            model, micro, loss_config, num_tokens, vocab_size, ctx, options, micro_terms
        )
        sums += metric_sums(out, extras)
    params = [p for p in model.parameters() if p.requires_grad]
    allreduce_gradients(params, ctx.dp_group)
    grad_norm = clip_grad_norm(params, clip_grad, ctx.tp_group)
    if advance_schedule:  # update k uses the schedule's value at k + 1 (no zero-LR step)
        scheduler.step(increment=1)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    return sums, grad_norm, lr


def _extra_metrics(
    sums: torch.Tensor, denom: int, loss_config: GRPOLossConfig, with_mismatch: bool
) -> dict[str, float]:
    """``ref_kl``, ``entropy`` and the train/inference mismatch metrics from the reduced sums."""
    metrics: dict[str, float] = {}
    if loss_config.kl_beta != 0.0:
        metrics["ref_kl"] = float(sums[4]) / denom
    if loss_config.entropy_weight != 0.0:
        metrics["entropy"] = float(sums[5]) / denom
    if with_mismatch:
        m = dict(zip(MISMATCH_FIELDS, sums[6:].tolist()))
        tokens, sequences = max(m["tokens"], 1.0), max(m["sequences"], 1.0)
        metrics.update(
            is_abs_delta_p=m["abs_delta_p"] / tokens,
            is_kl=m["kl"] / tokens,
            is_weight_mean=m["weight"] / tokens,
            is_truncated_fraction=m["truncated_tokens"] / tokens,
            is_truncated_sequence_fraction=m["truncated_sequences"] / sequences,
        )
    return metrics
