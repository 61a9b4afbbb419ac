"""Top-k of (possibly vocab-parallel) logits over the real vocabulary.

Under tensor parallelism each rank holds a contiguous vocab shard (megatron-core's
``parallel_output=True`` layout). Each rank takes the top-k of its shard, with padded embedding
rows (ids >= ``vocab_size``) excluded, and adds its shard's first id to the indices; the candidates
of every rank are gathered and the global top-k is taken over them. Every rank returns the same
result, equal to the top-k of the unsharded logits (up to the order of equal values).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def vocab_parallel_topk(
    logits: torch.Tensor,
    k: int,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits of every position and their global token ids.

    Args:
        logits: (..., V/tp) logits; under tensor parallelism this rank's contiguous vocab shard.
        k: how many (1 <= k <= vocab_size).
        vocab_size: real vocabulary size; ids >= vocab_size (embedding padding) are never chosen.
        tp_group: the group the vocabulary is split over (None or size 1: not split).

    Returns:
        (..., k) float32 values in descending order and (..., k) int64 global token ids.
    """
    if not 1 <= k <= vocab_size:
        raise ValueError(f"k must be in [1, vocab_size ({vocab_size})], got {k}")
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    part = logits.shape[-1]
    first = (dist.get_rank(tp_group) if tp_size > 1 else 0) * part
    ids = torch.arange(first, first + part, device=logits.device)  # (V/tp,)
    masked = logits.float().masked_fill(ids >= vocab_size, float("-inf"))
    values, local = masked.topk(min(k, part), dim=-1)  # (..., k') this shard's candidates
    indices = local + first
    if tp_size == 1:
        return values, indices
    all_values = [torch.empty_like(values) for _ in range(tp_size)]
    all_indices = [torch.empty_like(indices) for _ in range(tp_size)]
    dist.all_gather(all_values, values.contiguous(), group=tp_group)
    dist.all_gather(all_indices, indices.contiguous(), group=tp_group)
    values, where = torch.cat(all_values, dim=-1).topk(k, dim=-1)  # (..., k)
    return values, torch.cat(all_indices, dim=-1).gather(-1, where)
