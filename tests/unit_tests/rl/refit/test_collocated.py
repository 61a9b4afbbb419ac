"""Collocated refit over gloo: a model trained on one tensor-parallel layout copied into an
inference copy on another gives the same logits, and at the same layout the same bits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from grpo_testing.distributed import run_on_ranks
from grpo_testing.models import LLAMA_LIKE, VOCAB, logits_of, model_build, tiny_args, tiny_gpt
from megatron.core import parallel_state

from megatron.rl.refit.collocated import CollocatedRefit
from megatron.rl.refit.layout import inference_layout
from megatron.trainer.model.provider import build_model


def refit_on_rank(rank: int, world: int, train_tp: int) -> dict[int, dict]:
    """Copies of a TP=``train_tp`` model at inference TP 1 and 2; what each gave, by TP."""
    trained = tiny_gpt(tp=train_tp, seed=7, **LLAMA_LIKE)
    with torch.no_grad():  # not the initial weights: as after some optimizer steps
        for p in trained.parameters():
            p.add_(0.01 * torch.randn_like(p))
    train_group = parallel_state.get_tensor_model_parallel_group()
    spec = model_build(tiny_args(tensor_model_parallel_size=train_tp, **LLAMA_LIKE))
    out = {}
    for infer_tp in (1, 2):
        layout = inference_layout(infer_tp)
        spec_ = dataclasses.replace(spec, tensor_parallel=infer_tp)
        copy = build_model(spec_, VOCAB, torch.device("cpu"), False, layout.pg_collection)
        refit = CollocatedRefit(trained, copy, train_group, layout.tp_group, True)
        stats = refit()
        verified = refit.mismatches()
        same = all(torch.equal(a, b) for a, b in zip(trained.parameters(), copy.parameters()))
        copy_logits = logits_of(copy, layout.tp_group)
        trained_logits = logits_of(trained, train_group)
        again = refit().unchanged_bf16  # nothing trained since: every element unchanged
        fc1 = dict(copy.named_parameters())["decoder.layers.1.mlp.linear_fc1.weight"]
        with torch.no_grad():  # the gate and up halves of one rank's shard swapped
            fc1.copy_(torch.cat(fc1.chunk(2)[::-1]))
        swapped = refit.mismatches()
        out[infer_tp] = dict(
            trained=trained_logits,
            copy=copy_logits,
            received=stats.bytes_received,
            written=stats.bytes_written,
            bitwise_same=same,
            replica=(layout.dp_rank, layout.dp_size),
            verified=verified,
            swapped=swapped,
            again=again,
        )
    return out


@pytest.mark.parametrize("train_tp", [pytest.param(2, id="trained-tp2"), pytest.param(1, id="dp2")])
def test_the_inference_copy_computes_the_trained_models_logits(train_tp):
    """Inference TP 1 and 2 from each training layout: the same layout copies each rank's own
    shard (the same bits, nothing sent); another layout gathers the other rank's halves."""
    ranks = run_on_ranks(refit_on_rank, 2, train_tp)
    for infer_tp in (1, 2):
        got = [r[infer_tp] for r in ranks]
        for g in got:
            torch.testing.assert_close(g["copy"], g["trained"], rtol=0, atol=2e-5)
            assert g["written"] > 0
        assert [g["replica"] for g in got] == [(i // infer_tp, 2 // infer_tp) for i in range(2)]
        # --rl-verify-model-weights-swap: silent after a right refit, names a moved value
        assert all(g["verified"] == [] and g["again"] == 1.0 for g in got)
        assert all(g["swapped"] == ["decoder.layers.1.mlp.linear_fc1.weight"] for g in got)
        if train_tp == infer_tp:
            assert all(g["bitwise_same"] and g["received"] == 0 for g in got)
        elif train_tp == 2:  # every split tensor's other half came from the other rank
            assert all(0 < g["received"] < g["written"] for g in got)
        else:  # TP=1 -> 2: each rank cuts its shard out of its own whole weights
            assert all(g["received"] == 0 and not g["bitwise_same"] for g in got)
