"""Qwen2 (``Qwen2ForCausalLM``, ``model_type: qwen2``): Qwen2 and Qwen2.5.

* ``config.json``: a bias on the q, k and v projections only, always (``add_qkv_bias``;
  ``attention_bias``/``mlp_bias`` are not read); ``max_position_embeddings`` defaults to 32768;
  ``use_sliding_window`` with ``sliding_window`` (default 4096) on the layers from
  ``max_window_layers`` (default 28) on (``sliding_window`` here, shared with Qwen3).
* Tensors: the common ones plus ``self_attn.{q,k,v}_proj.bias``.
* Export: writes ``use_sliding_window: false``; the family of an architecture with QKV bias only.
* Tiny model ``qwen2``: grouped-query attention, QKV bias, tied embeddings, rope_theta 1e6; its
  tokenizer adds no BOS.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from megatron.rl.models.hf.families.base import HFFamily, TinyRecipe

if TYPE_CHECKING:
    from megatron.rl.models.architecture import GPTArchitecture


def sliding_window(cfg: Mapping[str, Any]) -> tuple[int | None, bool]:
    """``(window, sliding)`` of a Qwen2/Qwen3 ``config.json``: a window only with
    ``use_sliding_window``, used by layers ``max_window_layers`` and above."""
    window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window") else None
    return window, cfg.get("max_window_layers", 28) < cfg["num_hidden_layers"]


def config_keys(arch: GPTArchitecture) -> dict[str, Any]:
    """Full attention on every layer."""
    return {"use_sliding_window": False, "sliding_window": None}


def exported_for(arch: GPTArchitecture) -> bool:
    """QKV bias without biases elsewhere and without QK norm."""
    return (
        arch.add_qkv_bias
        and not arch.add_bias_linear
        and not arch.qk_layernorm
        and arch.num_experts is None
    )


def tiny(common: dict[str, Any]) -> dict[str, Any]:
    """Qwen2.5's RoPE base and tied embeddings."""
    return {"rope_theta": 1e6, "tie_word_embeddings": True}


FAMILY = HFFamily(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    model_types=("qwen2",),
    order=1,
    max_position_embeddings=32768,
    qkv_bias=True,
    sliding_window=sliding_window,
    config_keys=config_keys,
    exported_for=exported_for,
    tiny=(TinyRecipe("qwen2", tiny, add_bos=False),),
)
