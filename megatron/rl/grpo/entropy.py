"""Per-token entropy of the policy from (possibly vocab-parallel) logits, for the entropy bonus.

H = -sum_v p_v log p_v = log Z - sum_v p_v z_v with z the tempered logits and Z = sum_v exp(z_v).
Under tensor parallelism each rank holds a contiguous vocab partition; the partial sums of
exp(z - m) and exp(z - m) z are all-reduced (forward: sum; backward: identity, as in megatron-core's
vocab-parallel cross-entropy), so every rank gets the full-vocabulary entropy and the gradient of
its own logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _tempered(logits: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """``logits / temperature`` with temperature (B,) per row or (B, T) per token; 0 means 1."""
    z = logits.float()
    if temperature is None:
        return z
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    return z / (t[:, None, None] if t.dim() == 1 else t[..., None])


def token_entropy(
    logits: torch.Tensor,
    vocab_size: int,
    temperature: torch.Tensor | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Entropy (nats) of softmax(logits / temperature) over the real vocabulary at every position.

    Args:
        logits: (B, T, V/tp) logits, vocab-parallel under tensor parallelism.
        vocab_size: real vocabulary size; padded ids (>= vocab_size) have probability 0.
        temperature: (B,) or (B, T) sampling temperature (0 = greedy, treated as 1).
        tp_group: the group the vocabulary is split over (None or size 1: not split).

    Returns:
        (B, T) float32 entropies, differentiable w.r.t. ``logits``.
    """
    z = _tempered(logits, temperature)  # (B, T, V/tp)
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    part = z.shape[-1]
    first = (dist.get_rank(tp_group) if tp_size > 1 else 0) * part
    invalid = torch.arange(first, first + part, device=z.device) >= vocab_size  # (V/tp,)
    z = z.masked_fill(invalid, 0.0)  # finite everywhere, so p * z has clean gradients
    with torch.no_grad():
        shift = z.masked_fill(invalid, float("-inf")).amax(dim=-1, keepdim=True)  # (B, T, 1)
        if tp_size > 1:
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=tp_group)
    e = torch.exp((z - shift).masked_fill(invalid, float("-inf")))  # (B, T, V/tp)
    total = e.sum(dim=-1)  # (B, T): Z * exp(-shift)
    weighted = (e * z).sum(dim=-1)  # (B, T): sum_v exp(z_v - shift) z_v
    if tp_size > 1:
        from megatron.core.tensor_parallel.mappings import (
            reduce_from_tensor_model_parallel_region,
        )

        total = reduce_from_tensor_model_parallel_region(total, group=tp_group)
        weighted = reduce_from_tensor_model_parallel_region(weighted, group=tp_group)
    return torch.log(total) + shift.squeeze(-1) - weighted / total
