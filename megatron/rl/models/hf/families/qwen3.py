"""Qwen3 (``Qwen3ForCausalLM``, ``model_type: qwen3``).

* ``config.json``: per-head RMSNorm of queries and keys (``qk_layernorm``); ``head_dim`` may
  differ from ``hidden_size / num_attention_heads`` and defaults to 128; no biases
  (``attention_bias: true`` is refused); ``max_position_embeddings`` defaults to 32768; sliding
  windows as Qwen2's.
* Tensors: the common ones plus ``self_attn.{q,k}_norm.weight``.
* Export: writes ``attention_bias`` and ``use_sliding_window: false``; the family of an
  architecture with QK norm.
* Tiny model ``qwen3``: QK norm, ``head_dim`` 32 != hidden/heads (16), untied; its tokenizer adds
  no BOS.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatron.rl.models.hf.families import qwen2
from megatron.rl.models.hf.families.base import HFFamily, TinyRecipe

if TYPE_CHECKING:
    from megatron.rl.models.architecture import GPTArchitecture


def config_keys(arch: GPTArchitecture) -> dict[str, Any]:
    """No attention bias, full attention on every layer."""
    return {"attention_bias": arch.add_bias_linear, **qwen2.config_keys(arch)}


def exported_for(arch: GPTArchitecture) -> bool:
    """QK norm, dense MLPs."""
    return arch.qk_layernorm and arch.num_experts is None


def tiny(common: dict[str, Any]) -> dict[str, Any]:
    """A head dimension twice ``hidden_size / num_attention_heads`` (with 4 heads)."""
    return {"head_dim": 2 * common["hidden_size"] // 4}


FAMILY = HFFamily(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    order=2,
    max_position_embeddings=32768,
    head_dim=128,
    qk_norm=True,
    sliding_window=qwen2.sliding_window,
    config_keys=config_keys,
    exported_for=exported_for,
    tiny=(TinyRecipe("qwen3", tiny, add_bos=False),),
)
