"""Qwen3-MoE and Mixtral: expert parallelism (EP=2 over gloo) against transformers, and what
``config.json`` layouts are refused.

TP=1 and TP=2 parity, greedy decoding and the bitwise round trip of both families run with every
other family in ``test_hf_parity.py`` (their tiny recipes join ``TINY_FAMILIES``).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from grpo_testing.distributed import run_on_ranks
from grpo_testing.hf_models import (
    build_hf_model,
    full_logits,
    greedy_tokens,
    hf_greedy_tokens,
    hf_logits,
    mixed_batch,
)
from safetensors.torch import load_file

from megatron.rl.models.hf import (
    HFCheckpointError,
    export_hf,
    gather_tensor_parallel_state_dicts,
    hf_config_dict,
    read_hf_config,
)

MOE_FAMILIES = ("qwen3_moe", "mixtral")
LOGIT_TOLERANCE = 1e-4
PROMPTS = [[40, 41, 42, 43, 44, 45, 46], [9, 10], [100, 7, 250, 31]]


def ep2_rank(rank: int, world_size: int, checkpoints: dict) -> dict:
    """Per family at EP=2: gathered logits, local expert count, the EP=1-layout state dicts,
    greedy tokens."""
    ids, _ = mixed_batch()
    out = {}
    for family in MOE_FAMILIES:
        model, hf = build_hf_model(checkpoints[family], ep=world_size)
        out[family] = dict(
            logits=full_logits(model, ids, hf.vocab_size),
            local_experts=len(model.decoder.layers[0].mlp.experts.local_experts),
            shards=gather_tensor_parallel_state_dicts(model),
            greedy=greedy_tokens(model, hf, PROMPTS, steps=12),
        )
    return out


@pytest.fixture(scope="module")
def ep2_results(tiny_hf_checkpoints):
    checkpoints = {family: tiny_hf_checkpoints[family] for family in MOE_FAMILIES}
    return run_on_ranks(ep2_rank, 2, checkpoints)


@pytest.mark.slow
@pytest.mark.parametrize("family", [pytest.param(f, id=f) for f in MOE_FAMILIES])
def test_ep2_logits_greedy_and_export_match_transformers(
    family, tiny_hf_checkpoints, ep2_results, tmp_path
):
    directory = tiny_hf_checkpoints[family]
    hf = read_hf_config(directory)
    ids, mask = mixed_batch()
    theirs = hf_logits(directory, ids, mask)
    greedy = hf_greedy_tokens(directory, PROMPTS, steps=12)
    for rank in ep2_results:
        assert rank[family]["local_experts"] == hf.arch.num_experts // 2
        assert (rank[family]["logits"] - theirs)[mask].abs().max() <= LOGIT_TOLERANCE
        assert rank[family]["greedy"] == greedy
    out = export_hf(
        tmp_path / family,
        hf.arch,
        ep2_results[1][family]["shards"],
        family=family,
        vocab_size=hf.vocab_size,
        tokenizer_dir=directory,
    )
    original, exported = load_file(directory / "model.safetensors"), load_file(
        out / "model.safetensors"
    )
    assert set(exported) == set(original)
    assert all(torch.equal(exported[k], v) for k, v in original.items())
    assert json.loads((out / "config.json").read_text())["architectures"] == (
        json.loads((directory / "config.json").read_text())["architectures"]
    )


def _config(directory, **changes) -> dict:
    cfg = json.loads((directory / "config.json").read_text())
    return {**cfg, **changes}


@pytest.mark.parametrize(
    "family, changes, key",
    [
        pytest.param("qwen3_moe", dict(decoder_sparse_step=2), "decoder_sparse_step", id="sparse"),
        pytest.param("qwen3_moe", dict(mlp_only_layers=[1]), "mlp_only_layers", id="dense-layers"),
        pytest.param("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise", id="jitter"),
        pytest.param("mixtral", dict(num_local_experts=None), "num_experts", id="no-experts"),
    ],
)
def test_unsupported_layouts_are_refused_naming_the_key(
    family, changes, key, tiny_hf_checkpoints, tmp_path
):
    (tmp_path / "config.json").write_text(
        json.dumps(_config(tiny_hf_checkpoints[family], **changes))
    )
    with pytest.raises(HFCheckpointError, match=f"config.json: {key}"):
        read_hf_config(tmp_path)


def test_qwen3_moe_without_norm_topk_prob_matches_transformers(
    tiny_hf_checkpoints, tmp_path, single_rank_world
):
    source = tiny_hf_checkpoints["qwen3_moe"]
    (tmp_path / "config.json").write_text(json.dumps(_config(source, norm_topk_prob=False)))
    shutil.copy(source / "model.safetensors", tmp_path / "model.safetensors")
    model, hf = build_hf_model(tmp_path)
    assert hf.arch.moe_router_pre_softmax  # softmax over all experts, weights not renormalized
    assert hf_config_dict(hf.arch, "qwen3_moe", hf.vocab_size)["norm_topk_prob"] is False
    ids, mask = mixed_batch()
    ours, theirs = full_logits(model, ids, hf.vocab_size), hf_logits(tmp_path, ids, mask)
    assert (ours - theirs)[mask].abs().max() <= LOGIT_TOLERANCE
    normalized = hf_logits(source, ids, mask)
    assert (normalized - theirs)[mask].abs().max() > 100 * LOGIT_TOLERANCE  # the key matters
