"""The PyTorch reference of flash-attn's varlen and KV-cache functions against naive attention.

The oracle below loops over heads and query positions in float64, independently of the
vectorized reference. The last tests call megatron-core's own ``flash_decode_and_prefill`` with the
reference installed, so the argument conventions megatron-core uses are exercised on CPU.
"""

from __future__ import annotations

import types

import pytest
import torch

from megatron.rl.inference.megatron_core import flash_reference as ref

D = 8


def naive(q, k, v, causal, scale=None):
    """q (Lq, Hq, D), k/v (Lk, Hk, D) -> (Lq, Hq, D) float64; bottom-right causal alignment."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    groups = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    for h in range(q.shape[1]):
        kh, vh = k[:, h // groups].double(), v[:, h // groups].double()
        for i in range(q.shape[0]):
            last = i + k.shape[0] - q.shape[0] if causal else k.shape[0] - 1
            if last < 0:
                continue  # sees no key: zeros
            w = torch.softmax((kh[: last + 1] @ q[i, h].double()) * scale, dim=0)
            out[i, h] = w @ vh[: last + 1]
    return out


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def cumulative(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def paged(seqs, block_size, num_blocks, seed=0):
    """Scatter per-sequence (L, H, D) tensors into a shuffled paged cache; returns cache, table."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=g).tolist()
    heads = seqs[0].shape[1]
    # Unwritten cache memory is garbage, NaN and inf included (the engine allocates with empty).
    cache = torch.randn(num_blocks, block_size, heads, D, generator=g)
    cache[::2] = float("nan")
    cache[1::4] = float("inf")
    max_blocks = max(-(-s.shape[0] // block_size) for s in seqs) + 1
    table = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
    for b, s in enumerate(seqs):
        for n in range(-(-s.shape[0] // block_size)):
            block = order.pop()
            table[b, n] = block
            chunk = s[n * block_size : (n + 1) * block_size]
            cache[block, : chunk.shape[0]] = chunk
    return cache, table


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_varlen_contiguous_matches_naive(causal, heads):
    hq, hk = heads
    lens_q, lens_k = [3, 1, 5], [3, 4, 9]  # prefill, decode and prefill-over-context rows
    q = rand(sum(lens_q) + 2, hq, D, seed=1)  # 2 padding rows at the end (megatron pads)
    k, v = rand(sum(lens_k), hk, D, seed=2), rand(sum(lens_k), hk, D, seed=3)
    out = ref.flash_attn_varlen_func(
        q, k, v, cumulative(lens_q), cumulative(lens_k), 5, 9, causal=causal
    )
    cq, ck = cumulative(lens_q).tolist(), cumulative(lens_k).tolist()
    for b in range(3):
        want = naive(q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]], v[ck[b] : ck[b + 1]], causal)
        torch.testing.assert_close(out[cq[b] : cq[b + 1]].double(), want, atol=1e-5, rtol=1e-5)
    assert out[sum(lens_q) :].abs().max() == 0


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_varlen_over_a_paged_cache_matches_naive(block_size):
    lens_q, lens_k = [6, 1, 2], [6, 11, 7]
    keys = [rand(n, 2, D, seed=10 + i) for i, n in enumerate(lens_k)]
    vals = [rand(n, 2, D, seed=20 + i) for i, n in enumerate(lens_k)]
    num_blocks = sum(-(-n // block_size) for n in lens_k) + 3
    k_cache, table = paged(keys, block_size, num_blocks, seed=5)
    v_cache, table_v = paged(vals, block_size, num_blocks, seed=5)
    assert torch.equal(table, table_v)
    q = rand(sum(lens_q), 4, D, seed=7)
    out = ref.flash_attn_varlen_func(
        q,
        k_cache,
        v_cache,
        cumulative(lens_q),
        cumulative(lens_k),
        6,
        11,
        softmax_scale=0.3,
        causal=True,
        block_table=table,
    )
    cq = cumulative(lens_q).tolist()
    for b in range(3):
        want = naive(q[cq[b] : cq[b + 1]], keys[b], vals[b], causal=True, scale=0.3)
        torch.testing.assert_close(out[cq[b] : cq[b + 1]].double(), want, atol=1e-5, rtol=1e-5)


def test_padding_requests_with_no_keys_and_block_id_minus_one_give_zeros():
    k_cache, table = paged([rand(3, 1, D, seed=1)], 4, 4)
    table = torch.cat([table, torch.full_like(table, -1)])  # a padded request: no blocks
    q = rand(4, 2, D)
    out = ref.flash_attn_varlen_func(
        q,
        k_cache,
        k_cache,
        cumulative([3, 0]),
        cumulative([3, 0]),
        3,
        3,
        causal=True,
        block_table=table,
    )
    assert out[3:].abs().max() == 0
    assert out[:3].abs().max() > 0


def test_causal_rows_that_see_no_key_are_zero():
    q, k = rand(4, 1, D, seed=1), rand(2, 1, D, seed=2)  # Lk < Lq: the first 2 queries see none
    out = ref.flash_attn_varlen_func(q, k, k, cumulative([4]), cumulative([2]), 4, 2, causal=True)
    assert out[:2].abs().max() == 0
    torch.testing.assert_close(out[2:].double(), naive(q, k, k, True)[2:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [2, 8])
def test_kvcache_decode_over_a_paged_cache_matches_naive(block_size):
    lens = [5, 1, 12]
    keys = [rand(n, 2, D, seed=30 + i) for i, n in enumerate(lens)]
    vals = [rand(n, 2, D, seed=40 + i) for i, n in enumerate(lens)]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    k_cache, table = paged(keys, block_size, num_blocks, seed=9)
    v_cache, _ = paged(vals, block_size, num_blocks, seed=9)
    q = rand(3, 1, 4, D, seed=8)  # one query per request (decode)
    out, lse = ref.flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens=torch.tensor(lens, dtype=torch.int32),
        causal=True,
        block_table=table,
        num_splits=0,
        return_softmax_lse=True,
    )
    assert out.shape == (3, 1, 4, D) and lse.shape == (3, 4, 1)
    for b in range(3):
        want = naive(q[b], keys[b], vals[b], causal=True)
        torch.testing.assert_close(out[b].double(), want, atol=1e-5, rtol=1e-5)
        groups = 2
        for h in range(4):
            scores = (keys[b][:, h // groups].double() @ q[b, 0, h].double()) * D**-0.5
            assert float(lse[b, h, 0]) == pytest.approx(float(torch.logsumexp(scores, 0)), 1e-5)


def test_kvcache_appends_new_keys_in_place_then_attends_causally():
    cache_k, cache_v = torch.zeros(3, 10, 2, D), torch.zeros(3, 10, 2, D)
    old_k, old_v = rand(3, 4, 2, D, seed=1), rand(3, 4, 2, D, seed=2)
    cache_k[:, :4], cache_v[:, :4] = old_k, old_v
    new_k, new_v, q = rand(2, 3, 2, D, seed=3), rand(2, 3, 2, D, seed=4), rand(2, 3, 2, D, seed=5)
    seqlens = torch.tensor([4, 2], dtype=torch.int32)
    batch_idx = torch.tensor([2, 0], dtype=torch.int32)  # batch row b uses cache row batch_idx[b]
    out = ref.flash_attn_with_kvcache(
        q,
        cache_k,
        cache_v,
        k=new_k,
        v=new_v,
        cache_seqlens=seqlens,
        cache_batch_idx=batch_idx,
        causal=True,
    )
    assert torch.equal(cache_k[2, 4:7], new_k[0]) and torch.equal(cache_k[0, 2:5], new_k[1])
    assert torch.equal(cache_v[2, 4:7], new_v[0]) and torch.equal(cache_v[0, 2:5], new_v[1])
    assert torch.equal(cache_k[1, :4], old_k[1]) and cache_k[1, 4:].abs().max() == 0  # untouched
    for b, (row, n) in enumerate([(2, 7), (0, 5)]):
        want = naive(q[b], cache_k[row, :n], cache_v[row, :n], causal=True)
        torch.testing.assert_close(out[b].double(), want, atol=1e-5, rtol=1e-5)


def test_kvcache_appends_into_a_paged_cache():
    k_cache, table = paged([rand(3, 1, D, seed=1)], 2, 4)
    v_cache = k_cache.clone()
    new = rand(1, 2, 1, D, seed=2)
    ref.flash_attn_with_kvcache(
        rand(1, 2, 1, D), k_cache, v_cache, k=new, v=new, cache_seqlens=3, block_table=table
    )
    # positions 3 and 4: block table[0, 1] offset 1, then block table[0, 2] offset 0
    assert torch.equal(k_cache[int(table[0, 1]), 1], new[0, 0])
    assert torch.equal(k_cache[int(table[0, 2]), 0], new[0, 1])


def test_bfloat16_inputs_keep_their_dtype():
    q = rand(3, 2, D).bfloat16()
    out = ref.flash_attn_varlen_func(q, q, q, cumulative([3]), cumulative([3]), 3, 3, causal=True)
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dropout_p": 0.1},
        {"window_size": (4, 0)},
        {"softcap": 1.0},
        {"return_attn_probs": True},
        {"alibi_slopes": torch.ones(2)},
    ],
    ids=lambda kw: next(iter(kw)),
)
def test_unsupported_varlen_options_raise(kwargs):
    q = rand(3, 2, D)
    with pytest.raises(NotImplementedError, match="flash_reference"):
        ref.flash_attn_varlen_func(q, q, q, cumulative([3]), cumulative([3]), 3, 3, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{"rotary_cos": torch.ones(4, 4)}, {"cache_leftpad": torch.zeros(1)}, {"softcap": 2.0}],
    ids=lambda kw: next(iter(kw)),
)
def test_unsupported_kvcache_options_raise(kwargs):
    cache = torch.zeros(1, 4, 2, D)
    with pytest.raises(NotImplementedError, match="flash_reference"):
        ref.flash_attn_with_kvcache(rand(1, 1, 2, D), cache, cache, cache_seqlens=2, **kwargs)


# --------------------------------------------------------------- through megatron-core's code


@pytest.fixture
def reference_installed(monkeypatch):
    """The reference installed into megatron-core's attention module (restored afterwards)."""
    from megatron.core.transformer import attention

    for name in ("flash_attn_varlen_func", "flash_attn_with_kvcache", "is_fa_min_version"):
        monkeypatch.setattr(attention, name, getattr(attention, name))
    assert ref.install_into_megatron_core(force=True)
    assert ref.reference_in_use()
    return attention


def fake_attention_module():
    """What ``Attention.flash_decode_and_prefill`` reads from ``self`` (inference, no MLA; 0.19
    also reads the layer number, for sliding windows, and which flash-attn generation to run)."""
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    module = types.SimpleNamespace(
        training=False,
        batch_invariant_mode=False,
        softmax_scale=None,
        config=config,
        layer_number=1,
        flash_attention_version=None,
    )
    if hasattr(Attention, "_resolve_flash_version"):
        module._resolve_flash_version = types.MethodType(Attention._resolve_flash_version, module)
    return module


def test_megatron_core_prefill_path_uses_the_reference(reference_installed):
    lens_q, lens_k = [4, 1], [4, 6]
    keys = [rand(n, 2, D, seed=50 + i) for i, n in enumerate(lens_k)]
    k_cache, table = paged(keys, 4, 6)
    q = rand(sum(lens_q) + 3, 1, 2, D, seed=3)  # megatron's [tokens, 1, heads, dim], padded
    out = reference_installed.Attention.flash_decode_and_prefill(
        fake_attention_module(),
        q,
        k_cache,
        k_cache,
        6,
        6,
        cumulative(lens_q),
        cumulative(lens_k),
        torch.tensor(lens_k, dtype=torch.int32),
        table,
        False,
    )
    assert out.shape == (sum(lens_q) + 3, 1, 2, D)
    cq = cumulative(lens_q).tolist()
    for b in range(2):
        want = naive(q[cq[b] : cq[b + 1], 0], keys[b], keys[b], causal=True)
        torch.testing.assert_close(out[cq[b] : cq[b + 1], 0].double(), want, atol=1e-5, rtol=1e-5)


def test_megatron_core_decode_path_uses_the_reference(reference_installed):
    lens = [3, 7]
    keys = [rand(n, 1, D, seed=60 + i) for i, n in enumerate(lens)]
    k_cache, table = paged(keys, 2, 8)
    q = rand(2, 1, 2, D, seed=4)  # decode-only: one token per request
    out = reference_installed.Attention.flash_decode_and_prefill(
        fake_attention_module(),
        q,
        k_cache,
        k_cache,
        1,
        7,
        cumulative([1, 1]),
        cumulative(lens),
        torch.tensor(lens, dtype=torch.int32),
        table,
        True,
    )
    for b in range(2):
        want = naive(q[b], keys[b], keys[b], causal=True)
        torch.testing.assert_close(out[b].double(), want, atol=1e-5, rtol=1e-5)


def test_dynamic_batching_version_check_passes_once_installed(reference_installed):
    assert reference_installed.is_fa_min_version("2.7.3")


def test_install_leaves_an_importable_flash_attn_alone(monkeypatch):
    from megatron.core.transformer import attention

    def real(*a, **k):
        return None

    monkeypatch.setattr(attention, "flash_attn_varlen_func", real)
    monkeypatch.setattr(attention, "flash_attn_with_kvcache", real)
    assert not ref.install_into_megatron_core()
    assert attention.flash_attn_varlen_func is real
