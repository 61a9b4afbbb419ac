"""Sequence-level logprob error of a collection (``--rl-seq-logprob-error-threshold``,
``--rl-log-seq-logprob-error``): the math is ``megatron/rl/grpo/seq_logprob_error.py``.

The trainer's logprobs are the policy's at the first forward of the collection, before its first
update: pi_old, from ``Policy.get_logprobs`` of the rows each rank holds (the whole global batch,
or its shard with the keyed data plane: then the per-row sums are added over data parallelism),
so every rank masks the same rows. ``prepare`` already computed pi_old of every global batch when
a later one needs it; otherwise it is computed here, forward only, and the step's own pi_old (its
first forward, the same weights and micro-batches) is left as it was.
"""

from __future__ import annotations

import torch

from megatron.rl.grpo.seq_logprob_error import (
    SeqLogprobErrorConfig,
    seq_logprob_errors,
    sequence_error_sums,
)
from megatron.trainer.train.collection import CollectionSlices
from megatron.trainer.train.policy import Policy


def row_error_sums(
    collection: CollectionSlices, policy: Policy
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) sums of exp(|pi_old - pi_inference|) and (N,) generated-token counts of the
    collection's N rows (collective: a forward of each global batch without a pi_old yet). A row
    trained in several global batches (when they wrap around) is counted in each: its error, the
    ratio, is unchanged."""
    sums = torch.zeros(2, collection.num_rows, dtype=torch.float64)
    for j in range(collection.num_slices):
        batch = collection.global_batch(j)  # (b, T): the global batch or this rank's shard
        old = collection.old_logprobs(j)
        if old is None:
            old = policy.get_logprobs(batch)
        old = old.detach().cpu()  # (b, T)
        width = old.shape[1]
        error, count = sequence_error_sums(
            old, batch.inference_logprobs[:, :width], batch.loss_mask[:, :width]
        )
        rows = collection.local_rows(j)  # (b,) the collection's rows
        sums[0].index_add_(0, rows, error)
        sums[1].index_add_(0, rows, count)
    sums = collection.add_over_ranks(sums)
    return sums[0], sums[1]


def apply_seq_logprob_error(
    collection: CollectionSlices,
    rewards: torch.Tensor,
    policy: Policy,
    error_config: SeqLogprobErrorConfig,
) -> dict[str, float]:
    """Measure the collection's sequence-level logprob error, mask the rows above the threshold
    out of its loss, and return the metrics (collective). ``rewards``: (N,) of the rows (only
    whether each is > 0 matters)."""
    error_sums, counts = row_error_sums(collection, policy)
    result = seq_logprob_errors(error_sums, counts, rewards, error_config)
    if not bool(result.keep.all()):
        collection.mask_rows(result.keep)
    return result.metrics
