"""RoPE at each row's own positions: ``RoPEGPTModel``, a small subclass of megatron-core's GPTModel.

megatron-core's ``GPTModel`` rotates queries and keys at positions ``0 .. T-1`` of its input
(``RotaryEmbedding.forward(seq_len)``: one (T, 1, 1, d) table shared by every row) and ignores
``position_ids``. Two callers here need other positions:

* the CPU inference engine (``megatron/rl/inference/cpu/kv_cache_runner.py`` with ``KVCache``) feeds
  rows whose new tokens start at different offsets of their requests (``positions`` (B, T));
* sequence packing (``megatron/rl/grpo/packing.py``) restarts positions at 0 for every packed
  sequence.

Choice: a model subclass, not an attention change. ``RoPEGPTModel._preprocess`` lets
megatron-core compute everything as usual and then, when the caller passed ``position_ids`` and
no ``inference_context``/``packed_seq_params``, replaces the rotary table by one gathered at the
given positions, of shape (T, B, 1, d). megatron-core's unfused ``apply_rotary_pos_emb`` (bshd)
broadcasts it against queries/keys (T, B, heads, d) unchanged, so ``SelfAttention``, the layer
spec and both core attentions (SDPA, Transformer Engine) stay megatron-core's own. Keys enter the
KV cache already rotated at their true positions, so cached decoding and packing are exact.

* Frequencies: ``freqs[t, b] = position_ids[b, t] * inv_freq`` in float32, then
  ``cat(freqs, freqs)`` (megatron-core's non-interleaved layout = Hugging Face's
  ``rotate_half``). At positions ``0 .. T-1`` this is bitwise megatron-core's table.
* Untouched: without ``position_ids``, or with an ``inference_context`` (megatron-core's
  ``DynamicInferenceEngine`` on CUDA), or with ``packed_seq_params`` (THD), megatron-core's
  own table is used. ``learned_absolute`` models never build this class.
* ``PositionalRotaryEmbedding`` also runs on CPU: megatron-core's ``RotaryEmbedding.get_emb``
  moves ``inv_freq`` to ``torch.cuda.current_device()``; on a machine without CUDA the table is
  computed where ``inv_freq`` is (same math).
* Llama-3 scaling: megatron-core's ``RotaryEmbedding(rope_scaling=True)`` passes only ``factor``
  to ``_apply_scaling`` and hard-codes ``low_freq_factor=1, high_freq_factor=4,
  original_max_position_embeddings=8192``. ``llama3_inv_freq`` implements the same formula with
  all four values (Hugging Face ``_compute_llama3_parameters``), so any Llama-3 style config is
  exact; the result replaces ``inv_freq`` before the first forward.
* Refused: ``apply_rope_fusion`` / ``fused_single_qkv_rope`` (Transformer Engine's fused RoPE
  takes a (T, 1, 1, d) table only), ``rotary_interleaved``, context parallelism with positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 RoPE frequency scaling (Hugging Face ``rope_type: llama3``)."""

    factor: float
    """Long wavelengths are divided by this (Llama 3.1: 8, Llama 3.2: 32)."""
    low_freq_factor: float
    """Wavelengths above ``original_max_position_embeddings / low_freq_factor`` are scaled."""
    high_freq_factor: float
    """Wavelengths below ``original_max_position_embeddings / high_freq_factor`` are kept."""
    original_max_position_embeddings: int
    """Context length of pre-training before the extension (Llama 3: 8192)."""


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama-3 scaled inverse frequencies: long wavelengths / factor, short kept, smooth between."""
    old_context = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(medium, smoothed, scaled)


class PositionalRotaryEmbedding(RotaryEmbedding):
    """megatron-core's ``RotaryEmbedding`` that also runs on CPU and at arbitrary positions."""

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float,
        rotary_base: float,
        llama3_scaling: RopeScaling | None = None,
        seq_len_interpolation_factor: float | None = None,
        cp_group: torch.distributed.ProcessGroup | None = None,
    ) -> None:
        super().__init__(
            kv_channels=kv_channels,
            rotary_percent=rotary_percent,
            rotary_interleaved=False,
            seq_len_interpolation_factor=seq_len_interpolation_factor,
            rotary_base=rotary_base,
            rope_scaling=False,
            use_cpu_initialization=True,
            cp_group=cp_group,
        )
        if llama3_scaling is not None:
            self.inv_freq = llama3_inv_freq(self.inv_freq, llama3_scaling)

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """(T, 1, 1, d) table of positions ``offset .. offset + T - 1`` (megatron-core's)."""
        if torch.cuda.is_available():
            return super().get_emb(max_seq_len, offset)  # moves inv_freq to the GPU once
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # (T, d/2)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]

    def at_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """position_ids (B, T) -> (T, B, 1, d) table, row b rotated at its own positions."""
        inv_freq = self.inv_freq.to(position_ids.device)
        seq = position_ids.t().to(inv_freq.dtype)  # (T, B)
        if self.seq_len_interpolation_factor is not None:
            seq = seq * (1 / self.seq_len_interpolation_factor)
        freqs = seq[:, :, None] * inv_freq  # (T, B, d/2)
        return torch.cat((freqs, freqs), dim=-1)[:, :, None, :]


class RoPEGPTModel(GPTModel):
    """megatron-core ``GPTModel`` with RoPE applied at the ``position_ids`` of each row."""

    def __init__(
        self,
        *,
        rotary_base: float = 10000,
        rotary_percent: float = 1.0,
        llama3_scaling: RopeScaling | None = None,
        seq_len_interpolation_factor: float | None = None,
        **kwargs,
    ) -> None:
        if kwargs.setdefault("position_embedding_type", "rope") != "rope":
            raise ValueError("RoPEGPTModel needs position_embedding_type='rope'")
        config = kwargs["config"]
        for flag in ("apply_rope_fusion", "fused_single_qkv_rope", "rotary_interleaved"):
            if getattr(config, flag):
                raise ValueError(f"RoPEGPTModel: TransformerConfig.{flag}=True is not supported")
        if config.multi_latent_attention:
            raise ValueError("RoPEGPTModel: multi-latent attention is not supported")
        super().__init__(
            rotary_base=rotary_base,
            rotary_percent=rotary_percent,
            seq_len_interpolation_factor=seq_len_interpolation_factor,
            **kwargs,
        )
        self.rotary_pos_emb = PositionalRotaryEmbedding(
            kv_channels=self.config.kv_channels,
            rotary_percent=rotary_percent,
            rotary_base=rotary_base,
            llama3_scaling=llama3_scaling,
            seq_len_interpolation_factor=seq_len_interpolation_factor,
            cp_group=self.pg_collection.cp,
        )

    def _preprocess(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        decoder_input: torch.Tensor | None = None,
        inference_context=None,
        packed_seq_params=None,
        padding_mask: torch.Tensor | None = None,
    ):
        """megatron-core's preprocessing; the rotary table at ``position_ids`` when they apply."""
        out = super()._preprocess(
            input_ids=input_ids,
            position_ids=position_ids,
            decoder_input=decoder_input,
            inference_context=inference_context,
            packed_seq_params=packed_seq_params,
            padding_mask=padding_mask,
        )
        if position_ids is None or inference_context is not None or packed_seq_params is not None:
            return out
        if self.pg_collection.cp is not None and self.pg_collection.cp.size() > 1:
            raise NotImplementedError("RoPEGPTModel: position_ids with context parallelism")
        table = self.rotary_pos_emb.at_positions(position_ids)  # (T, B, 1, d)
        return (out[0], table, *out[2:])
