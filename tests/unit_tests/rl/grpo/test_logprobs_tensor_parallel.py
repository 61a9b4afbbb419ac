"""Vocab-parallel ``token_logprobs`` (TP=2 over gloo) equals the single-rank computation."""

from __future__ import annotations

import torch
import torch.distributed as dist
from grpo_testing.distributed import run_on_ranks
from megatron.core import parallel_state

from megatron.rl.grpo.logprobs import token_logprobs

V_PADDED, V_REAL = 16, 13  # the last 3 ids are embedding padding


def inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, V_PADDED, generator=g)
    targets = torch.randint(0, V_REAL, (2, 5), generator=g)
    temperature = torch.tensor([1.0, 0.5])
    return logits, targets, temperature


def logprobs_and_grad(rank: int, world_size: int):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    logits, targets, temperature = inputs()
    part = V_PADDED // world_size
    shard = logits[..., rank * part : (rank + 1) * part].clone().requires_grad_()
    group = parallel_state.get_tensor_model_parallel_group() if world_size > 1 else None
    lp = token_logprobs(shard, targets, V_REAL, temperature, group)
    lp.sum().backward()
    grads = [torch.empty_like(shard.grad) for _ in range(world_size)]
    dist.all_gather(grads, shard.grad)
    return lp.detach(), torch.cat(grads, dim=-1)


def test_vocab_parallel_logprobs_and_gradients_match_a_single_rank():
    ((single_lp, single_grad),) = run_on_ranks(logprobs_and_grad, 1)
    (lp0, grad0), (lp1, grad1) = run_on_ranks(logprobs_and_grad, 2)
    torch.testing.assert_close(lp0, single_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lp1, single_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad0, single_grad, atol=1e-6, rtol=1e-6)
    assert torch.all(grad0[..., V_REAL:] == 0)  # padded ids get no probability, no gradient

    logits, targets, temperature = inputs()
    ref = torch.log_softmax(logits[..., :V_REAL] / temperature[:, None, None], -1)
    torch.testing.assert_close(single_lp, ref.gather(-1, targets[..., None])[..., 0])
