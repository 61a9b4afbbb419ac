"""Sequence-level logprob error of a collection (``--rl-seq-logprob-error-threshold``,
``--rl-log-seq-logprob-error``): the math is ``megatron/rl/grpo/seq_logprob_error.py``.

The trainer's logprobs are the policy's at the first forward of the collection, before its first
update: pi_old. ``Collection.prepare`` computes it ahead of the update only when a later global
batch needs it; here every global batch's pi_old is computed (forward only) unless it already was,
so the step then takes pi_old from the caches (its ratio is unchanged: pi_old, when the step uses
one, is this same forward). Each rank holds pi_old of its own micro-batches (on CUDA with PP > 1,
the last stage); the per-row sums are added over the world, one contribution per row from tensor
rank 0 of the rank that computed it, so every rank then masks the same rows.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron.rl.grpo.seq_logprob_error import (
    SeqLogprobErrorConfig,
    seq_logprob_errors,
    sequence_error_sums,
)
from megatron.rl.wire import RolloutGroup
from megatron.trainer.checkpointing import TrainState
from megatron.trainer.collection import Collection
from megatron.trainer.initialize import ParallelContext
from megatron.trainer.step import StepConfig
from megatron.trainer.tiers.base import Tier


def micro_batch_rows(
    global_batch_size: int, ctx: ParallelContext, micro_batch_size: int
) -> list[torch.Tensor]:
    """The global-batch rows of each of this rank's micro-batches, in the order of
    ``step.data_parallel_micro_batches`` (this rank's contiguous shard, cut every
    ``micro_batch_size`` rows)."""
    per_rank = global_batch_size // ctx.dp_size
    first = ctx.dp_rank * per_rank
    return [
        torch.arange(s, min(s + micro_batch_size, first + per_rank))
        for s in range(first, first + per_rank, micro_batch_size)
    ]


def fill_first_forward(
    collection: Collection,
    tier: Tier,
    state: TrainState,
    config: StepConfig,
    micro_batches: int,
) -> None:
    """pi_old of every global batch of the collection, before its first update (collective).

    ``Collection.prepare`` already filled it when the step needs pi_old and the collection has
    several global batches; otherwise it is computed here (every rank decides alike)."""
    if config.needs_old_logprobs and collection.num_slices > 1:
        return
    for j in range(collection.num_slices):
        caches = collection.caches(j, micro_batches)
        tier.fill_old_logprobs(state, collection.global_batch(j), config, caches)


def row_error_sums(
    collection: Collection, ctx: ParallelContext, config: StepConfig, micro_batches: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) sums of exp(|pi_old - pi_inference|) and (N,) generated-token counts of the
    collection's N rows, added over every rank (collective). A row trained in several global
    batches (when they wrap around) is counted in each: its error, the ratio, is unchanged."""
    n = collection.batch.num_rows
    sums = torch.zeros(2, n, dtype=torch.float64)
    for j in range(collection.num_slices):
        batch = collection.global_batch(j)
        caches = collection.caches(j, micro_batches)
        size = collection.global_batch_size
        for cache, local in zip(caches, micro_batch_rows(size, ctx, config.micro_batch_size)):
            if cache.old_logprobs is None or ctx.tp_rank != 0:
                continue  # an earlier pipeline stage, or a tensor-parallel copy
            old = cache.old_logprobs.detach().cpu()  # (b, w)
            width = old.shape[1]
            error, count = sequence_error_sums(
                old, batch.inference_logprobs[local, :width], batch.loss_mask[local, :width]
            )
            rows = (j * size + local) % n  # the collection's rows (``Collection.global_batch``)
            sums[0].index_add_(0, rows, error)
            sums[1].index_add_(0, rows, count)
    if ctx.world_size > 1:
        reduced = sums.to(ctx.device)
        dist.all_reduce(reduced)
        sums = reduced.cpu()
    return sums[0], sums[1]


def apply_seq_logprob_error(
    collection: Collection,
    groups: list[RolloutGroup],
    tier: Tier,
    state: TrainState,
    config: StepConfig,
    micro_batches: int,
    ctx: ParallelContext,
    error_config: SeqLogprobErrorConfig,
) -> dict[str, float]:
    """Measure the collection's sequence-level logprob error, mask the rows above the threshold
    out of its loss (``collection.batch``), and return the metrics (collective)."""
    fill_first_forward(collection, tier, state, config, micro_batches)
    error_sums, counts = row_error_sums(collection, ctx, config, micro_batches)
    rewards = torch.tensor([r.reward for g in groups for r in g.rollouts], dtype=torch.float64)
    result = seq_logprob_errors(error_sums, counts, rewards, error_config)
    if not bool(result.keep.all()):
        batch = collection.batch
        masked = batch.loss_mask * result.keep[:, None].to(batch.loss_mask.dtype)
        collection.batch = dataclasses.replace(batch, loss_mask=masked)
    return result.metrics
