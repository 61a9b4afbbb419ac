"""Llama (``LlamaForCausalLM``, ``model_type: llama``): Llama 2, Llama 3.x, and models published
with its architecture unchanged (SmolLM2 is a ``LlamaForCausalLM``).

* ``config.json``: ``attention_bias`` and ``mlp_bias`` both true -> ``add_bias_linear`` (one alone
  is refused); ``max_position_embeddings`` defaults to 2048 (``LlamaConfig``); no sliding window.
* Tensors: the common ones, plus biases on every projection with ``add_bias_linear``.
* Export: writes ``attention_bias`` and ``mlp_bias``; the family of an architecture that no
  other family claims.
* Tiny models: ``llama`` (Llama 2 style: multi-head attention, untied output layer) and
  ``llama3`` (grouped-query attention, ``rope_type: llama3`` scaling with non-default values:
  factor 4, low 1, high 8, original context 64; tied embeddings; rope_theta 500000); both
  tokenizers add BOS.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatron.rl.models.hf.families.base import HFFamily, TinyRecipe

if TYPE_CHECKING:
    from megatron.rl.models.architecture import GPTArchitecture


def config_keys(arch: GPTArchitecture) -> dict[str, Any]:
    """Llama's bias switches: both follow ``add_bias_linear``."""
    return {"attention_bias": arch.add_bias_linear, "mlp_bias": arch.add_bias_linear}


def llama2(common: dict[str, Any]) -> dict[str, Any]:
    """Multi-head attention: as many key/value heads as query heads."""
    return {"num_key_value_heads": common["num_attention_heads"]}


def llama3(common: dict[str, Any]) -> dict[str, Any]:
    """Llama 3 RoPE scaling (non-default values, so a mistake in any shows) and tied embeddings."""
    scaling = dict(
        rope_type="llama3",
        factor=4.0,
        low_freq_factor=1.0,
        high_freq_factor=8.0,
        original_max_position_embeddings=64,
    )
    return {"rope_theta": 500000.0, "rope_scaling": scaling, "tie_word_embeddings": True}


FAMILY = HFFamily(
    name="llama",
    architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    order=0,
    max_position_embeddings=2048,
    bias_linear=True,
    config_keys=config_keys,
    export_default=True,
    tiny=(
        TinyRecipe("llama", llama2, add_bos=True),
        TinyRecipe("llama3", llama3, add_bos=True),
    ),
)
