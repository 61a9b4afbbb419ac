"""``recompute_layers``: a training step with every layer recomputed in the backward pass gives
the gradients of the step that keeps its activations, in float32 and under bfloat16 autocast,
and nothing changes without autograd."""

from __future__ import annotations

import pytest
import torch
from grpo_testing.models import VOCAB, tiny_gpt

from megatron.rl.models.recompute import recompute_layers

LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True)


def loss_and_grads(model, bf16: bool):
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(9)[None].expand(3, 9)
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16, cache_enabled=False):
        logits = model(ids, positions, None)
        loss = torch.log_softmax(logits.float(), -1)[..., 0].mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("bf16", [pytest.param(False, id="fp32"), pytest.param(True, id="bf16")])
def test_recomputed_layers_give_the_same_loss_and_gradients(single_rank_world, bf16):
    model = tiny_gpt(seed=3, **LLAMA).train()
    loss, grads = loss_and_grads(model, bf16)
    recompute_layers(model)
    loss_r, grads_r = loss_and_grads(model, bf16)
    assert torch.equal(loss_r, loss)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_r[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    with torch.no_grad():  # engine-style calls go straight through
        ids = torch.tensor([[1, 2, 3]])
        assert model(ids, torch.arange(3)[None], None).grad_fn is None


def test_dropout_is_refused(single_rank_world):
    model = tiny_gpt(seed=3, **LLAMA)
    model.config.hidden_dropout = 0.1
    with pytest.raises(ValueError, match="dropout"):
        recompute_layers(model)
