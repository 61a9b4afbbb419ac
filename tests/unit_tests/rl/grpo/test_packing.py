"""Sequence packing: the layout by hand, the isolation mask, and packed == unpacked outputs."""

from __future__ import annotations

import pytest
import torch
from grpo_testing.models import VOCAB, tiny_gpt

from megatron.rl.grpo.packing import pack_sequences

pytestmark = pytest.mark.usefixtures("single_rank_world")


def test_first_fit_decreasing_layout():
    # lengths 3, 5, 2, 0, 4 into rows of 6: 5 -> row 0; 4 -> row 1; 3 -> row 2; 2 -> row 1
    layout = pack_sequences(torch.tensor([3, 5, 2, 0, 4]), capacity=6)
    assert layout.row.tolist() == [2, 0, 1, -1, 1]
    assert layout.offset.tolist() == [0, 0, 4, 0, 0]
    assert (layout.num_rows, layout.width) == (3, 6)
    assert layout.position_ids.tolist() == [
        [0, 1, 2, 3, 4, 0],
        [0, 1, 2, 3, 0, 1],
        [0, 1, 2, 0, 0, 0],
    ]
    assert layout.segment_ids.tolist() == [
        [1, 1, 1, 1, 1, -1],
        [4, 4, 4, 4, 2, 2],
        [0, 0, 0, -3, -3, -3],
    ]


def test_mask_is_block_diagonal_and_causal():
    # lengths 2, 3, 4 into rows of 6: row 0 = [seq 2 (4 tokens)][seq 0 (2)], row 1 = [seq 1][pad]
    layout = pack_sequences(torch.tensor([2, 3, 4]), capacity=6)
    allowed = (~layout.attention_mask())[:, 0].int().tolist()
    assert allowed[0] == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1, 1],
    ]
    assert allowed[1] == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],  # the trailing padding is a block of its own: never an empty row
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 1, 1, 1],
    ]


def test_pack_unpack_round_trip_and_gradient():
    lengths = torch.tensor([3, 1, 4])
    x = torch.arange(12.0).view(3, 4).requires_grad_()
    layout = pack_sequences(lengths, capacity=5)
    packed = layout.pack(x)
    assert packed.shape == (2, 5)
    back = layout.unpack(packed, 4)
    real = torch.arange(4)[None, :] < lengths[:, None]
    assert torch.equal(back[real], x.detach()[real]) and torch.all(back[~real] == 0)
    back.sum().backward()
    assert torch.equal(x.grad, real.float())


@pytest.mark.parametrize(
    "lengths, capacity",
    [
        pytest.param([5, 9, 3, 12, 7, 1], 16, id="mixed-lengths"),
        pytest.param([4, 4, 4, 4], 8, id="two-per-row"),
        pytest.param([10, 0, 2], 32, id="with-empty-row"),
    ],
)
def test_model_outputs_match_unpacked(lengths, capacity):
    model = tiny_gpt(seed=0)
    model.eval()
    lengths_t = torch.tensor(lengths)
    width = max(lengths)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (len(lengths), width), generator=g)
    ids[torch.arange(width)[None, :] >= lengths_t[:, None]] = 0
    positions = torch.arange(width)[None, :].expand_as(ids)
    with torch.no_grad():
        unpacked = model(ids, positions, None)  # (B, T, V)
        layout = pack_sequences(lengths_t, capacity)
        packed = model(layout.pack(ids), layout.position_ids, layout.attention_mask())
        back = layout.unpack(packed, width)
    real = torch.arange(width)[None, :] < lengths_t[:, None]
    torch.testing.assert_close(back[real], unpacked[real], atol=1e-5, rtol=1e-5)
