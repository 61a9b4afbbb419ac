"""``chunked_token_outputs``: the output layer applied chunk by chunk gives the logprobs, entropies
(and logprobs of k support ids per token, ``chunked_head_outputs``) and gradients of the
whole-logits computation (log_softmax over hidden @ W^T), on one rank and vocab-parallel over
TP=2, in float32 and under bfloat16 autocast."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from grpo_testing.distributed import run_on_ranks
from megatron.core import parallel_state

from megatron.rl.grpo.chunked_head import chunked_head_outputs, chunked_token_outputs
from megatron.rl.grpo.entropy import token_entropy
from megatron.rl.grpo.logprobs import support_logprobs, token_logprobs

N, H, V_PADDED, V_REAL = 11, 8, 16, 13  # the last 3 ids are embedding padding


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V_PADDED, H, generator=g) * 0.7
    targets = torch.randint(0, V_REAL, (N,), generator=g)
    temperature = torch.tensor([1.0, 0.5, 0.0, 2.0, 1.0, 0.7, 1.0, 1.0, 0.3, 1.0, 1.5])
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return hidden, weight, targets, temperature, g_lp, g_ent


def whole(hidden, weight, targets, temperature, with_entropy=True):
    """The reference: whole (N, V) logits, the trainer's ``token_logprobs``/``token_entropy``."""
    logits = torch.matmul(hidden, weight.t())[None]  # (1, N, V)
    lp = token_logprobs(logits, targets[None], V_REAL, temperature[None])[0]
    ent = token_entropy(logits, V_REAL, temperature[None])[0] if with_entropy else None
    return lp, ent


def outputs_and_grads(fn, with_entropy=True, **kwargs):
    hidden, weight, targets, temperature, g_lp, g_ent = inputs()
    hidden.requires_grad_()
    weight.requires_grad_()
    lp, ent = fn(hidden, weight, targets, temperature, **kwargs)
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy else 0)
    loss.backward()
    return lp.detach(), None if ent is None else ent.detach(), hidden.grad, weight.grad


def chunked(hidden, weight, targets, temperature, chunk_elements, with_entropy=True):
    return chunked_token_outputs(
        hidden, weight, targets, temperature, V_REAL, None, with_entropy, chunk_elements
    )


@pytest.mark.parametrize(
    "chunk_elements, with_entropy",
    [
        pytest.param(V_PADDED, True, id="one-token-chunks"),
        pytest.param(3 * V_PADDED, True, id="uneven-chunks"),
        pytest.param(N * V_PADDED, True, id="one-chunk"),
        pytest.param(4 * V_PADDED, False, id="no-entropy"),
    ],
)
def test_chunks_match_the_whole_logits_and_their_gradients(chunk_elements, with_entropy):
    ref = outputs_and_grads(whole, with_entropy=with_entropy)
    got = outputs_and_grads(chunked, with_entropy=with_entropy, chunk_elements=chunk_elements)
    for name, r, c in zip(("logprobs", "entropy", "d hidden", "d weight"), ref, got):
        if r is None:
            assert c is None, name
            continue
        torch.testing.assert_close(c, r, atol=1e-5, rtol=1e-5, msg=name)
    assert torch.all(got[3][V_REAL:] == 0)  # padded ids: no probability, no gradient


def test_without_autograd_nothing_is_kept_and_the_values_are_the_same():
    hidden, weight, targets, temperature, _, _ = inputs()
    with torch.no_grad():
        lp, ent = chunked(hidden, weight, targets, temperature, 2 * V_PADDED)
    ref_lp, ref_ent = whole(hidden, weight, targets, temperature)
    assert lp.grad_fn is None
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)


