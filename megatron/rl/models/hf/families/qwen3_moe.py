"""Qwen3-MoE (``Qwen3MoeForCausalLM``, ``model_type: qwen3_moe``).

* ``config.json``: Qwen3's attention (per-head RMSNorm of queries and keys, no biases) with a
  mixture of experts in every layer: ``num_experts`` (transformers 5 writes
  ``num_local_experts``) experts of width ``moe_intermediate_size``, ``num_experts_per_tok``
  of them per token. The router takes a softmax over all experts, then the top k; with
  ``norm_topk_prob`` the k weights are renormalized to sum to 1 (megatron-core: top-k of the
  logits, softmax over the k), without it they are not (``moe_router_pre_softmax``). Only the
  all-MoE layout is supported: ``decoder_sparse_step`` other than 1 or a non-empty
  ``mlp_only_layers`` is refused. ``head_dim`` defaults to ``hidden_size /
  num_attention_heads``; ``intermediate_size`` (the width of dense layers, which this layout
  has none of) is kept as ``ffn_hidden_size``.
* Tensors: Qwen3's attention, ``mlp.gate.weight`` and ``mlp.experts.<j>.{gate,up,down}_proj``.
* Export: writes the MoE keys; the family of an architecture with experts and QK norm.
* Tiny model ``qwen3_moe``: 4 experts of width 24, top 2, ``norm_topk_prob``, untied.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from megatron.rl.models.hf.families import qwen2
from megatron.rl.models.hf.families.base import HFFamily, MoENames, TinyRecipe

if TYPE_CHECKING:
    from megatron.rl.models.architecture import GPTArchitecture


def moe_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The router: softmax before the top-k unless ``norm_topk_prob``; all layers MoE."""
    if cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError(
            f"decoder_sparse_step={cfg['decoder_sparse_step']} is not supported (only 1: every "
            "layer a mixture of experts)"
        )
    if cfg.get("mlp_only_layers"):
        raise ValueError(
            f"mlp_only_layers={cfg['mlp_only_layers']} is not supported (only []: no dense layers)"
        )
    return {"moe_router_pre_softmax": not cfg.get("norm_topk_prob", False)}


def config_keys(arch: GPTArchitecture) -> dict[str, Any]:
    """The experts, the router's normalization, the all-MoE layout, no bias, full attention."""
    return {
        "attention_bias": arch.add_bias_linear,
        "num_experts": arch.num_experts,
        "num_experts_per_tok": arch.moe_router_topk,
        "moe_intermediate_size": arch.expert_ffn_hidden_size,
        "norm_topk_prob": not arch.moe_router_pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        **qwen2.config_keys(arch),
    }


def exported_for(arch: GPTArchitecture) -> bool:
    """Experts and QK norm."""
    return arch.num_experts is not None and arch.qk_layernorm


def tiny(common: dict[str, Any]) -> dict[str, Any]:
    """4 experts of width 24, top 2, renormalized weights."""
    return {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 24,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    }


FAMILY = HFFamily(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    order=4,
    max_position_embeddings=32768,
    qk_norm=True,
    sliding_window=qwen2.sliding_window,
    config_keys=config_keys,
    exported_for=exported_for,
    tiny=(TinyRecipe("qwen3_moe", tiny, add_bos=False),),
    moe=MoENames(
        block="mlp",
        gate="gate_proj",
        up="up_proj",
        down="down_proj",
        expert_width_key="moe_intermediate_size",
        pre_softmax=(False, True),
        settings=moe_settings,
    ),
)
