"""Collocated refit over gloo: a model trained on one tensor-parallel layout copied into an
inference copy on another gives the same logits, and at the same layout the same bits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from grpo_testing.distributed import run_on_ranks
from grpo_testing.hf_models import build_hf_model, full_logits
from grpo_testing.models import LLAMA_LIKE, VOCAB, logits_of, model_build, tiny_args, tiny_gpt
from megatron.core import parallel_state

from megatron.rl.models.architecture import build_gpt_model, layer_spec, transformer_config
from megatron.rl.models.gpt_spec import SDPASpecProvider
from megatron.rl.models.hf.tiny import make_tiny_checkpoint
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


def moe_refit_on_rank(rank: int, world: int, tp: int, ep: int, checkpoint: str) -> dict[int, dict]:
    """An MoE model trained at TP ``tp`` x EP ``ep`` copied at inference TP 1 and 2 (the copy
    holds every expert); what each copy gave, by its TP."""
    trained, hf = build_hf_model(checkpoint, tp=tp, ep=ep)
    torch.manual_seed(7)  # not the checkpoint's weights: as after some optimizer steps
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01 * torch.randn_like(p))
    ids = torch.tensor([[40, 41, 42, 43, 44, 45]])
    out = {"experts": hf.arch.num_experts}
    for infer_tp in (1, 2):
        layout = inference_layout(infer_tp, alone=True)
        config = transformer_config(hf.arch, tensor_model_parallel_size=infer_tp)
        spec = layer_spec(hf.arch, SDPASpecProvider())
        copy = build_gpt_model(hf.arch, config, spec, pg_collection=layout.pg_collection).eval()
        group = parallel_state.get_tensor_model_parallel_group()
        refit = CollocatedRefit(trained, copy, group, layout.tp_group, True)
        stats = refit()
        verified = refit.mismatches()
        names = [n for n, _ in copy.named_parameters() if ".local_experts." in n]
        with torch.no_grad():
            positions = torch.arange(ids.shape[1])[None]
            copy_logits = copy(ids, positions, None)
        if layout.tp_size > 1:
            parts = [torch.empty_like(copy_logits) for _ in range(layout.tp_size)]
            dist.all_gather(parts, copy_logits.contiguous(), group=layout.tp_group)
            copy_logits = torch.cat(parts, dim=-1)
        fc1 = dict(copy.named_parameters())
        first, second = (
            f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight"
            for e in (0, hf.arch.num_experts - 1)
        )
        with torch.no_grad():  # the first and the last expert swapped
            a = fc1[first].clone()
            fc1[first].copy_(fc1[second])
            fc1[second].copy_(a)
        out[infer_tp] = dict(
            trained=full_logits(trained, ids, hf.vocab_size),
            copy=copy_logits[..., : hf.vocab_size],
            experts_in_copy=len({n.split(".local_experts.")[1].split(".")[0] for n in names}),
            received=stats.bytes_received,
            verified=verified,
            swapped=refit.mismatches(),
        )
    return out


@pytest.mark.parametrize(
    "tp,ep", [pytest.param(1, 2, id="trained-ep2"), pytest.param(2, 1, id="trained-tp2")]
)
def test_an_moe_copy_holds_every_expert_and_computes_the_trained_logits(tmp_path, tp, ep):
    """From expert parallelism (each rank holds half the experts) or TP (each expert split over
    both ranks): copies at TP 1 and 2 hold every expert, compute the trained model's logits,
    and ``--rl-verify-model-weights-swap`` names two experts swapped in the copy."""
    checkpoint = make_tiny_checkpoint("qwen3_moe", tmp_path / "moe", seed=5)
    ranks = run_on_ranks(moe_refit_on_rank, 2, tp, ep, str(checkpoint))
    experts = ranks[0]["experts"]
    for infer_tp in (1, 2):
        for got in (r[infer_tp] for r in ranks):
            torch.testing.assert_close(got["copy"], got["trained"], rtol=1e-5, atol=1e-5)
            assert got["experts_in_copy"] == experts and got["verified"] == []
            # the other rank's experts or halves; nothing at the training layout
            assert (got["received"] == 0) == (infer_tp == tp and ep == 1)
            assert got["swapped"] == [
                f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight"
                for e in (0, experts - 1)
            ]
