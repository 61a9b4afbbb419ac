"""The refit of a model trained in two pipeline stages into whole copies (gloo, 2 ranks): every
rank's copy holds both stages' weights under global layer numbers, and
``--rl-verify-model-weights-swap`` names a layer moved in a copy. (Untied embeddings: megatron-core
syncs tied ones across stages on CUDA only; the emulated CUDA tier's test covers them.)"""

from __future__ import annotations

import dataclasses

import torch
from grpo_testing.distributed import run_on_ranks
from grpo_testing.models import LLAMA_LIKE, VOCAB, model_build, tiny_args
from megatron.core import parallel_state

from megatron.rl.models.architecture import build_gpt_model, layer_spec, transformer_config
from megatron.rl.models.gpt_spec import SDPASpecProvider
from megatron.rl.refit.layout import inference_layout
from megatron.rl.refit.stages import StageRefit, global_name
from megatron.trainer.model.provider import architecture, build_model

UNTIED = {**LLAMA_LIKE, "untie_embeddings_and_output_weights": True}


def stage_refit_on_rank(rank: int, world: int) -> dict:
    """Stage ``rank`` of a 4-layer PP=2 model refit into a whole TP=1 copy."""
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    spec = model_build(tiny_args(num_layers=4, pipeline_model_parallel_size=2, **UNTIED))
    arch = architecture(spec, VOCAB)
    torch.manual_seed(3 + rank)
    config = transformer_config(arch, pipeline_model_parallel_size=2)
    stage = build_gpt_model(
        arch, config, layer_spec(arch, SDPASpecProvider()), rank == 0, rank == 1
    )
    layout = inference_layout(1, alone=True)
    whole = dataclasses.replace(spec, pipeline_parallel=1)
    copy = build_model(whole, VOCAB, torch.device("cpu"), False, layout.pg_collection)
    group = parallel_state.get_pipeline_model_parallel_group()
    refit = StageRefit(stage, copy, None, layout.tp_group, True, group)
    stats = refit()
    copied = dict(copy.named_parameters())
    own = {
        global_name(stage, n): torch.equal(p, copied.get(global_name(stage, n), p[:0]))
        for n, p in stage.named_parameters()
    }
    verified = refit.mismatches()
    a, b = (copied[f"decoder.layers.{i}.mlp.linear_fc2.weight"] for i in (0, 3))
    with torch.no_grad():  # layer 0's fc2 (stage 0's) and layer 3's (stage 1's) swapped
        saved = a.clone()
        a.copy_(b)
        b.copy_(saved)
    return dict(
        own=own,
        copy_names=sorted(copied),
        received=stats.bytes_received,
        written=stats.bytes_written,
        verified=verified,
        swapped=refit.mismatches(),
    )


def test_every_rank_gets_both_stages_under_global_layer_numbers():
    first, last = run_on_ranks(stage_refit_on_rank, 2)
    assert first["copy_names"] == last["copy_names"]
    assert {"embedding.word_embeddings.weight", "output_layer.weight"} <= set(first["copy_names"])
    assert all(first["own"].values()) and "decoder.layers.1.self_attention.linear_qkv.weight" in (
        first["own"]
    )  # stage 0: the embedding and layers 0-1, as trained
    assert all(last["own"].values()) and "decoder.layers.3.mlp.linear_fc2.weight" in last["own"]
    for r in (first, last):
        assert 0 < r["received"] < r["written"]  # the other stage's tensors, then all of them
        assert r["verified"] == []
        assert r["swapped"] == [
            "decoder.layers.0.mlp.linear_fc2.weight",
            "decoder.layers.3.mlp.linear_fc2.weight",
        ]
