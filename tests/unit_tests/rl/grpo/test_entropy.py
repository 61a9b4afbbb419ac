"""Per-token entropy from (vocab-parallel) logits: hand-computed values, gradients, TP=2."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from grpo_testing.distributed import run_on_ranks
from megatron.core import parallel_state

from megatron.rl.grpo.entropy import token_entropy


def reference_entropy(logits: torch.Tensor, vocab: int, t: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(logits[..., :vocab].double() / t[:, None, None], dim=-1)
    return -(p * p.log()).sum(-1)


@pytest.mark.parametrize(
    "logits, vocab, expected",
    [
        pytest.param([0.0, 0.0, 0.0, 0.0], 4, math.log(4), id="uniform-4"),
        pytest.param([0.0, 0.0, 0.0, 5.0], 3, math.log(3), id="padded-id-ignored"),
        pytest.param(
            [math.log(0.25), math.log(0.75)],
            2,
            -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)),
            id="two-tokens",
        ),
        pytest.param([0.0, -1e4], 2, 0.0, id="near-deterministic"),
    ],
)
def test_entropy_values(logits, vocab, expected):
    got = token_entropy(torch.tensor([[logits]]), vocab)
    assert got.item() == pytest.approx(expected, abs=1e-6)


def test_temperature_per_row_and_per_token_and_gradient():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 8, generator=g, dtype=torch.float64)
    t = torch.tensor([1.0, 0.5], dtype=torch.float64)
    x = logits.clone().requires_grad_()
    h = token_entropy(x, 6, t)
    torch.testing.assert_close(h, reference_entropy(logits, 6, t).float())
    torch.testing.assert_close(token_entropy(logits, 6, t[:, None].expand(2, 3)), h.detach())
    h.sum().backward()
    y = logits.clone().requires_grad_()
    reference_entropy(y, 6, t).sum().backward()
    torch.testing.assert_close(x.grad, y.grad.to(x.grad.dtype), atol=1e-6, rtol=1e-5)
    assert torch.all(x.grad[..., 6:] == 0)


V_PADDED, V_REAL = 16, 13


def entropy_and_grad(rank: int, world_size: int):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, V_PADDED, generator=g)
    temperature = torch.tensor([1.0, 0.7])
    part = V_PADDED // world_size
    shard = logits[..., rank * part : (rank + 1) * part].clone().requires_grad_()
    group = parallel_state.get_tensor_model_parallel_group() if world_size > 1 else None
    h = token_entropy(shard, V_REAL, temperature, group)
    h.sum().backward()
    grads = [torch.empty_like(shard.grad) for _ in range(world_size)]
    dist.all_gather(grads, shard.grad)
    return h.detach(), torch.cat(grads, dim=-1)


def test_vocab_parallel_entropy_and_gradients_match_a_single_rank():
    ((single_h, single_grad),) = run_on_ranks(entropy_and_grad, 1)
    for h, grad in run_on_ranks(entropy_and_grad, 2):
        torch.testing.assert_close(h, single_h, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(grad, single_grad, atol=1e-6, rtol=1e-6)
