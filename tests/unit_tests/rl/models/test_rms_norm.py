"""``rms_norm.RMSNorm``: a bfloat16 input with a float32 weight (the CPU tier's ``--bf16``) gets
torch's mixed-dtype values and gradients bit for bit, without torch's warning; built models hold
it in place of every ``torch.nn.RMSNorm``, with the same weights."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron.rl.models.rms_norm import RMSNorm, with_mixed_dtype_rms_norms


def mixed_dtype_torch_call(norm: torch.nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """torch's own call on ``x`` of another dtype than the weight (it warns; silenced here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return F.rms_norm(x, norm.normalized_shape, norm.weight, norm.eps)


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param((9, 1, 64), id="hidden"),
        pytest.param((5, 1, 4, 16), id="qk-heads"),
        pytest.param((3, 2, 576), id="smollm2-width"),
    ],
)
def test_bf16_input_gets_torch_s_values_and_gradients_without_a_warning(shape):
    g = torch.Generator().manual_seed(0)
    ours, theirs = RMSNorm(shape[-1], eps=1e-6), torch.nn.RMSNorm(shape[-1], eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(shape[-1], generator=g) * 0.5 + 1)
        theirs.weight.copy_(ours.weight)
    x = (torch.randn(shape, generator=g) * 3).bfloat16()  # (..., H)
    grad = torch.randn(shape, generator=g).bfloat16()
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = ours(x_ours)
        y.backward(grad)
    assert [str(w.message) for w in caught] == []
    want = mixed_dtype_torch_call(theirs, x_theirs)
    want.backward(grad)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)
    assert torch.equal(x_ours.grad, x_theirs.grad)
    assert torch.equal(ours.weight.grad, theirs.weight.grad)


def test_an_input_of_the_weight_s_dtype_is_torch_s_call():
    norm = RMSNorm(32)
    x = torch.randn(4, 1, 32)  # (N, 1, H)
    assert torch.equal(norm(x), F.rms_norm(x, (32,), norm.weight, norm.eps))


def test_a_built_model_s_rms_norms_are_ours_holding_the_same_weights():
    model = torch.nn.Sequential(
        torch.nn.RMSNorm(8, eps=1e-6),
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.RMSNorm(8)),
        torch.nn.LayerNorm(8),
    )
    weights = [model[0].weight, model[1][1].weight]
    assert with_mixed_dtype_rms_norms(model) is model
    assert type(model[0]) is RMSNorm and type(model[1][1]) is RMSNorm
    assert type(model[2]) is torch.nn.LayerNorm and model[0].eps == 1e-6
    assert [model[0].weight, model[1][1].weight] == weights  # the same parameters
    assert [p for p in model.parameters()][0] is weights[0]
