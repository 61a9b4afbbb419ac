"""Vocab-parallel ``token_logprobs`` and ``support_logprobs`` (TP=2 over gloo) equal the
single-rank computation."""

from __future__ import annotations

import torch
import torch.distributed as dist
from grpo_testing.distributed import run_on_ranks
from megatron.core import parallel_state

from megatron.rl.grpo.logprobs import support_logprobs, token_logprobs

V_PADDED, V_REAL = 16, 13  # the last 3 ids are embedding padding


def inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, V_PADDED, generator=g)
    targets = torch.randint(0, V_REAL, (2, 5), generator=g)
    temperature = torch.tensor([1.0, 0.5])
    return logits, targets, temperature


def support_inputs():
    """(2, 5, 3) distinct real ids per position, spread over both shards, and an upstream
    gradient."""
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(V_REAL, generator=g)[:3] for _ in range(10)]).view(2, 5, 3)
    return ids, torch.randn(2, 5, 3, generator=g)


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
    ids, g_support = support_inputs()
    shard.grad = None
    on_support = support_logprobs(shard, ids, V_REAL, temperature, group)
    (on_support * g_support).sum().backward()
    support_grads = [torch.empty_like(shard.grad) for _ in range(world_size)]
    dist.all_gather(support_grads, shard.grad)
    return lp.detach(), torch.cat(grads, dim=-1), on_support.detach(), torch.cat(support_grads, -1)


def test_vocab_parallel_logprobs_and_gradients_match_a_single_rank():
    (single,) = run_on_ranks(logprobs_and_grad, 1)
    single_lp, single_grad = single[:2]
    for rank in run_on_ranks(logprobs_and_grad, 2):
        for name, got, ref in zip(("lp", "grad", "support", "d support"), rank, single):
            torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6, msg=name)
    grad0 = rank[1]
    assert torch.all(grad0[..., V_REAL:] == 0)  # padded ids get no probability, no gradient

    logits, targets, temperature = inputs()
    ref = torch.log_softmax(logits[..., :V_REAL] / temperature[:, None, None], -1)
    torch.testing.assert_close(single_lp, ref.gather(-1, targets[..., None])[..., 0])


def test_support_logprobs_gather_the_tempered_log_softmax_and_pass_its_gradient():
    logits, _, temperature = inputs()
    ids, g_support = support_inputs()
    logits.requires_grad_()
    got = support_logprobs(logits, ids, V_REAL, temperature)
    (got * g_support).sum().backward()
    leaf = logits.detach()[..., :V_REAL].clone().requires_grad_()
    ref = torch.log_softmax(leaf / temperature[:, None, None], -1).gather(-1, ids)
    (ref * g_support).sum().backward()
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(logits.grad[..., :V_REAL], leaf.grad)
    assert torch.all(logits.grad[..., V_REAL:] == 0)
