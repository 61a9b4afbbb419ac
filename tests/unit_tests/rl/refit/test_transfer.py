"""Non-collocated refit over a gloo bridge: training ranks on one tensor-parallel layout send
their weights to inference ranks on another; full and delta refits give the same bits, a delta
sends only the changed blocks or elements, and the receiver's checksum names a tensor that went
wrong."""

from __future__ import annotations

import dataclasses
import datetime

import pytest
import torch
import torch.distributed as dist
from grpo_testing.distributed import run_on_ranks
from grpo_testing.models import LLAMA_LIKE, VOCAB, logits_of, model_build, tiny_args
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron.rl.refit.bridge import Bridge
from megatron.rl.refit.transfer import BLOCK, WeightReceiver, WeightSender
from megatron.trainer.model.provider import build_model

LAYOUTS = {"tp2-to-tp1": ([0, 1], [2]), "tp1-to-tp2": ([0], [1, 2])}
"""Training ranks and inference ranks of a 3-rank world."""
FC1 = "decoder.layers.1.mlp.linear_fc1.weight"


def _model(tp: int, group: dist.ProcessGroup, seed: int) -> torch.nn.Module:
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    pg_collection.tp = group
    spec = dataclasses.replace(
        model_build(tiny_args(tensor_model_parallel_size=tp, **LLAMA_LIKE)), tensor_parallel=tp
    )
    torch.manual_seed(seed)
    return build_model(spec, VOCAB, torch.device("cpu"), True, pg_collection)


def transfer_on_rank(rank: int, world: int, layout: str) -> dict:
    """Four refits (full; a delta after one tensor changed; one after every 97th element of
    every tensor changed; one after nothing changed, into a corrupted receiver) and what each
    side saw."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    training, inference = LAYOUTS[layout]
    groups = {"training": dist.new_group(training), "inference": dist.new_group(inference)}
    side = "training" if rank in training else "inference"
    members = [training[0], *inference]
    bridge = None
    if rank in members:
        store = dist.distributed_c10d._get_default_store()
        bridge = Bridge(store, members.index(rank), len(members), datetime.timedelta(seconds=60))
    ranks = training if side == "training" else inference
    model = _model(len(ranks), groups[side], seed=7 if side == "training" else 99)
    out: dict = {"side": side}
    if side == "training":
        sender = WeightSender(model, True, groups[side], bridge, delta=True, verify=True)
        with torch.no_grad():
            for p in model.parameters():  # not the initial weights: as after a few steps
                p.add_(0.01 * torch.randn_like(p))
        out["full"] = sender.send(version=3)
        with torch.no_grad():  # one step that changed one tensor only
            dict(model.named_parameters())[FC1].mul_(1.5)
        out["delta"] = sender.send(version=4)
        with torch.no_grad():  # scattered changes: the changed elements travel, not blocks
            for p in model.parameters():
                p.view(-1)[::97].add_(1e-3)
        out["scattered"] = sender.send(version=5)
        out["logits"] = logits_of(model, groups[side])
        out["unchanged"] = sender.send(version=6)
    else:
        receiver = WeightReceiver(model, True, groups[side], bridge)
        out["full"] = receiver.receive()
        out["delta"] = receiver.receive()
        out["scattered"] = receiver.receive()
        out["logits"] = logits_of(model, groups[side])
        with torch.no_grad():  # a receiver whose kept copy went wrong: the delta skips it
            receiver._wholes[FC1][:BLOCK].add_(1.0)
        out["unchanged"] = receiver.receive()
    return out


@pytest.mark.parametrize("layout", [pytest.param(k, id=k) for k in LAYOUTS])
def test_the_inference_ranks_get_the_trained_weights_full_or_delta(layout):
    ranks = run_on_ranks(transfer_on_rank, 3, layout)
    training, inference = LAYOUTS[layout]
    sender, receivers = ranks[training[0]], [ranks[r] for r in inference]
    for r in receivers:
        assert r["full"] == (3, [])  # version 3, every checksum matched
        assert r["delta"] == (4, []) and r["scattered"] == (5, [])
        assert r["unchanged"] == (6, [FC1])  # the corrupted copy is named
    for r in receivers:  # at version 5 the inference layout computes the trained logits
        torch.testing.assert_close(r["logits"], sender["logits"], rtol=0, atol=2e-5)
    full, delta, unchanged = sender["full"], sender["delta"], sender["unchanged"]
    assert full.changed == 1.0 and full.unchanged_bf16 == 0.0
    assert 0.0 < delta.changed < 0.25  # one tensor of the model (21% of it), in blocks
    assert delta.bytes_sent < full.bytes_sent / 4
    scattered = sender["scattered"]  # 1 element in 97 (small tensors: 1 or 2): 8 bytes each
    assert 0.01 < scattered.changed < 0.012 and scattered.bytes_sent < full.bytes_sent / 40
    assert unchanged.changed == 0.0 and unchanged.unchanged_bf16 == 1.0
    assert unchanged.bytes_sent == 0
