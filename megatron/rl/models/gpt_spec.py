"""GPT layer specs: the structure is fixed here, a backend supplies the implementations.

``gpt_layer_spec(backend)`` describes a dense pre-norm transformer layer with megatron-core's
``ModuleSpec``. ``SDPASpecProvider`` is megatron-core's local backend with the device-agnostic,
KV-cache-aware core attention swapped in; it runs on CPU (gloo) and CUDA. A Transformer Engine
backend (megatron-core's ``TESpecProvider``) plugs into the same function on CUDA.
"""

from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron.rl.models.attention import SDPACoreAttention


class SDPASpecProvider(LocalSpecProvider):
    """megatron-core's local modules, with ``SDPACoreAttention`` as the core attention."""

    def core_attention(self) -> type:
        """Which module computes softmax(QK^T)V."""
        return SDPACoreAttention


def gpt_layer_spec(backend: BackendSpecProvider, qk_layernorm: bool = False) -> ModuleSpec:
    """A dense GPT layer (self-attention + MLP, pre-norm) built from ``backend``'s modules."""
    fused = backend.fuse_layernorm_and_linear()
    layer_norm = backend.layer_norm(rms_norm=False, for_qk=False)
    qk_norm = backend.layer_norm(rms_norm=False, for_qk=True) if qk_layernorm else IdentityOp
    qkv = backend.column_parallel_layer_norm_linear() if fused else backend.column_parallel_linear()
    fc1 = backend.column_parallel_layer_norm_linear() if fused else backend.column_parallel_linear()
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp if fused else layer_norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=qkv,
                    core_attention=backend.core_attention(),
                    linear_proj=backend.row_parallel_linear(),
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=IdentityOp if fused else layer_norm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(linear_fc1=fc1, linear_fc2=backend.row_parallel_linear()),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )
