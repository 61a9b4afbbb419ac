"""Resharding between tensor-parallel layouts, by hand (``megatron/rl/refit/tensor_parallel.py``)."""

from __future__ import annotations

import pytest
import torch

from megatron.rl.refit.tensor_parallel import ShardSpec, shard, whole

A = torch.arange(8.0).reshape(4, 2)  # rows 0..3, two columns


@pytest.mark.parametrize(
    "spec, parts, expected",
    [
        pytest.param(ShardSpec(None), [A, A], A, id="replicated"),
        pytest.param(ShardSpec(0), [A[:2], A[2:]], A, id="rows"),
        pytest.param(ShardSpec(1), [A[:, :1], A[:, 1:]], A, id="columns"),
        # rank r holds [gate_r; up_r]: gate = rows 0-1, up = rows 2-3 of the TP=1 tensor
        pytest.param(ShardSpec(0, gated=True), [A[[0, 2]], A[[1, 3]]], A, id="gated"),
    ],
)
def test_shards_of_every_rank_make_the_tp1_tensor(spec, parts, expected):
    assert torch.equal(whole(parts, spec), expected)
    for rank, part in enumerate(parts):
        assert torch.equal(shard(expected, spec, rank, len(parts)), part)


def test_tp4_to_tp2_through_the_whole_tensor_is_bitwise():
    full = torch.randn(16, 3)
    spec = ShardSpec(0, gated=True)
    tp4 = [shard(full, spec, r, 4) for r in range(4)]
    tp2 = [shard(whole(tp4, spec), spec, r, 2) for r in range(2)]
    assert torch.equal(whole(tp2, spec), full)
    assert torch.equal(tp2[0], torch.cat([full[0:4], full[8:12]]))  # gate and up halves of rank 0


def test_a_split_that_does_not_divide_is_refused_with_the_shape():
    with pytest.raises(ValueError, match=r"shape \[6, 2\] cannot be split over 4"):
        shard(torch.zeros(6, 2), ShardSpec(0), 0, 4)
