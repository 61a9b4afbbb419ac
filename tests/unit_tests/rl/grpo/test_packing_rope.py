"""Sequence packing with RoPE models (HF Llama-3 and Qwen3 checkpoints): packed == unpacked."""

from __future__ import annotations

import pytest
import torch
from grpo_testing.hf_models import build_hf_model

from megatron.rl.grpo.packing import pack_sequences


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
@pytest.mark.parametrize(
    "lengths, capacity",
    [
        pytest.param([5, 9, 3, 12, 7, 1], 16, id="mixed-lengths"),
        pytest.param([10, 0, 2], 32, id="with-empty-row"),
    ],
)
def test_rope_model_outputs_match_unpacked(
    family, lengths, capacity, tiny_hf_checkpoints, single_rank_world
):
    model, hf = build_hf_model(tiny_hf_checkpoints[family])
    lengths_t = torch.tensor(lengths)
    width = max(lengths)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, hf.vocab_size, (len(lengths), width), generator=g)  # (B, T)
    real = torch.arange(width)[None, :] < lengths_t[:, None]  # (B, T)
    ids[~real] = 0
    positions = torch.arange(width)[None, :].expand_as(ids)  # (B, T)
    layout = pack_sequences(lengths_t, capacity)
    assert layout.num_rows < len(lengths)  # sequences do share rows
    with torch.no_grad():
        unpacked = model(ids, positions, None)  # (B, T, V)
        packed = model(layout.pack(ids), layout.position_ids, layout.attention_mask())  # (R, S, V)
        back = layout.unpack(packed, width)  # (B, T, V)
    torch.testing.assert_close(back[real], unpacked[real], atol=1e-5, rtol=1e-5)
