"""``vocab_parallel_topk``: the top-k of the real vocabulary, equal at TP=2 (gloo) and TP=1."""

from __future__ import annotations

import pytest
import torch
from grpo_testing.distributed import run_on_ranks
from megatron.core import parallel_state

from megatron.rl.grpo.topk import vocab_parallel_topk

V_PADDED, V_REAL, K = 16, 13, 4  # the last 3 ids are embedding padding


def logits() -> torch.Tensor:
    """(2, 5, V_PADDED) logits whose padded ids hold the largest values."""
    g = torch.Generator().manual_seed(0)
    out = torch.randn(2, 5, V_PADDED, generator=g)
    out[..., V_REAL:] = 100.0  # padding must never be chosen
    return out


def topk_on_rank(rank: int, world_size: int):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    part = V_PADDED // world_size
    shard = logits()[..., rank * part : (rank + 1) * part]
    group = parallel_state.get_tensor_model_parallel_group() if world_size > 1 else None
    return vocab_parallel_topk(shard, K, V_REAL, group)


def test_top_k_of_the_real_vocabulary_in_descending_order():
    values, indices = vocab_parallel_topk(logits(), K, V_REAL)
    want_values, want_indices = logits()[..., :V_REAL].topk(K, dim=-1)
    assert values.shape == indices.shape == (2, 5, K) and indices.dtype == torch.int64
    assert torch.equal(values, want_values) and torch.equal(indices, want_indices)
    assert torch.all(values[..., :-1] >= values[..., 1:])


def test_top_k_at_tensor_parallel_2_equals_a_single_rank():
    ((values, indices),) = run_on_ranks(topk_on_rank, 1)
    for rank_values, rank_indices in run_on_ranks(topk_on_rank, 2):
        assert torch.equal(rank_values, values) and torch.equal(rank_indices, indices)
    assert int(indices.max()) < V_REAL


@pytest.mark.parametrize("k", [pytest.param(0, id="zero"), pytest.param(V_REAL + 1, id="above-V")])
def test_k_outside_the_vocabulary_is_an_error(k):
    with pytest.raises(ValueError, match="k must be in"):
        vocab_parallel_topk(logits(), k, V_REAL)
