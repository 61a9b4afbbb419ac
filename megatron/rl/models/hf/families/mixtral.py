"""Mixtral (``MixtralForCausalLM``, ``model_type: mixtral``).

* ``config.json``: Mistral's attention without biases, a mixture of experts in every layer:
  ``num_local_experts`` experts of width ``intermediate_size``, ``num_experts_per_tok`` per
  token; the router takes the top k of its logits and a softmax over those k (megatron-core's
  default, ``moe_router_pre_softmax`` off). ``router_jitter_noise`` (noise on the router input
  while transformers trains) other than 0 is refused. ``sliding_window`` defaults to none; a
  window shorter than ``max_position_embeddings`` is refused as for Mistral.
* Tensors: the common attention ones, ``block_sparse_moe.gate.weight`` and
  ``block_sparse_moe.experts.<j>.{w1,w3,w2}.weight`` (gate, up, down).
* Export: writes the MoE keys and ``sliding_window: null``; the family of an architecture with
  experts and without QK norm.
* Tiny model ``mixtral``: 4 experts, top 2, grouped-query attention; its tokenizer adds BOS.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from megatron.rl.models.hf.families.base import HFFamily, MoENames, TinyRecipe

if TYPE_CHECKING:
    from megatron.rl.models.architecture import GPTArchitecture


def sliding_window(cfg: Mapping[str, Any]) -> tuple[int | None, bool]:
    """Every layer slides over ``sliding_window`` keys when it is set (default: none)."""
    return cfg.get("sliding_window"), True


def moe_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Top-k of the logits, softmax over the k; no router jitter."""
    if cfg.get("router_jitter_noise") or 0.0:
        raise ValueError(
            f"router_jitter_noise={cfg['router_jitter_noise']} is not supported (only 0)"
        )
    return {"moe_router_pre_softmax": False}


def config_keys(arch: GPTArchitecture) -> dict[str, Any]:
    """The experts (``intermediate_size`` is an expert's width), full attention."""
    return {
        "num_local_experts": arch.num_experts,
        "num_experts_per_tok": arch.moe_router_topk,
        "intermediate_size": arch.expert_ffn_hidden_size,
        "router_jitter_noise": 0.0,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "sliding_window": None,
    }


def exported_for(arch: GPTArchitecture) -> bool:
    """Experts without QK norm, with the softmax after the top-k."""
    return arch.num_experts is not None and not arch.qk_layernorm


def tiny(common: dict[str, Any]) -> dict[str, Any]:
    """4 experts, top 2."""
    return {"num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False}


FAMILY = HFFamily(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    order=5,
    max_position_embeddings=131072,
    sliding_window=sliding_window,
    config_keys=config_keys,
    exported_for=exported_for,
    tiny=(TinyRecipe("mixtral", tiny, add_bos=True),),
    moe=MoENames(
        block="block_sparse_moe",
        gate="w1",
        up="w3",
        down="w2",
        expert_width_key="intermediate_size",
        pre_softmax=(False,),
        settings=moe_settings,
    ),
)
