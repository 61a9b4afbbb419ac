"""Batched token sampling with per-row temperature, top-k, top-p and per-row uniforms.

Each row brings its own uniform draw (from its request's seeded RNG), so a row's token depends
only on its own logits and RNG, never on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megatron.rl.seeding import derive_seed


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens and logprobs of ``sample_with_alternatives`` (no alternatives)."""
    tokens, logprobs, _, _ = sample_with_alternatives(
        logits, temperature, top_p, top_k, uniforms, 0
    )
    return tokens, logprobs


def sample_with_alternatives(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    uniforms: torch.Tensor,
    top_n: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row by inverse-CDF over the filtered, tempered distribution.

    Args:
        logits: (B, V) float logits; entries that must never be sampled are -inf.
        temperature: (B,) temperatures; 0 means greedy (argmax).
        top_p: (B,) nucleus masses in (0, 1]; 1 disables.
        top_k: (B,) int; 0 disables.
        uniforms: (B,) draws in [0, 1).

        top_n: alternatives to return per row (0: none).

    Returns:
        tokens (B,) int64 and logprobs (B,) float32: the log-probability of each token under the
        tempered distribution before top-k/top-p truncation (temperature 1 for greedy rows), which
        is the distribution the trainer recomputes for the importance ratio; and the ``top_n``
        most likely tokens of that same distribution, ids (B, top_n) int64 and logprobs
        (B, top_n) float32 (``top_alternatives``).
    """
    logits = logits.float()
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    logprobs_all = torch.log_softmax(logits / scale[:, None], dim=-1)  # (B, V)

    sorted_logp, order = sort_descending_stable(logprobs_all)  # (B, V)
    probs = sorted_logp.exp()
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        probs = _truncate(probs, top_p, top_k)  # zero outside each row's top-k / top-p
    cdf = probs.cumsum(dim=-1)  # (B, V)
    target = (uniforms.float() * cdf[:, -1])[:, None]  # (B, 1)
    pick = torch.searchsorted(cdf, target, right=True).clamp_(max=logits.shape[-1] - 1)
    sampled = order.gather(-1, pick).squeeze(-1)  # (B,)
    tokens = torch.where(greedy, order[:, 0], sampled)
    top_ids, top_logprobs = top_alternatives(logprobs_all, top_n)
    return tokens, logprobs_all.gather(-1, tokens[:, None]).squeeze(-1), top_ids, top_logprobs


def top_alternatives(logprobs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` largest entries of each row of (B, V) ``logprobs``: ids (B, n) int64 and their
    values (B, n), most likely first, ties by the lower id. The values are the entries
    themselves (no recomputation), so they equal the sampled token's logprob bitwise where the
    ids agree."""
    if n <= 0:
        empty = torch.empty(logprobs.shape[0], 0)
        return empty.long(), empty.to(logprobs.dtype)
    values, ids = torch.topk(logprobs, min(n, logprobs.shape[-1]), dim=-1)  # (B, n)
    by_id = torch.argsort(ids, dim=-1, stable=True)
    ids, values = ids.gather(-1, by_id), values.gather(-1, by_id)
    by_value = torch.sort(values, dim=-1, descending=True, stable=True).indices
    return ids.gather(-1, by_value), values.gather(-1, by_value)


def _truncate(probs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Sorted probabilities (B, V) with the entries outside each row's top-k and top-p mass set
    to 0 (the best token always stays)."""
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]  # (1, V)
    keep = torch.ones_like(probs, dtype=torch.bool)
    k = top_k.to(torch.long)[:, None]
    keep &= (k <= 0) | (rank < k)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
    keep &= mass_before < top_p.float()[:, None]
    keep[:, 0] = True
    return torch.where(keep, probs, torch.zeros_like(probs))


def sort_descending_stable(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.sort(values, dim=-1, descending=True, stable=True)`` of a (B, V) float32 CPU
    tensor, ~6x faster on this CPU at V of 300 to 1000 (where sampling's sort took ~10% of a
    1M-parameter decode step).

    Each entry becomes one int64 key: its float bits mapped to an integer of the same order
    (a negative float's magnitude bits negated, so -0.0 and 0.0 tie as they compare), negated
    for descending order, scaled by 2**shift and joined with the entry's index in the low bits.
    The keys are distinct, so any sort of them (numpy's vectorized one) gives the stable order;
    the index comes back from the low bits. Other dtypes, devices or shapes take ``torch.sort``.
    """
    batch_dims, width = values.shape[:-1], values.shape[-1]
    if values.dtype != torch.float32 or values.device.type != "cpu" or width >= 1 << 30:
        return torch.sort(values, dim=-1, descending=True, stable=True)
    shift = max(1, (width - 1).bit_length())
    bits = values.contiguous().view(torch.int32).numpy()  # (..., V)
    sign = bits >> 31  # -1 for negative floats, else 0
    ordered = (bits ^ (sign & 0x7FFFFFFF)) - sign  # float order as integers: -x -> -bits(x)
    keys = ordered.astype(np.int64) * -(1 << shift) + np.arange(width, dtype=np.int64)
    keys.sort(axis=-1)
    order = torch.from_numpy(keys & ((1 << shift) - 1)).reshape(*batch_dims, width)
    return values.gather(-1, order), order


def token_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that samples the token at ``position`` of the request ``seed``.

    24 bits, so it is exact in float32 and never rounds up to 1.0.
    """
    return (derive_seed(seed, position) >> 39) / 2**24


def alternatives_of(
    rows: Sequence[Any], top_ids: torch.Tensor, top_values: torch.Tensor
) -> list[tuple[tuple[int, float], ...]]:
    """Each row's first ``row.top_logprobs`` (id, logprob) pairs of the (B, n) alternatives."""
    if not top_ids.shape[-1]:
        return [()] * len(rows)
    return [
        tuple(zip(ids[: row.top_logprobs], values[: row.top_logprobs]))
        for row, ids, values in zip(rows, top_ids.tolist(), top_values.tolist())
    ]
