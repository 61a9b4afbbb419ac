"""``chunked_token_outputs``: the output layer applied chunk by chunk gives the logprobs, entropies
and gradients of the whole-logits computation (log_softmax over hidden @ W^T), on one rank and
vocab-parallel over TP=2, in float32 and under bfloat16 autocast."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from grpo_testing.distributed import run_on_ranks
from megatron.core import parallel_state

from megatron.rl.grpo.chunked_head import chunked_token_outputs
from megatron.rl.grpo.entropy import token_entropy
from megatron.rl.grpo.logprobs import token_logprobs

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
    return lp.detach(), ent.detach(), hidden.grad, torch.cat(grads)


def test_vocab_parallel_chunks_match_a_single_rank():
    lp, ent, d_hidden, d_weight = outputs_and_grads(whole)
    for rank_result in run_on_ranks(vocab_parallel, 2):
        for r, c in zip((lp, ent, d_hidden, d_weight), rank_result):
            torch.testing.assert_close(c, r, atol=1e-5, rtol=1e-5)
