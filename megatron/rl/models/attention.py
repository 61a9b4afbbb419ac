"""A device-agnostic core attention for megatron-core's ``SelfAttention``.

megatron-core's local ``DotProductAttention`` takes its score buffer from a CUDA-only global
memory pool, so it cannot run on CPU. This module has the same constructor and forward signature
(it is plugged into the layer spec as ``core_attention``) and computes attention with
``torch.nn.functional.scaled_dot_product_attention``. During cached inference it defers to the
active cached-attention step (``attention_step``; the CPU inference backend's ``KVCacheStep``,
``megatron/rl/inference/cpu/kv_cache.py``, installs one for each forward pass of an engine step);
otherwise it is causal self-attention over the input, which is what training needs (sequences are
right-padded, so causality masks padding).
An explicit ``attention_mask`` (megatron-core's boolean convention, ``True`` = masked out) replaces
the causal mask: sequence packing passes a block-diagonal causal mask so that packed sequences
never attend to each other (``megatron/rl/grpo/packing.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Protocol, TypeVar

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class AttentionStep(Protocol):
    """What the core attention defers to during cached inference: it stores the layer's new keys
    and values and attends over the cached ones."""

    def attend(
        self,
        layer_index: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float | None = None,
    ) -> torch.Tensor:
        """query (s, b, hq, d), key/value (s, b, hkv, d) -> context (s, b, hq * d)."""
        ...


StepT = TypeVar("StepT", bound=AttentionStep)

_ACTIVE_STEP: contextvars.ContextVar[AttentionStep | None] = contextvars.ContextVar(
    "megatron_rl_active_kv_cache_step", default=None
)


def active_kv_cache_step() -> AttentionStep | None:
    """The cached-attention step of the forward pass in progress, or None outside cached
    inference."""
    return _ACTIVE_STEP.get()


@contextlib.contextmanager
def attention_step(step: StepT) -> Iterator[StepT]:
    """Make every ``SDPACoreAttention`` of the forward passes inside the block defer to ``step``."""
    token = _ACTIVE_STEP.set(step)
    try:
        yield step
    finally:
        _ACTIVE_STEP.reset(token)


class SDPACoreAttention(MegatronModule):
    """Causal scaled-dot-product attention over [s, b, h, d] inputs, KV-cache aware."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention does not support context parallelism")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPACoreAttention supports causal masks only, got {attn_mask_type}")
        self.layer_index = max(1, layer_number) - 1
        self.softmax_scale = softmax_scale
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError("SDPACoreAttention does not implement attention dropout; set it to 0")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """query (s, b, hq, d), key/value (s, b, hkv, d) -> context (s, b, hq * d)."""
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError(
                "SDPACoreAttention supports neither attention_bias nor packed sequences"
            )
        step = active_kv_cache_step()
        if step is not None:
            return step.attend(self.layer_index, query, key, value, scale=self.softmax_scale)
        seq, batch, num_heads, head_dim = query.shape
        groups = num_heads // key.shape[2]
        if groups > 1:
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (b, h, s, d)
        if attention_mask is None:
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                is_causal=True,
                scale=self.softmax_scale,
            )
        else:  # packed sequences: megatron-core's bool mask (b|1, 1, s, s), True = masked out
            allowed = ~attention_mask.to(device=q.device, dtype=torch.bool)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, scale=self.softmax_scale
            )
        return out.permute(2, 0, 1, 3).reshape(seq, batch, num_heads * head_dim)
