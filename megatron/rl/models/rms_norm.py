"""RMSNorm over an input of another dtype than its weight, as torch computes it, without torch's
warning.

Under the CPU tier's ``--bf16`` (``torch.autocast`` over float32 weights) the hidden states that
reach a norm are bfloat16 (megatron-core casts the residual to the layer output's dtype) while
the norm's weight stays float32. torch's ``rms_norm`` computes such a mixed-dtype call in float32
and rounds the result to the input's dtype, and warns on every call ("Mismatch dtype between
input and weight ... Cannot dispatch to fused implementation"). ``rms_norm`` makes that float32
computation explicit: the input cast to the weight's dtype, torch's fused kernel, the result
cast back. Values and gradients are bitwise those of the mixed-dtype call
(``tests/unit_tests/rl/models/test_rms_norm.py``); an input of the weight's dtype is torch's call
itself.

``with_mixed_dtype_rms_norms`` puts ``RMSNorm`` in place of every ``torch.nn.RMSNorm`` of a built
model: the layers' norms (megatron-core's ``WrappedTorchNorm``) and the block's final norm, which
megatron-core builds from its own module global rather than from the layer spec.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(module: torch.nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``module``'s RMSNorm of ``x`` (..., H), in ``x``'s dtype; float32 arithmetic for a
    bfloat16 ``x`` and a float32 weight, as torch's mixed-dtype call does."""
    weight = module.weight
    if weight is None or x.dtype == weight.dtype:
        return F.rms_norm(x, module.normalized_shape, weight, module.eps)
    y = F.rms_norm(x.to(weight.dtype), module.normalized_shape, weight, module.eps)  # (..., H)
    return y.to(x.dtype)


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` whose input may have another dtype than its weight (``rms_norm``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The norm of ``x`` (..., H) in ``x``'s dtype."""
        return rms_norm(self, x)

    @classmethod
    def holding(cls, norm: torch.nn.RMSNorm) -> RMSNorm:
        """An ``RMSNorm`` with ``norm``'s shape and epsilon holding ``norm``'s weight parameter
        itself (not a copy)."""
        ours = cls(norm.normalized_shape, norm.eps, elementwise_affine=False)
        ours.elementwise_affine = norm.elementwise_affine
        ours.weight = norm.weight
        return ours


def with_mixed_dtype_rms_norms(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with each ``torch.nn.RMSNorm`` module replaced by an ``RMSNorm`` holding the same
    weight parameter (call it before an optimizer or DDP wrapper sees the model)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.RMSNorm:
                setattr(parent, name, RMSNorm.holding(child))
    return model
