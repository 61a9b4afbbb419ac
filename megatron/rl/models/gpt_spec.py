"""GPT layer specs: the structure is fixed here, a backend supplies the implementations.

``gpt_layer_spec(backend)`` describes a dense pre-norm transformer layer with megatron-core's
``ModuleSpec``. ``SDPASpecProvider`` is megatron-core's local backend with the device-agnostic,
KV-cache-aware core attention swapped in; it runs on CPU (gloo) and CUDA. A Transformer Engine
backend (megatron-core's ``TESpecProvider``) plugs into the same function on CUDA.
``select_backend`` is the one place that chooses: Transformer Engine on CUDA when it imports,
the SDPA backend otherwise (megatron-core's local modules pick Apex's fused layer norm by
themselves when Apex imports). Both backends build LayerNorm or RMSNorm, optionally with a norm of
each query/key head (``qk_layernorm``, Qwen3); with Transformer Engine the input norms are fused
into the following linear layer (``linear_qkv.layer_norm_weight``,
``linear_fc1.layer_norm_weight``), with the SDPA backend they are modules of their own
(``input_layernorm``, ``pre_mlp_layernorm``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
)
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron.rl.models.attention import SDPACoreAttention


class _NoGradMatmul:
    """Inference fast path and mixed-precision path of megatron-core's local linear layers.

    Without autograd (engine steps, ``torch.no_grad``) the layer's matrix multiply runs as the
    same ``torch.matmul(input, weight.t())`` (+ bias) that megatron-core's autograd functions
    compute in their forward, without entering those functions: their ``apply`` costs more than
    the matmul itself at small shapes (profile of an engine step: ~30% of a 1M-parameter decode
    step). The values are identical; with autograd on (training) nothing changes.

    Under CPU ``torch.autocast`` with autograd on (the CPU tier's ``--bf16``) the product also
    runs as plain differentiable ops, so autocast's casts are part of the graph and the float32
    weights receive float32 gradients: megatron-core's autograd function saves the float32
    weight and multiplies it by the bfloat16 output gradient in its backward, which fails. The
    column-parallel input gradient is all-reduced by megatron-core's own
    ``copy_to_tensor_model_parallel_region`` (what its function does when ``allreduce_dgrad``).
    """

    def _forward_impl(self, input, weight, *args, **kwargs):
        plain = not torch.is_grad_enabled() or torch.is_autocast_enabled(input.device.type)
        if not plain or kwargs.get("sequence_parallel") or args:
            return super()._forward_impl(input, weight, *args, **kwargs)
        if torch.is_grad_enabled() and kwargs.get("allreduce_dgrad"):
            input = copy_to_tensor_model_parallel_region(input, group=kwargs.get("tp_group"))
        output = torch.matmul(input, weight.t())
        bias = kwargs.get("bias")
        return output if bias is None else output + bias


class SDPAColumnParallelLinear(_NoGradMatmul, ColumnParallelLinear):
    """megatron-core's ``ColumnParallelLinear`` with the no-autograd fast path."""


class SDPARowParallelLinear(_NoGradMatmul, RowParallelLinear):
    """megatron-core's ``RowParallelLinear`` with the no-autograd fast path."""


def plain_output_layer(model: torch.nn.Module) -> torch.nn.Module:
    """Give ``model``'s output layer the SDPA backend's linear behaviour; returns ``model``.

    ``GPTModel`` builds its output layer as megatron-core's own ``ColumnParallelLinear``, not from
    the layer spec; ``SDPAColumnParallelLinear`` is that class with a different
    ``_forward_impl`` only (no state of its own), so the instance takes its class. Without it the
    output layer would be the one product that fails under CPU autocast with autograd.
    """
    layer = getattr(model, "output_layer", None)
    if type(layer) is ColumnParallelLinear:
        layer.__class__ = SDPAColumnParallelLinear
    return model


class SDPASpecProvider(LocalSpecProvider):
    """megatron-core's local modules, with ``SDPACoreAttention`` as the core attention and
    linear layers that skip megatron-core's autograd functions when autograd is off."""

    def core_attention(self) -> type:
        """Which module computes softmax(QK^T)V."""
        return SDPACoreAttention

    def column_parallel_linear(self) -> type:
        """megatron-core's column-parallel linear layer, fast without autograd."""
        return SDPAColumnParallelLinear

    def row_parallel_linear(self) -> type:
        """megatron-core's row-parallel linear layer, fast without autograd."""
        return SDPARowParallelLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        """LayerNorm: megatron-core's local choice (Apex's fused one when Apex imports, else
        ``WrappedTorchNorm``); RMSNorm: ``WrappedTorchNorm`` (``torch.nn.RMSNorm``).

        megatron-core's ``LocalSpecProvider.layer_norm(rms_norm=True)`` also rebinds its module
        global ``LNImpl`` to ``WrappedTorchNorm``, which would change every LayerNorm spec built
        afterwards; this one has no side effect.
        """
        if rms_norm:
            return WrappedTorchNorm
        return super().layer_norm(rms_norm=False, for_qk=for_qk)


@functools.cache
def transformer_engine_importable() -> bool:
    """Whether Transformer Engine's PyTorch package imports here (any import error: no)."""
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception:  # a broken install fails with OSError/RuntimeError as often as ImportError
        return False
    return True


def _te_spec_provider() -> BackendSpecProvider:
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    return TESpecProvider()


def select_backend(cuda: bool) -> BackendSpecProvider:
    """The layer backend of a tier: Transformer Engine on CUDA when it imports, else SDPA."""
    if cuda and transformer_engine_importable():
        return _te_spec_provider()
    return SDPASpecProvider()


@dataclasses.dataclass(frozen=True)
class MLPBuilder:
    """A layer's dense MLP as megatron-core 0.18+ builds it: ``MLP.as_mlp_submodule`` called by
    ``TransformerLayer`` with its config and process groups. Given a ``ModuleSpec`` of ``MLP``
    instead, those releases rewrap it into this call and log a warning at every model build."""

    submodules: MLPSubmodules
    module = MLP

    def __call__(self, **kwargs) -> MLP:
        return MLP.as_mlp_submodule(submodules=self.submodules, **kwargs)


def mlp_spec(submodules: MLPSubmodules) -> ModuleSpec | MLPBuilder:
    """The ``mlp`` of a layer spec: an ``MLPBuilder`` where megatron-core's ``MLP`` has
    ``as_mlp_submodule`` (0.18+), else the ``ModuleSpec`` (0.16, 0.17). Both have
    ``.module`` and ``.submodules``."""
    if hasattr(MLP, "as_mlp_submodule"):
        return MLPBuilder(submodules)
    return ModuleSpec(module=MLP, submodules=submodules)


def gpt_layer_spec(
    backend: BackendSpecProvider,
    qk_layernorm: bool = False,
    normalization: str = "LayerNorm",
    moe: ModuleSpec | None = None,
) -> ModuleSpec:
    """A dense GPT layer (self-attention + MLP, pre-norm) built from ``backend``'s modules.

    ``normalization`` (``LayerNorm`` or ``RMSNorm``) picks the norm modules; it must equal the
    ``TransformerConfig.normalization`` the model is built with (Transformer Engine's fused
    norm-linear modules and ``WrappedTorchNorm`` read the kind from the config). ``qk_layernorm``
    adds a norm of each query and key head (over the head dimension). ``moe``: the mixture of
    experts that replaces the dense MLP (``moe.moe_mlp_spec``; its norm is never fused).
    """
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")
    rms = normalization == "RMSNorm"
    fused = backend.fuse_layernorm_and_linear()
    layer_norm = backend.layer_norm(rms_norm=rms, for_qk=False)
    qk_norm = backend.layer_norm(rms_norm=rms, for_qk=True) if qk_layernorm else IdentityOp
    qkv = backend.column_parallel_layer_norm_linear() if fused else backend.column_parallel_linear()
    fc1 = backend.column_parallel_layer_norm_linear() if fused else backend.column_parallel_linear()
    mlp = mlp_spec(MLPSubmodules(linear_fc1=fc1, linear_fc2=backend.row_parallel_linear()))
    mlp_fused = fused and moe is None
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
            pre_mlp_layernorm=IdentityOp if mlp_fused else layer_norm,
            mlp=mlp if moe is None else moe,
            mlp_bda=get_bias_dropout_add,
        ),
    )
