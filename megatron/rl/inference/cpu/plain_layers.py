"""Which models the CPU engine's plain-torch forward (``cached_forward.py``) reproduces, and the
modules of each layer it reads.

``plain_layers(model)`` returns the layers' parameter-holding modules where the plain program
computes what the model's own forward does, None otherwise (pipeline or sequence parallelism,
fused or Transformer Engine modules, MoE, fewer query groups than TP ranks, mixed-dtype
residuals, multi-latent attention...).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.identity_op import IdentityOp

from megatron.rl.models.gpt_spec import SDPAColumnParallelLinear, SDPARowParallelLinear

NORMS = (torch.nn.LayerNorm, torch.nn.RMSNorm)

CONFIG_REQUIREMENTS = {
    "sequence_parallel": False,
    "fp32_residual_connection": False,
    "apply_rope_fusion": False,
    "rotary_interleaved": False,
    "multi_latent_attention": False,
    "bias_activation_fusion": False,
    "use_te_activation_func": False,
    "attention_output_gate": False,
    "activation_func_clamp_value": None,
    "num_moe_experts": None,
    "context_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
}
"""TransformerConfig values the plain program assumes (anything else: the model's own forward)."""


@dataclass(frozen=True)
class PlainLayer:
    """The modules of one transformer layer that hold parameters (None: absent)."""

    input_norm: torch.nn.Module
    qkv: torch.nn.Module
    q_norm: torch.nn.Module | None
    k_norm: torch.nn.Module | None
    proj: torch.nn.Module
    pre_mlp_norm: torch.nn.Module
    fc1: torch.nn.Module
    fc2: torch.nn.Module


def plain_layers(model: torch.nn.Module, tp_group=None) -> list[PlainLayer] | None:
    """The modules of each of ``model``'s layers, or None where the plain program would not
    compute the same values as the model's forward on ``tp_group``."""
    c = getattr(model, "config", None)
    if c is None or not all(hasattr(model, a) for a in ("embedding", "decoder")):
        return None
    for name, value in CONFIG_REQUIREMENTS.items():
        if getattr(c, name, value) != value:
            return None
    if getattr(model, "mtp_process", False) or not getattr(model, "post_process", True):
        return None
    kind = getattr(model, "position_embedding_type", None)
    if kind not in ("rope", "learned_absolute"):
        return None
    if kind == "rope" and not hasattr(model.rotary_pos_emb, "at_positions"):
        return None  # megatron-core's own GPTModel ignores per-row positions
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    if c.num_query_groups is None or c.num_query_groups < tp:
        return None
    if c.activation_func not in (F.gelu, F.silu) or c.num_layers_in_first_pipeline_stage:
        return None
    final_norm = getattr(model.decoder, "final_layernorm", None)
    if not isinstance(final_norm, NORMS) or not _plain_column(model.output_layer):
        return None
    layers = [_layer_modules(layer) for layer in model.decoder.layers]
    if any(layer is None for layer in layers):
        return None
    return layers


def _plain_column(module) -> bool:
    """A local column-parallel linear layer whose forward is ``input @ weight.T`` (+ bias).

    megatron-core's own ``ColumnParallelLinear`` computes that too (GPTModel's output layer is
    one); its subclasses from other backends (Transformer Engine) do not qualify.
    """
    return (
        type(module) in (SDPAColumnParallelLinear, ColumnParallelLinear)
        and not module.gather_output
        and not getattr(module, "sequence_parallel", False)
    )


def _plain_row(module) -> bool:
    """A local row-parallel linear layer: ``input @ weight.T`` summed over TP (+ bias)."""
    return isinstance(module, SDPARowParallelLinear) and not getattr(
        module, "sequence_parallel", False
    )


def _norm_or_none(module) -> torch.nn.Module | None | bool:
    """A norm module, None for megatron-core's identity, False for anything else."""
    if isinstance(module, IdentityOp) or module is None:
        return None
    return module if isinstance(module, NORMS) else False


def _layer_modules(layer: torch.nn.Module) -> PlainLayer | None:
    """The parameter-holding modules of a layer this program reproduces, or None."""
    attention, mlp = getattr(layer, "self_attention", None), getattr(layer, "mlp", None)
    if attention is None or mlp is None or not hasattr(mlp, "linear_fc1"):
        return None
    from megatron.rl.models.attention import SDPACoreAttention

    if not isinstance(attention.core_attention, SDPACoreAttention):
        return None
    norms = [_norm_or_none(getattr(attention, n, None)) for n in ("q_layernorm", "k_layernorm")]
    main = [
        _norm_or_none(getattr(layer, n, None)) for n in ("input_layernorm", "pre_mlp_layernorm")
    ]
    if any(n is False for n in norms) or any(not isinstance(n, NORMS) for n in main):
        return None
    column = (attention.linear_qkv, mlp.linear_fc1)
    row = (attention.linear_proj, mlp.linear_fc2)
    if not all(_plain_column(m) for m in column):
        return None
    if not all(_plain_row(m) for m in row):
        return None
    return PlainLayer(
        input_norm=main[0],
        qkv=attention.linear_qkv,
        q_norm=norms[0],
        k_norm=norms[1],
        proj=attention.linear_proj,
        pre_mlp_norm=main[1],
        fc1=mlp.linear_fc1,
        fc2=mlp.linear_fc2,
    )
