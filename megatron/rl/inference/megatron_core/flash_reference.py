"""A pure-PyTorch reference of flash-attn's ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache``.

megatron-core's ``DynamicInferenceEngine`` computes attention with exactly these two flash-attn
(>= 2.7.3) functions: ``flash_attn_varlen_func`` for steps with a prefill (packed variable-length
queries over the paged KV cache, ``block_table``) and ``flash_attn_with_kvcache`` for decode-only
steps. Where flash-attn cannot be installed (no binary wheel for the machine) this module stands
in for them: same signatures, same semantics for what megatron-core uses, slow but correct.

Semantics (as documented by flash-attn):

* Layouts: varlen ``q`` is (total_q, Hq, D) with ``cu_seqlens_q`` (B+1,) int32 offsets; ``k``/``v``
  are (total_k, Hk, D) with ``cu_seqlens_k``, or, with ``block_table`` (B, max_blocks) int32, a paged
  cache (num_blocks, block_size, Hk, D) where key j of sequence b lives in block
  ``block_table[b, j // block_size]`` at offset ``j % block_size``. ``flash_attn_with_kvcache``
  takes ``q`` (B, Lq, Hq, D) and a cache (B_cache, S, Hk, D) or, with ``block_table``, a paged one.
* GQA/MQA: Hq must be a multiple of Hk; query head h reads key head ``h // (Hq // Hk)``.
* ``causal`` aligns the mask to the bottom-right corner: query i of a sequence with Lq queries and
  Lk keys sees key j iff ``j <= i + Lk - Lq``. A query row that sees no key outputs zeros.
* ``flash_attn_with_kvcache`` with ``k``/``v`` writes them into the cache *in place* at positions
  ``cache_seqlens[b] ..`` and attends over ``cache_seqlens[b] + Lnew`` keys.
* Query rows of a varlen ``q`` past ``cu_seqlens_q[-1]`` (megatron-core pads the token count) are
  returned as zeros.

Options megatron-core does not use (dropout, sliding windows, softcap, ALiBi, rotary embedding,
left padding, returning attention probabilities) raise ``NotImplementedError`` rather than being
silently ignored. Scores are computed in float32; outputs have the dtype of ``q``.

``install_into_megatron_core()`` plugs the reference into megatron-core's attention module when
flash-attn (and FA3) are not importable; the CUDA tier calls it before building the engine.
"""

from __future__ import annotations

import torch

_MAX_SCORE_ELEMENTS = 1 << 27
"""Attention scores materialized at once (batch chunks are sized to stay under it)."""


def _unsupported(**options) -> None:
    for name, value in options.items():
        if value:
            raise NotImplementedError(f"flash_reference: {name}={value!r} is not supported")


def _check_window(window_size) -> None:
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(
            f"flash_reference: window_size={tuple(window_size)} is not supported (only (-1, -1))"
        )


