"""Per-slot KV cache of the CPU tier's row runner (``KVCacheRowRunner``).

The cache holds, for every attention layer, keys and values of shape
``(num_slots, num_kv_heads, max_seq_len, head_dim)``. A request owns one slot for its lifetime and
each slot keeps its own length, so requests at different offsets share one forward pass: that is
what megatron-core's static inference context (one offset per batch) cannot do.

A forward pass runs inside ``with cache.step(slots, starts, lengths):``; the core attention of each
layer (``megatron.rl.models.attention.SDPACoreAttention``) finds the active step and calls
``attend``. Outside a step the attention is plain causal self-attention (training).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from megatron.rl.models.attention import attention_step


class KVCache:
    """Keys and values of every layer for ``num_slots`` requests of up to ``max_seq_len`` tokens."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        # Head-major per slot: the keys a step reads, (slots, heads, :length, D), are a view that
        # batched matmuls and SDPA take as they are (no gather, no transpose copy).
        shape = (num_layers, num_slots, num_kv_heads, max_seq_len, head_dim)
        # Reserved, not written: a slot is zeroed on its first use (``step``), and only up to the
        # longest context stepped so far, so on the CPU only the pages of slots and positions in
        # use become resident (the OS maps a large allocation's pages on first touch) and the
        # memory held follows the requests in flight and their lengths, not ``num_slots`` x
        # ``max_seq_len``.
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.zeroed_slots = 0
        """Slots ``0 .. zeroed_slots - 1`` have been zeroed at positions below ``zeroed_len`` (or
        written there); nothing else was ever read."""
        self.zeroed_len = 0

    def release(self) -> None:
        """Forget every slot (no request may hold one): the keys and values are allocated anew
        and untouched, so the pages of the slots used so far go back to the OS, and each slot is
        zeroed again on its next first use."""
        self.keys = torch.empty_like(self.keys)
        self.values = torch.empty_like(self.values)
        self.zeroed_slots = 0
        self.zeroed_len = 0

    def zero_slots_below(self, end: int) -> None:
        """Zero slots ``zeroed_slots .. end - 1`` (positions below ``zeroed_len``) on their first
        use: the cache then reads as if it had been allocated with zeros."""
        if end > self.zeroed_slots:
            self.keys[:, self.zeroed_slots : end, :, : self.zeroed_len].zero_()
            self.values[:, self.zeroed_slots : end, :, : self.zeroed_len].zero_()
            self.zeroed_slots = end

    def zero_positions_below(self, length: int) -> None:
        """Zero positions ``zeroed_len .. length - 1`` of the slots in use so far, before anything
        reads or writes there (a step's context, a copied or restored prefix)."""
        if length > self.zeroed_len:
            self.keys[:, : self.zeroed_slots, :, self.zeroed_len : length].zero_()
            self.values[:, : self.zeroed_slots, :, self.zeroed_len : length].zero_()
            self.zeroed_len = length

    @contextlib.contextmanager
    def step(
        self, slots: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor
    ) -> Iterator[KVCacheStep]:
        """Make a forward pass over rows ``slots`` write and read this cache.

        Row b of the input holds ``lengths[b]`` new tokens at positions
        ``starts[b] .. starts[b] + lengths[b] - 1`` of slot ``slots[b]``; the rest of the row is
        padding whose outputs are meaningless.
        """
        if int((starts + lengths).max()) > self.max_seq_len:
            raise ValueError(f"a request would exceed the KV cache length {self.max_seq_len}")
        self.zero_slots_below(int(slots.max()) + 1)
        self.zero_positions_below(int((starts + lengths).max()))
        with attention_step(KVCacheStep(self, slots, starts, lengths)) as step:
            yield step