def test_bf16_autocast_rounds_the_products_as_the_output_layer_would():
    """Under CPU autocast both compute the logits as a bfloat16 product: the same values."""
    with torch.autocast("cpu", torch.bfloat16):
        ref = outputs_and_grads(whole)
        got = outputs_and_grads(chunked, chunk_elements=4 * V_PADDED)
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)  # same bf16 logits
    torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=1e-5)
    for r, c in zip(ref[2:], got[2:]):  # gradients: bfloat16 products on both sides
        assert c.dtype == torch.float32
        torch.testing.assert_close(c, r, atol=2e-2, rtol=2e-2)
    fp32 = outputs_and_grads(whole)
    assert (got[0] - fp32[0]).abs().max() > 0  # bfloat16 did round


def support_inputs():
    """(N, 4) distinct real ids per token (the teacher's top-4) and an upstream gradient."""
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(V_REAL, generator=g)[:4] for _ in range(N)])
    return ids, torch.randn(N, 4, generator=g)


def support_outputs_and_grads(chunk_elements: int | None, tp_rank: int = 0, tp_group=None):
    """(N, 4) support logprobs, d hidden and d weight (this rank's rows) of a loss that reads
    the target logprobs and the support logprobs; whole logits when ``chunk_elements`` is None."""
    hidden, weight, targets, temperature, g_lp, _ = inputs()
    ids, g_support = support_inputs()
    size = 1 if tp_group is None else dist.get_world_size(tp_group)
    part = V_PADDED // size
    shard = weight[tp_rank * part : (tp_rank + 1) * part].clone().requires_grad_()
    hidden.requires_grad_()
    if chunk_elements is None:
        logits = torch.matmul(hidden, shard.t())[None]  # (1, N, V)
        lp = token_logprobs(logits, targets[None], V_REAL, temperature[None], tp_group)[0]
        on_support = support_logprobs(logits, ids[None], V_REAL, temperature[None], tp_group)[0]
    else:
        lp, _, on_support = chunked_head_outputs(
            hidden, shard, targets, temperature, V_REAL, tp_group, False, chunk_elements, ids
        )
    ((lp * g_lp).sum() + (on_support * g_support).sum()).backward()
    return on_support.detach(), hidden.grad, shard.grad


@pytest.mark.parametrize(
    "chunk_elements",
    [pytest.param(V_PADDED, id="one-token-chunks"), pytest.param(3 * V_PADDED, id="uneven")],
)
def test_support_logprobs_and_their_gradients_match_the_whole_logits(chunk_elements):
    ref = support_outputs_and_grads(None)
    got = support_outputs_and_grads(chunk_elements)
    for name, r, c in zip(("support", "d hidden", "d weight"), ref, got):
        torch.testing.assert_close(c, r, atol=1e-5, rtol=1e-5, msg=name)
    assert torch.all(got[2][V_REAL:] == 0)


def vocab_parallel(rank: int, world_size: int):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    group = parallel_state.get_tensor_model_parallel_group() if world_size > 1 else None
    hidden, weight, targets, temperature, g_lp, g_ent = inputs()
    part = V_PADDED // world_size
    shard = weight[rank * part : (rank + 1) * part].clone().requires_grad_()
    hidden.requires_grad_()
    lp, ent = chunked_token_outputs(
        hidden, shard, targets, temperature, V_REAL, group, True, 3 * part
    )
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    grads = [torch.empty_like(shard.grad) for _ in range(world_size)]
    dist.all_gather(grads, shard.grad)
    on_support, d_hidden, d_shard = support_outputs_and_grads(3 * part, rank, group)
    support_grads = [torch.empty_like(d_shard) for _ in range(world_size)]
    dist.all_gather(support_grads, d_shard)
    support = (on_support, d_hidden, torch.cat(support_grads))
    return lp.detach(), ent.detach(), hidden.grad, torch.cat(grads), *support


def test_vocab_parallel_chunks_match_a_single_rank():
    expected = (*outputs_and_grads(whole), *support_outputs_and_grads(None))
    for rank_result in run_on_ranks(vocab_parallel, 2):
        for r, c in zip(expected, rank_result, strict=True):
            torch.testing.assert_close(c, r, atol=1e-5, rtol=1e-5)