def _gather_paged(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Keys/values 0..length-1 of every sequence of a paged cache: (B, length, Hk, D).

    Positions past a sequence's own blocks read block 0 (masked out by the caller); ids of -1
    (megatron-core's padding rows) are treated the same way.
    """
    block_size = cache.shape[1]
    positions = torch.arange(length, device=cache.device)  # (L,)
    column = (positions // block_size).clamp(max=block_table.shape[1] - 1)  # (L,)
    blocks = block_table.long()[:, column].clamp(min=0)  # (B, L)
    return cache[blocks, (positions % block_size)[None, :].expand_as(blocks)]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lens_q: torch.Tensor,
    lens_k: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention of padded batches.

    q (B, Lq, Hq, D), k/v (B, Lk, Hk, D), lens_q/lens_k (B,) valid lengths. Returns the output
    (B, Lq, Hq, Dv) in q's dtype (zeros on rows that see no key) and the log-sum-exp (B, Hq, Lq)
    in float32 (-inf on such rows).
    """
    num_heads, num_kv_heads = q.shape[2], k.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(
            f"flash_reference: {num_heads} query heads are not a multiple of {num_kv_heads} kv heads"
        )
    groups = num_heads // num_kv_heads
    # Keys past a sequence's length come from unwritten cache memory, which may hold NaN or inf:
    # zero them, since a masked probability of 0 times NaN would still poison the output.
    key_valid = torch.arange(k.shape[1], device=k.device)[None, :] < lens_k[:, None]  # (B, Lk)
    k = k.masked_fill(~key_valid[:, :, None, None], 0)
    v = v.masked_fill(~key_valid[:, :, None, None], 0)
    qf = q.float().permute(0, 2, 1, 3)  # (B, Hq, Lq, D)
    kf = k.float().permute(0, 2, 1, 3).repeat_interleave(groups, dim=1)  # (B, Hq, Lk, D)
    vf = v.float().permute(0, 2, 1, 3).repeat_interleave(groups, dim=1)  # (B, Hq, Lk, Dv)
    i = torch.arange(q.shape[1], device=q.device)[None, :, None]  # (1, Lq, 1)
    j = torch.arange(k.shape[1], device=q.device)[None, None, :]  # (1, 1, Lk)
    lq, lk = lens_q.long()[:, None, None], lens_k.long()[:, None, None]  # (B, 1, 1)
    mask = (i < lq) & (j < lk)  # (B, Lq, Lk)
    if causal:
        mask &= j <= i + lk - lq
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # (B, Hq, Lq, Lk)
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hq, Lq); -inf on rows that see no key
    probs = torch.exp(scores - lse.masked_fill(lse.isinf(), 0.0)[..., None])  # 0 on such rows
    out = torch.matmul(probs, vf)  # (B, Hq, Lq, Dv)
    return out.permute(0, 2, 1, 3).to(q.dtype), lse


def _attend_chunked(q, k, v, lens_q, lens_k, causal, scale):
    """``_attend`` over batch chunks small enough to bound the score memory."""
    per_row = q.shape[2] * max(q.shape[1], 1) * max(k.shape[1], 1)
    step = max(1, _MAX_SCORE_ELEMENTS // per_row)
    outs, lses = [], []
    for b in range(0, q.shape[0], step):
        s = slice(b, b + step)
        out, lse = _attend(q[s], k[s], v[s], lens_q[s], lens_k[s], causal, scale)
        outs.append(out)
        lses.append(lse)
    if not outs:
        return q.new_zeros(*q.shape[:3], v.shape[-1]), q.new_zeros(0, q.shape[2], q.shape[1])
    return torch.cat(outs), torch.cat(lses)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of packed variable-length sequences (optionally over a paged KV cache).

    ``max_seqlen_q``/``max_seqlen_k`` are accepted for signature compatibility; the lengths are
    taken from the cumulative offsets. ``deterministic`` is irrelevant here (always deterministic).
    """
    _unsupported(dropout_p=dropout_p, softcap=softcap, return_attn_probs=return_attn_probs)
    _unsupported(alibi_slopes=alibi_slopes is not None)
    _check_window(window_size)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    lens_q, lens_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]  # (B,)
    out = q.new_zeros(*q.shape[:2], v.shape[-1])  # (total_q, Hq, Dv)
    if lens_q.numel() == 0 or int(lens_q.max()) == 0:
        return out
    width_q, width_k = int(lens_q.max()), max(1, int(lens_k.max()))
    offsets_q = torch.arange(width_q, device=q.device)[None, :]  # (1, Lq)
    valid_q = offsets_q < lens_q[:, None]  # (B, Lq)
    index_q = (cu_q[:-1, None] + offsets_q).clamp(max=max(q.shape[0] - 1, 0))  # (B, Lq)
    q_pad = q[index_q]  # (B, Lq, Hq, D)
    if block_table is not None:
        k_pad = _gather_paged(k, block_table, width_k)
        v_pad = _gather_paged(v, block_table, width_k)
    else:
        offsets_k = torch.arange(width_k, device=k.device)[None, :]
        index_k = (cu_k[:-1, None] + offsets_k).clamp(max=max(k.shape[0] - 1, 0))
        k_pad, v_pad = k[index_k], v[index_k]
    out_pad, _ = _attend_chunked(q_pad, k_pad, v_pad, lens_q, lens_k, causal, scale)
    out[index_q[valid_q]] = out_pad[valid_q]
    return out


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` (B, Lq, Hq, D) over a (paged) KV cache, after appending ``k``/``v``.

    ``num_splits`` is a performance hint of the kernel and is ignored; ``rotary_interleaved`` only
    matters with rotary embeddings, which are not supported.
    """
    _unsupported(softcap=softcap)
    _unsupported(
        rotary_cos=rotary_cos is not None,
        rotary_sin=rotary_sin is not None,
        cache_leftpad=cache_leftpad is not None,
        alibi_slopes=alibi_slopes is not None,
    )
    _check_window(window_size)
    if (k is None) != (v is None):
        raise ValueError("flash_reference: pass both k and v, or neither")
    if block_table is not None and cache_batch_idx is not None:
        raise ValueError("flash_reference: cache_batch_idx cannot be combined with block_table")
    batch, width_q = q.shape[0], q.shape[1]
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    dev = q.device
    if cache_seqlens is None:
        if block_table is not None:
            raise ValueError("flash_reference: a paged cache needs cache_seqlens")
        cached = torch.full((batch,), k_cache.shape[1], dtype=torch.long, device=dev)
    elif isinstance(cache_seqlens, int):
        cached = torch.full((batch,), cache_seqlens, dtype=torch.long, device=dev)
    else:
        cached = cache_seqlens.long().to(dev)
    new = 0 if k is None else k.shape[1]
    lens_k = cached + new  # (B,)
    if block_table is not None:
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
    if batch and int(lens_k.max()) > capacity:
        raise ValueError(
            f"flash_reference: {int(lens_k.max())} keys do not fit a cache of {capacity} positions"
        )
    rows = (
        cache_batch_idx.long().to(dev)
        if cache_batch_idx is not None
        else torch.arange(batch, device=dev)
    )
    if k is not None:  # append the new keys/values in place
        positions = cached[:, None] + torch.arange(new, device=dev)[None, :]  # (B, Lnew)
        if block_table is not None:
            block_size = k_cache.shape[1]
            blocks = block_table.long().gather(1, positions // block_size)  # (B, Lnew)
            k_cache[blocks, positions % block_size] = k.to(k_cache.dtype)
            v_cache[blocks, positions % block_size] = v.to(v_cache.dtype)
        else:
            k_cache[rows[:, None], positions] = k.to(k_cache.dtype)
            v_cache[rows[:, None], positions] = v.to(v_cache.dtype)
    width_k = max(1, int(lens_k.max())) if batch else 1
    if block_table is not None:
        k_pad = _gather_paged(k_cache, block_table, width_k)
        v_pad = _gather_paged(v_cache, block_table, width_k)
    else:
        k_pad, v_pad = k_cache[rows, :width_k], v_cache[rows, :width_k]
    lens_q = torch.full((batch,), width_q, dtype=torch.long, device=dev)
    out, lse = _attend_chunked(q, k_pad, v_pad, lens_q, lens_k, causal, scale)
    return (out, lse) if return_softmax_lse else out


def _reference_is_new_enough(version: str, check_equality: bool = True) -> bool:
    """Stands in for megatron-core's ``is_fa_min_version`` once the reference is installed."""
    return True


def install_into_megatron_core(force: bool = False) -> bool:
    """Make megatron-core's attention use this reference where flash-attn is missing.

    Replaces ``flash_attn_varlen_func``/``flash_attn_with_kvcache`` (and the flash-attn version
    check that guards dynamic batching) in ``megatron.core.transformer.attention`` when flash-attn
    did not import there and FA3 is absent, or always with ``force``. Returns whether the
    reference is now in use. Idempotent.
    """
    from megatron.core.transformer import attention

    if attention.flash_attn_varlen_func is flash_attn_varlen_func:
        return True
    have_fa2 = attention.flash_attn_varlen_func is not None
    if not force and (have_fa2 or attention.HAVE_FA3):
        return False
    if attention.HAVE_FA3:
        raise RuntimeError("flash_reference: FA3 is importable; megatron-core uses it instead")
    attention.flash_attn_varlen_func = flash_attn_varlen_func
    attention.flash_attn_with_kvcache = flash_attn_with_kvcache
    attention.is_fa_min_version = _reference_is_new_enough
    return True


def reference_in_use() -> bool:
    """Whether megatron-core's attention currently calls this reference."""
    from megatron.core.transformer import attention

    return attention.flash_attn_varlen_func is flash_attn_varlen_func


def attention_backend_name() -> str:
    """Which attention kernels megatron-core's dynamic engine uses here (before or after
    ``dynamic_engine.build_megatron_engine`` installs the reference where flash-attn is missing)."""
    from megatron.core.transformer import attention

    if reference_in_use():
        return "flash_reference (PyTorch)"
    if attention.HAVE_FA3:
        return "flash-attn 3"
    if attention.flash_attn_varlen_func is not None:
        return "flash-attn 2"
    return "flash_reference (PyTorch)"
