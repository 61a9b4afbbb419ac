"""Per-slot KV cache of the CPU tier's row runner (``KVCacheRowRunner``).

The cache holds, for every attention layer, keys and values of shape
``(num_slots, max_seq_len, num_kv_heads, head_dim)``. A request owns one slot for its lifetime and
each slot keeps its own length, so requests at different offsets share one forward pass: that is
what megatron-core's static inference context (one offset per batch) cannot do.

A forward pass runs inside ``with cache.step(slots, starts, lengths):``; the core attention of each
layer (``megatron.rl.models.attention.SDPACoreAttention``) finds the active step and calls
``attend``. Outside a step the attention is plain causal self-attention (training).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F

_ACTIVE_STEP: contextvars.ContextVar["KVCacheStep | None"] = contextvars.ContextVar(
    "megatron_rl_active_kv_cache_step", default=None
)


def active_kv_cache_step() -> "KVCacheStep | None":
    """The cache step of the forward pass in progress, or None outside cached inference."""
    return _ACTIVE_STEP.get()


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
        shape = (num_layers, num_slots, max_seq_len, num_kv_heads, head_dim)
        # Reserved, not written: a slot is zeroed on its first use (``step``), so on the CPU only
        # the pages of slots in use become resident (the OS maps a large allocation's pages on
        # first touch) and the memory held follows the requests in flight, not ``num_slots``.
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.zeroed_slots = 0
        """Slots ``0 .. zeroed_slots - 1`` have been zeroed (the rest were never read)."""

    def zero_slots_below(self, end: int) -> None:
        """Zero slots ``zeroed_slots .. end - 1`` on their first use: the cache then reads as if
        it had been allocated with zeros."""
        if end > self.zeroed_slots:
            self.keys[:, self.zeroed_slots : end].zero_()
            self.values[:, self.zeroed_slots : end].zero_()
            self.zeroed_slots = end

    @contextlib.contextmanager
    def step(
        self, slots: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor
    ) -> Iterator["KVCacheStep"]:
        """Make a forward pass over rows ``slots`` write and read this cache.

        Row b of the input holds ``lengths[b]`` new tokens at positions
        ``starts[b] .. starts[b] + lengths[b] - 1`` of slot ``slots[b]``; the rest of the row is
        padding whose outputs are meaningless.
        """
        if int((starts + lengths).max()) > self.max_seq_len:
            raise ValueError(f"a request would exceed the KV cache length {self.max_seq_len}")
        self.zero_slots_below(int(slots.max()) + 1)
        token = _ACTIVE_STEP.set(KVCacheStep(self, slots, starts, lengths))
        try:
            yield _ACTIVE_STEP.get()
        finally:
            _ACTIVE_STEP.reset(token)


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
        # Where this step's new keys/values go, shared by every layer: (N,) rows and columns.
        self.write_rows = slots[:, None].expand_as(self.positions)[self.valid]
        self.write_cols = self.positions[self.valid]
        # Fast paths (same values, fewer copies): every row full (decode steps: no boolean
        # selection of the new keys), and rows on consecutive slots (a view of the cache instead
        # of gathering each layer's keys/values).
        self.all_valid = bool(self.valid.all())
        first = int(slots[0])
        span = torch.arange(first, first + len(slots), device=slots.device)
        self.slot_range = (first, first + len(slots)) if torch.equal(slots, span) else None

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
        rows, cols = self.write_rows, self.write_cols  # (N,), (N,)
        cache_k = self.cache.keys[layer_index]
        cache_v = self.cache.values[layer_index]
        if self.all_valid:  # (T, B, H, D) -> (B * T, H, D), the order of rows/cols
            new_k = key.transpose(0, 1).reshape(-1, *key.shape[2:])
            new_v = value.transpose(0, 1).reshape(-1, *value.shape[2:])
        else:
            new_k, new_v = key.transpose(0, 1)[self.valid], value.transpose(0, 1)[self.valid]
        cache_k[rows, cols] = new_k.to(cache_k.dtype)
        cache_v[rows, cols] = new_v.to(cache_v.dtype)

        if self.slot_range is not None:
            first, end = self.slot_range
            k = cache_k[first:end, : self.context_len].transpose(1, 2)  # (B, Hkv, L, D)
            v = cache_v[first:end, : self.context_len].transpose(1, 2)  # (B, Hkv, L, D)
        else:
            k = cache_k[self.slots, : self.context_len].transpose(1, 2)  # (B, Hkv, L, D)
            v = cache_v[self.slots, : self.context_len].transpose(1, 2)  # (B, Hkv, L, D)
        groups = num_heads // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        q = query.permute(1, 2, 0, 3)  # (B, Hq, T, D)
        out = F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=self.mask[:, None], scale=scale
        )
        return out.permute(2, 0, 1, 3).reshape(seq, batch, num_heads * head_dim)
