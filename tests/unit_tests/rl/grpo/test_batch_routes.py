"""The engine's recorded routes in a ``TrainBatch``: (B, T, L * k) int16 aligned with the inputs,
-1 where nothing was recorded; sliced and packed with the rows; through the keyed data plane."""

from __future__ import annotations

import pytest
import torch
from grpo_testing.batches import GRPO, build_train_batch
from test_batch import group, placeholder, rollout

from megatron.rl.dataplane import make_data_plane
from megatron.rl.dataplane.batches import publish_groups, shard_batch
from megatron.rl.grpo.batch import batch_advantages
from megatron.rl.grpo.packing import pack_sequences
from megatron.trainer.train.forward import model_inputs


def routed(prompt: list[int], completion: list[int], first_expert: int):
    """A rollout whose input position i records experts (first_expert + i, 100 + i) in one
    layer and (7, 8) in another: L * k = 4 per position."""
    r = rollout(prompt, completion, 1.0)
    inputs = len(prompt) + len(completion) - 1
    routes = [[first_expert + i, 100 + i, 7, 8] for i in range(inputs)]
    return r.model_copy(update={"routed_experts": routes})


def test_routes_sit_on_input_positions_with_minus_one_elsewhere():
    batch = build_train_batch(
        [group(0, [routed([1, 2], [3, 4, 5], 10), rollout([1], [2], 0.0), placeholder()])], 0
    )
    routes = batch.routed_experts
    assert routes.shape == (3, 4, 4) and routes.dtype == torch.int16
    assert routes[0].tolist() == [
        [10, 100, 7, 8],
        [11, 101, 7, 8],
        [12, 102, 7, 8],
        [13, 103, 7, 8],
    ]
    assert (routes[1] == -1).all() and (routes[2] == -1).all()  # no record, placeholder


def test_a_batch_without_records_has_none():
    assert build_train_batch([group(0, [rollout([1], [2, 3], 1.0)])], 0).routed_experts is None


def test_rows_and_select_keep_the_routes_of_their_rows():
    rollouts = [routed([1], [2, 3, 4], 0), routed([1], [2], 50)]
    batch = build_train_batch([group(0, rollouts)], 0)
    assert batch.rows(1, 2).routed_experts.tolist() == [[[50, 100, 7, 8]]]  # trimmed width 1
    picked = batch.select(torch.tensor([1, 0]))
    assert torch.equal(picked.routed_experts, batch.routed_experts.flip(0))


def test_routes_of_different_sizes_are_refused():
    a = routed([1], [2, 3], 0)
    b = rollout([1], [2, 3], 1.0).model_copy(update={"routed_experts": [[1, 2], [3, 4]]})
    with pytest.raises(ValueError, match="routes of different sizes per token"):
        build_train_batch([group(0, [a, b])], 0)


def test_packed_inputs_carry_the_routes_to_the_packed_tokens():
    batch = build_train_batch([group(0, [routed([1], [2, 3], 0), routed([1], [2], 40)])], 0)
    inputs = model_inputs(batch, torch.device("cpu"), packing_capacity=4)
    layout = pack_sequences(batch.lengths, 4)
    assert inputs.routes.shape == (layout.num_rows, layout.width, 4)
    unpacked = layout.unpack(inputs.routes, 2)  # positions without a token read 0
    real = torch.arange(2)[None, :] < batch.lengths[:, None]  # (b, t)
    assert torch.equal(unpacked[real], batch.routed_experts[real])
    assert inputs.routes[0, :3, 0].tolist() == [0, 1, 40]  # both sequences in one packed row


def test_routes_travel_through_the_data_plane():
    groups = [group(0, [routed([1, 2], [3, 4], 5), rollout([1], [2, 3, 4], 0.0)])]
    plane = make_data_plane("in-process", 0, 1, torch.device("cpu"))
    meta = publish_groups(plane, groups, step=0, advantages=batch_advantages(groups, GRPO))
    shard = shard_batch(plane, meta, rows=[0, 1], mine=[0, 1], pad_id=0)
    assert torch.equal(shard.routed_experts, build_train_batch(groups, 0).routed_experts)


def test_a_batch_without_records_publishes_no_routes_field():
    plane = make_data_plane("in-process", 0, 1, torch.device("cpu"))
    groups = [group(0, [rollout([1], [2, 3], 1.0)])]
    meta = publish_groups(plane, groups, step=0, advantages=batch_advantages(groups, GRPO))
    assert "routed_experts" not in meta.fields and "inference_logprobs" in meta.fields
    assert shard_batch(plane, meta, rows=[0], mine=[0], pad_id=0).routed_experts is None
