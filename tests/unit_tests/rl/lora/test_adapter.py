"""One linear layer's adapter: its output rows in megatron-core's fused layouts, hand-computed."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.rl.lora.adapter import Layout, LinearAdapter, initial_a
from megatron.rl.lora.config import LoRAConfig

QKV = Layout("linear_qkv", (("q_proj", 2), ("k_proj", 2), ("v_proj", 2)), 3, 0, 1, query_groups=2)
"""Two query groups of one query head each, head width 1: rows [q0, k0, v0, q1, k1, v1]."""
FC1 = Layout("linear_fc1", (("gate_proj", 2), ("up_proj", 2)), 3, 0, 1)
FC2 = Layout("linear_fc2", (("down_proj", 2),), 3, 0, 1)


def adapter(layout: Layout, targets: tuple[str, ...], scale: float = 2.0) -> LinearAdapter:
    """A rank-1 adapter with A = [1, 2, 3] for every projection and B_p = [[b], [b + 1]] where
    b = 1, 3, 5 for the projections in layer order."""
    lora = LinearAdapter(layout, targets, rank=1, scale=scale, tp_group=None)
    with torch.no_grad():
        lora.lora_A.copy_(torch.tensor([[1.0, 2.0, 3.0]]).repeat(len(lora.targets), 1))
        for i, p in enumerate(lora.targets):
            lora.lora_B[p].copy_(torch.tensor([[2.0 * i + 1], [2.0 * i + 2]]))
    return lora


A = torch.tensor([1.0, 2.0, 3.0])


@pytest.mark.parametrize(
    "layout, targets, rows",
    [
        pytest.param(QKV, ("q_proj", "k_proj", "v_proj"), [1, 3, 5, 2, 4, 6], id="qkv-interleaved"),
        pytest.param(QKV, ("q_proj", "v_proj"), [1, 0, 3, 2, 0, 4], id="qkv-without-k"),
        pytest.param(FC1, ("gate_proj", "up_proj"), [1, 2, 3, 4], id="fc1-gate-then-up"),
        pytest.param(FC1, ("up_proj",), [0, 0, 1, 2], id="fc1-up-only"),
        pytest.param(FC2, ("down_proj",), [1, 2], id="row-parallel"),
    ],
)
def test_delta_weight_puts_each_projection_in_its_rows(layout, targets, rows):
    """scale * B_p A_p in megatron-core's row order; untargeted projections' rows are zero."""
    lora = adapter(layout, targets)
    expected = 2.0 * torch.tensor(rows, dtype=torch.float32)[:, None] * A[None, :]  # (out, in)
    torch.testing.assert_close(lora.delta_weight(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("layout", [QKV, FC1, FC2], ids=["qkv", "fc1", "fc2"])
def test_delta_of_an_input_is_the_input_times_the_delta_weight(layout):
    lora = adapter(layout, tuple(p for p, _ in layout.projections), scale=0.5)
    x = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(0))  # (s, b, in)
    torch.testing.assert_close(lora.delta(x), x @ lora.delta_weight().t())


def test_a_transpose_function_feeds_the_products():
    """The CPU engine passes its contiguous copies of the weights' transposes."""
    lora = adapter(QKV, ("q_proj", "k_proj", "v_proj"))
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    seen = []

    def transpose(w):
        seen.append(tuple(w.shape))
        return w.t().contiguous()

    torch.testing.assert_close(lora.delta(x, transpose), lora.delta(x))
    assert seen == [(3, 3), (2, 1), (2, 1), (2, 1)]  # stacked A (3 projections x rank 1), each B


def test_initial_a_is_seeded_per_layer_and_projection_and_sliced_by_rank():
    config = LoRAConfig(rank=4, alpha=4.0, seed=7)
    a = initial_a(config, 3, "o_proj", 64)
    assert torch.equal(a, initial_a(config, 3, "o_proj", 64))  # a function of its key alone
    assert not torch.equal(a, initial_a(config, 4, "o_proj", 64))
    assert not torch.equal(a, initial_a(config, 3, "down_proj", 64))
    assert a.abs().max() <= 1 / math.sqrt(64)  # PEFT's kaiming bound 1/sqrt(fan_in)
    state = torch.get_rng_state()
    layouts = [Layout("linear_proj", (("o_proj", 8),), 32, r, 2) for r in range(2)]
    halves = []
    for layout in layouts:  # TP=2: each rank's columns of the same A
        lora = LinearAdapter(layout, ("o_proj",), 4, 1.0, None)
        lora.reset(config, 3)
        halves.append(lora.lora_A.detach())
        assert torch.count_nonzero(lora.lora_B["o_proj"]) == 0  # B starts at zero
    assert torch.equal(torch.cat(halves, dim=1), a)
    assert torch.equal(torch.get_rng_state(), state)  # the run's random stream is untouched


def test_gaussian_init_has_std_one_over_rank():
    a = initial_a(LoRAConfig(rank=8, alpha=8.0, init="gaussian"), 0, "q_proj", 4096)
    assert abs(a.std().item() - 1 / 8) < 0.005


def test_tensor_parallel_shards_carry_megatron_cores_attributes():
    column = LinearAdapter(
        Layout("linear_fc1", (("up_proj", 4),), 8, 1, 2), ("up_proj",), 2, 1.0, None
    )
    row = LinearAdapter(
        Layout("linear_fc2", (("down_proj", 8),), 4, 1, 2), ("down_proj",), 2, 1.0, None
    )
    assert column.lora_B["up_proj"].tensor_model_parallel
    assert column.lora_B["up_proj"].partition_dim == 0
    assert not getattr(column.lora_A, "tensor_model_parallel", False)  # replicated
    assert row.lora_A.tensor_model_parallel and row.lora_A.partition_dim == 1
    assert not getattr(row.lora_B["down_proj"], "tensor_model_parallel", False)


def test_targets_must_be_projections_of_the_layer():
    with pytest.raises(ValueError, match="not among"):
        LinearAdapter(FC2, ("q_proj",), 1, 1.0, None)
