"""Per-token log-probabilities from (possibly vocab-parallel) logits."""

from __future__ import annotations

import torch
import torch.distributed as dist


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    temperature: torch.Tensor | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature), restricted to the real vocabulary.

    Args:
        logits: (B, T, V/tp) logits; under tensor parallelism each rank holds its contiguous
            vocab partition (megatron-core's ``parallel_output=True`` layout).
        targets: (B, T) token ids.
        vocab_size: real vocabulary size; ids >= vocab_size (embedding padding) get probability
            0, exactly as in the inference engine's sampler.
        temperature: (B,) per-sequence or (B, T) per-token (packed rows) sampling temperature
            (0 = greedy, treated as 1).
        tp_group: tensor-parallel group the vocab is split over (None or size 1: not split).

    Returns:
        (B, T) float32 log-probabilities, differentiable w.r.t. ``logits``.
    """
    logits, _, tp_size = _real_vocab_logits(logits, vocab_size, temperature, tp_group)
    if tp_size == 1:
        return torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return -vocab_parallel_cross_entropy(logits, targets)


def support_logprobs(
    logits: torch.Tensor,
    support: torch.Tensor,
    vocab_size: int,
    temperature: torch.Tensor | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """log p(i) of every id i of ``support`` under softmax(logits / temperature) (the real
    vocabulary's): ``token_logprobs`` at k ids per position.

    Args:
        logits: (B, T, V/tp) logits, vocab-parallel as in ``token_logprobs``.
        support: (B, T, k) int64 global token ids (< ``vocab_size``).
        vocab_size: real vocabulary size.
        temperature: (B,) or (B, T) sampling temperature (0: treated as 1), as ``token_logprobs``.
        tp_group: tensor-parallel group the vocab is split over (None or size 1: not split).

    Returns:
        (B, T, k) float32 log-probabilities, differentiable w.r.t. ``logits`` (under TP the
        gradient reaches the rank that holds each id's column).
    """
    logits, first, tp_size = _real_vocab_logits(logits, vocab_size, temperature, tp_group)
    if tp_size == 1:
        return torch.log_softmax(logits, dim=-1).gather(-1, support)
    part = logits.shape[-1]
    top = logits.detach().max(dim=-1, keepdim=True).values  # (B, T, 1)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp_group)
    total = _sum_over(torch.exp(logits - top).sum(-1, keepdim=True), tp_group)  # (B, T, 1)
    local = support - first
    held = (local >= 0) & (local < part)  # (B, T, k)
    picked = logits.gather(-1, local.clamp(0, part - 1))
    picked = _sum_over(torch.where(held, picked, torch.zeros_like(picked)), tp_group)
    return picked - top - torch.log(total)


def _real_vocab_logits(
    logits: torch.Tensor,
    vocab_size: int,
    temperature: torch.Tensor | None,
    tp_group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, int, int]:
    """(float32 logits / temperature with the padded ids at -inf, this shard's first id, the
    tensor-parallel size) of (B, T, V/tp) logits."""
    logits = logits.float()
    if temperature is not None:
        t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
        logits = logits / (t[:, None, None] if t.dim() == 1 else t[..., None])
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    part = logits.shape[-1]
    first = (dist.get_rank(tp_group) if tp_size > 1 else 0) * part
    ids = torch.arange(first, first + part, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, float("-inf")), first, tp_size


def _sum_over(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` summed over ``group``, differentiable: every rank computes the same loss from the
    sum, so each rank's part gets the sum's gradient unchanged (megatron-core's
    ``reduce_from_tensor_model_parallel_region``, on an explicit group)."""
    return _SumOver.apply(x, group)


class _SumOver(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None
