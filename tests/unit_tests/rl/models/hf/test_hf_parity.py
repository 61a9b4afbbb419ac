"""Our GPTModel of an HF checkpoint against transformers: logits (TP=1, TP=2) and greedy decoding.

Every family of ``megatron.rl.models.hf.tiny``; float32; a mixed-length right-padded batch is
compared at its real positions. Greedy decoding runs the CPU engine's ``KVCacheRowRunner`` with its
``KVCache`` (one prefill of all prompts, then batched decode steps, each row at its own position)
against ``transformers`` ``generate(do_sample=False)``.
"""

from __future__ import annotations

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
    export_hf,
    gather_tensor_parallel_state_dicts,
    hf_from_megatron,
    read_hf_config,
)
from megatron.rl.models.hf.tiny import TINY_FAMILIES
from megatron.rl.models.hf.tokenizer import HuggingFaceTokenizer

LOGIT_TOLERANCE = 1e-4
PROMPTS = ["12+7=", "What is 33 - 8?", "9", "copy: 4071 -> 4071, is 40 > 7? yes. 81*3="]


def prompt_ids(directory) -> list[list[int]]:
    tok = HuggingFaceTokenizer(directory)
    return [tok.encode(text) for text in PROMPTS]


def tp2_rank(rank: int, world_size: int, checkpoints: dict, prompts: dict) -> dict:
    """Per family at TP=2: gathered logits, every rank's state dict, greedy tokens."""
    from megatron.core import parallel_state

    ids, _ = mixed_batch()
    out = {}
    for family, directory in checkpoints.items():
        model, hf = build_hf_model(directory, tp=world_size)
        shards = gather_tensor_parallel_state_dicts(model)
        out[family] = dict(
            logits=full_logits(model, ids, hf.vocab_size),
            shards=shards,
            local_shapes={
                k: tuple(v.shape) for k, v in model.state_dict().items() if v is not None
            },
            greedy=greedy_tokens(model, hf, prompts[family]),
        )
    assert parallel_state.get_tensor_model_parallel_world_size() == world_size
    return out


@pytest.fixture(scope="module")
def tp2_results(tiny_hf_checkpoints):
    prompts = {family: prompt_ids(path) for family, path in tiny_hf_checkpoints.items()}
    return run_on_ranks(tp2_rank, 2, tiny_hf_checkpoints, prompts)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tp1_logits_match_transformers(family, tiny_hf_checkpoints, single_rank_world):
    directory = tiny_hf_checkpoints[family]
    ids, mask = mixed_batch()
    model, hf = build_hf_model(directory)
    ours = full_logits(model, ids, hf.vocab_size)  # (B, T, V)
    theirs = hf_logits(directory, ids, mask)
    assert ours.shape == theirs.shape
    assert (ours - theirs)[mask].abs().max() <= LOGIT_TOLERANCE
    assert theirs[mask].std() > 0.1  # not a degenerate model


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tp2_logits_match_transformers(family, tiny_hf_checkpoints, tp2_results):
    ids, mask = mixed_batch()
    theirs = hf_logits(tiny_hf_checkpoints[family], ids, mask)
    for rank in tp2_results:
        ours = rank[family]["logits"]
        assert (ours - theirs)[mask].abs().max() <= LOGIT_TOLERANCE


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tp2_ranks_hold_shards_and_reassemble_bitwise(family, tiny_hf_checkpoints, tp2_results):
    directory = tiny_hf_checkpoints[family]
    original = load_file(directory / "model.safetensors")
    rank0 = tp2_results[0][family]
    hf = read_hf_config(directory)
    qkv = rank0["local_shapes"]["decoder.layers.0.self_attention.linear_qkv.weight"]
    if hf.arch.num_experts is not None:  # each TP rank holds half of every expert's width
        fc1 = rank0["local_shapes"][
            "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
        ]
        assert fc1[0] == hf.arch.expert_ffn_hidden_size  # [gate/2; up/2]
    assert qkv[0] == original["model.layers.0.self_attn.q_proj.weight"].shape[0] // 2 + (
        original["model.layers.0.self_attn.k_proj.weight"].shape[0]
    )  # half of q rows + half of k and v rows
    assert len(rank0["shards"]) == 2
    rebuilt = hf_from_megatron(hf.arch, rank0["shards"], hf.vocab_size, hf.family)
    assert set(rebuilt) == set(original)
    for name, tensor in original.items():
        assert torch.equal(rebuilt[name], tensor), name


def test_export_from_tp2_shards_loads_in_transformers(tiny_hf_checkpoints, tp2_results, tmp_path):
    import transformers

    directory = tiny_hf_checkpoints["qwen3"]
    hf = read_hf_config(directory)
    out = export_hf(
        tmp_path / "export",
        hf.arch,
        tp2_results[0]["qwen3"]["shards"],
        family="qwen3",
        vocab_size=hf.vocab_size,
        tokenizer_dir=directory,
    )
    original = load_file(directory / "model.safetensors")
    exported = load_file(out / "model.safetensors")
    assert set(exported) == set(original)
    assert all(torch.equal(exported[k], v) for k, v in original.items())
    ids, mask = mixed_batch()
    theirs = hf_logits(out, ids, mask)
    assert (tp2_results[0]["qwen3"]["logits"] - theirs)[mask].abs().max() <= LOGIT_TOLERANCE
    assert transformers.AutoTokenizer.from_pretrained(out).encode("12+7=") == (
        transformers.AutoTokenizer.from_pretrained(directory).encode("12+7=")
    )


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_greedy_decoding_matches_transformers_generate(
    family, tiny_hf_checkpoints, single_rank_world, tp2_results
):
    directory = tiny_hf_checkpoints[family]
    prompts = prompt_ids(directory)
    assert len({len(p) for p in prompts}) == len(prompts)  # mixed lengths
    model, hf = build_hf_model(directory)
    ours = greedy_tokens(model, hf, prompts, steps=32)
    theirs = hf_greedy_tokens(directory, prompts, steps=32)
    assert all(len(t) == 32 for t in theirs)
    assert ours == theirs
    assert tp2_results[0][family]["greedy"] == theirs
    assert tp2_results[1][family]["greedy"] == theirs