class KVCacheStep:
    """One forward pass's view of the cache: which slots, from which offsets, how many tokens."""

    def __init__(
        self, cache: KVCache, slots: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor
    ) -> None:
        self.cache = cache
        self.slots = slots  # (B,)
        self.lengths = lengths  # (B,)
        width = int(lengths.max())
        offsets = torch.arange(width, device=slots.device)
        self.positions = starts[:, None] + offsets[None, :]  # (B, T)
        self.valid = offsets[None, :] < lengths[:, None]  # (B, T)
        self.context_len = int((starts + lengths).max())
        keys = torch.arange(self.context_len, device=slots.device)
        self.mask = keys[None, None, :] <= self.positions[:, :, None]  # (B, T, L)
        # Fast paths (same values, fewer copies): every row full (decode steps: no boolean
        # selection of the new keys), and rows on consecutive slots (a view of the cache instead
        # of gathering each layer's keys/values).
        self.all_valid = bool((lengths == width).all())
        # Where this step's new keys/values go, shared by every layer: (N,) rows and columns.
        if self.all_valid:
            write_rows = slots[:, None].expand_as(self.positions).reshape(-1)  # (N,)
            write_cols = self.positions.reshape(-1)  # (N,)
        else:
            write_rows = slots[:, None].expand_as(self.positions)[self.valid]  # (N,)
            write_cols = self.positions[self.valid]  # (N,)
        # ... as rows of a layer's cache viewed as (slots * Hkv * S, D): (N * Hkv,), n-major
        _, _, heads, length, _ = cache.keys.shape
        head = torch.arange(heads, device=slots.device)
        self.write_index = (
            (write_rows[:, None] * heads + head) * length + write_cols[:, None]
        ).view(-1)
        first = int(slots[0])
        span = torch.arange(first, first + len(slots), device=slots.device)
        self.slot_range = (first, first + len(slots)) if torch.equal(slots, span) else None
        self._expanded_bias: tuple[tuple, torch.Tensor] | None = None  # decode_bias's

    def attend(
        self,
        layer_index: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Store this step's keys/values for layer ``layer_index`` and attend over the cache.

        query (T, B, Hq, D), key/value (T, B, Hkv, D) in megatron-core's [s, b, h, d] layout;
        returns the context (T, B, Hq * D).
        """
        seq, batch, num_heads, head_dim = query.shape
        if self.all_valid:  # (T, B, H, D) -> (B * T, H, D), the order of rows/cols
            new_k = key.transpose(0, 1).reshape(-1, *key.shape[2:])
            new_v = value.transpose(0, 1).reshape(-1, *value.shape[2:])
        else:
            new_k, new_v = key.transpose(0, 1)[self.valid], value.transpose(0, 1)[self.valid]
        k, v = self._store_and_read(layer_index, new_k, new_v)  # (B, Hkv, L, D)
        if scale is None:
            scale = head_dim**-0.5
        if seq == 1:
            out = _decode_attention(query[0], k.to(query.dtype), v.to(query.dtype), self, scale)
            return out.view(1, batch, num_heads * head_dim)
        groups = num_heads // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        q = query.permute(1, 2, 0, 3)  # (B, Hq, T, D)
        out = F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=self.mask[:, None], scale=scale
        )
        return out.permute(2, 0, 1, 3).reshape(seq, batch, num_heads * head_dim)

    def attend_packed(
        self,
        layer_index: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float | None = None,
    ) -> torch.Tensor:
        """``attend`` for a forward over this step's tokens packed without padding.

        query (N, Hq, D), key/value (N, Hkv, D): the new tokens of row 0, then row 1, ... (the
        order of ``valid``); returns the context (N, Hq * D).
        """
        count, num_heads, head_dim = query.shape
        k, v = self._store_and_read(layer_index, key, value)  # (B, Hkv, L, D)
        k, v = k.to(query.dtype), v.to(query.dtype)
        if scale is None:
            scale = head_dim**-0.5
        if self.valid.shape[1] == 1:  # one token per row: N == B
            return _decode_attention(query, k, v, self, scale).view(count, num_heads * head_dim)
        batch, width = self.valid.shape
        q = query.new_zeros(batch, width, num_heads, head_dim)
        q[self.valid] = query  # (B, T, Hq, D), rows padded to the longest
        groups = num_heads // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=self.mask[:, None], scale=scale
        )  # (B, Hq, T, D)
        return out.transpose(1, 2)[self.valid].reshape(count, num_heads * head_dim)

    def _store_and_read(
        self, layer_index: int, new_k: torch.Tensor, new_v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's new keys/values (N, Hkv, D), in ``valid`` order, to layer
        ``layer_index``; return the rows' keys/values up to ``context_len``: (B, Hkv, L, D), a view
        of the cache when the rows sit on consecutive slots."""
        cache_k = self.cache.keys[layer_index]  # (slots, Hkv, S, D)
        cache_v = self.cache.values[layer_index]
        head_dim = cache_k.shape[-1]
        rows = cache_k.view(-1, head_dim)  # (slots * Hkv * S, D)
        rows.index_copy_(0, self.write_index, new_k.reshape(-1, head_dim).to(cache_k.dtype))
        rows = cache_v.view(-1, head_dim)
        rows.index_copy_(0, self.write_index, new_v.reshape(-1, head_dim).to(cache_v.dtype))
        if self.slot_range is not None:
            first, end = self.slot_range
            return (
                cache_k[first:end, :, : self.context_len],
                cache_v[first:end, :, : self.context_len],
            )
        # index_select of the narrowed cache: the same copy as cache_k[self.slots, :, :L], 1.5-2.6x
        # faster on this CPU (14-64 scattered rows of 16-64 wide heads)
        return (
            cache_k[:, :, : self.context_len].index_select(0, self.slots),
            cache_v[:, :, : self.context_len].index_select(0, self.slots),
        )

    def decode_bias(self, kv_heads: int, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask of a one-token step, 0 where a row may attend and -inf past its end,
        repeated for each key/value head's ``groups`` query rows: (B * kv_heads, groups, L) in
        ``dtype``, made by the first layer and reused by the others."""
        key = (kv_heads, groups, dtype)
        if self._expanded_bias is None or self._expanded_bias[0] != key:
            allowed = self.mask[:, 0]  # (B, L)
            batch, length = allowed.shape
            bias = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
            bias = bias.masked_fill_(~allowed, float("-inf")).to(dtype)[:, None, None, :]
            bias = bias.expand(batch, kv_heads, groups, length)  # (B, Hkv, G, L)
            self._expanded_bias = (key, bias.reshape(batch * kv_heads, groups, length))
        return self._expanded_bias[1]


def _decode_attention(
    query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: KVCacheStep, scale: float
) -> torch.Tensor:
    """One new token per row: softmax(q k^T * scale + mask) v as two batched matmuls.

    query (B, Hq, D); k/v (B, Hkv, L, D), views of the cache; returns (B, Hq, D). The query heads
    of a key/value group (megatron-core keeps them adjacent) form the rows of one matmul, so
    grouped-query attention needs no copy of the keys. For a single query row this is several
    times faster than ``scaled_dot_product_attention``'s CPU kernel (profile of a 25M-parameter
    decode step: 15% of the step in that kernel).
    """
    batch, num_heads, head_dim = query.shape
    kv_heads, length = k.shape[1], k.shape[2]
    groups = num_heads // kv_heads
    q = query.reshape(batch * kv_heads, groups, head_dim)  # (B*Hkv, G, D)
    keys = k.reshape(batch * kv_heads, length, head_dim)  # (B*Hkv, L, D)
    values = v.reshape(batch * kv_heads, length, head_dim)
    bias = step.decode_bias(kv_heads, groups, query.dtype)  # (B*Hkv, G, L)
    scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=scale)  # (B*Hkv, G, L)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)  # float32 sums
    return torch.bmm(probs, values).view(batch, num_heads, head_dim)
