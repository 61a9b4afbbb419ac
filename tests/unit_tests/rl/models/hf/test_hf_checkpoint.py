"""Loading and exporting safetensors checkpoints: bitwise round trips, sharding, error paths."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from grpo_testing.hf_models import build_hf_model, full_logits, hf_logits, mixed_batch
from megatron.core import parallel_state
from safetensors.torch import load_file, save_file

from megatron.rl.models.architecture import build_gpt_model, layer_spec, transformer_config
from megatron.rl.models.gpt_spec import SDPASpecProvider
from megatron.rl.models.hf import (
    HFCheckpointError,
    export_hf,
    gather_tensor_parallel_state_dicts,
    load_hf_checkpoint,
    load_hf_tokenizer,
    read_hf_config,
)
from megatron.rl.models.hf.tiny import TINY_FAMILIES


@pytest.fixture
def tp1(single_rank_world):
    """megatron-core's parallel state for one rank."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)


def empty_model(hf) -> torch.nn.Module:
    """An (unloaded) GPTModel of ``hf``'s architecture on the SDPA backend."""
    return build_gpt_model(
        hf.arch, transformer_config(hf.arch), layer_spec(hf.arch, SDPASpecProvider())
    )


@pytest.fixture
def checkpoint_copy(tiny_hf_checkpoints, tmp_path):
    """A writable copy of the tiny llama3 checkpoint."""
    return shutil.copytree(tiny_hf_checkpoints["llama3"], tmp_path / "llama3")


def rewrite_weights(directory, edit) -> None:
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def rewrite_config(directory, **changes) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_hf_to_ours_to_hf_is_bitwise_and_loads_in_transformers(
    family, tiny_hf_checkpoints, single_rank_world, tmp_path
):
    directory = tiny_hf_checkpoints[family]
    model, hf = build_hf_model(directory)
    out = export_hf(
        tmp_path / family,
        hf.arch,
        gather_tensor_parallel_state_dicts(model)[0],
        family=hf.family,
        vocab_size=hf.vocab_size,
        tokenizer_dir=directory,
    )
    original, exported = load_file(directory / "model.safetensors"), load_file(
        out / "model.safetensors"
    )
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    again = read_hf_config(out)
    assert (again.family, again.arch, again.vocab_size) == (hf.family, hf.arch, hf.vocab_size)
    config = json.loads((out / "config.json").read_text())
    source = json.loads((directory / "config.json").read_text())
    assert config["torch_dtype"] == "float32"
    assert (config["architectures"], config["model_type"]) == (
        source["architectures"],
        source["model_type"],
    )
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 3]
    ids, mask = mixed_batch()
    ours = full_logits(model, ids, hf.vocab_size)
    assert (ours - hf_logits(out, ids, mask))[mask].abs().max() <= 1e-4


def test_sharded_export_is_read_back_by_us_and_transformers(
    tiny_hf_checkpoints, single_rank_world, tmp_path
):
    model, hf = build_hf_model(tiny_hf_checkpoints["qwen2"])
    state = gather_tensor_parallel_state_dicts(model)
    out = export_hf(tmp_path / "sharded", hf.arch, state, family="qwen2", max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    reloaded = build_gpt_model(
        hf.arch, transformer_config(hf.arch), layer_spec(hf.arch, SDPASpecProvider())
    )
    load_hf_checkpoint(reloaded, out, read_hf_config(out))
    for (name, a), b in zip(model.state_dict().items(), reloaded.state_dict().values()):
        assert a is None or torch.equal(a, b), name
    ids, mask = mixed_batch()
    theirs = hf_logits(out, ids, mask)  # exported with all (padded) embedding rows
    assert theirs.shape[-1] == hf.arch.vocab_size
    assert (full_logits(model, ids, hf.arch.vocab_size) - theirs)[mask].abs().max() <= 1e-4


def test_missing_config_json_is_named(tmp_path):
    with pytest.raises(HFCheckpointError, match=r"config\.json"):
        read_hf_config(tmp_path)


def test_unsupported_architecture_is_named_with_the_supported_ones(checkpoint_copy):
    rewrite_config(checkpoint_copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(HFCheckpointError) as err:
        read_hf_config(checkpoint_copy)
    message = str(err.value)
    assert "config.json" in message and "GPT2LMHeadModel" in message
    for supported in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Mistral"):
        assert supported in message


def test_missing_weights_are_named(checkpoint_copy, tp1):
    hf = read_hf_config(checkpoint_copy)
    (checkpoint_copy / "model.safetensors").unlink()
    model = empty_model(hf)
    with pytest.raises(HFCheckpointError, match=r"no weights \(model\.safetensors"):
        load_hf_checkpoint(model, checkpoint_copy, hf)


@pytest.mark.parametrize(
    "edit, pattern",
    [
        pytest.param(
            lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
            r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing",
            id="missing-tensor",
        ),
        pytest.param(
            lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}),
            r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' has shape "
            r"\[16, 64\], config\.json implies \[32, 64\]",
            id="shape-mismatch",
        ),
        pytest.param(
            lambda t: t.update({"model.layers.2.mlp.gate_proj.weight": torch.zeros(1)}),
            r"model\.safetensors: unknown tensor 'model\.layers\.2\.mlp\.gate_proj\.weight'",
            id="unknown-tensor",
        ),
    ],
)
def test_bad_tensors_are_named_with_their_file(checkpoint_copy, tp1, edit, pattern):
    hf = read_hf_config(checkpoint_copy)
    rewrite_weights(checkpoint_copy, edit)
    model = empty_model(hf)
    with pytest.raises(HFCheckpointError, match=pattern):
        load_hf_checkpoint(model, checkpoint_copy, hf)


def test_config_json_disagreeing_with_the_weights_is_a_shape_error(checkpoint_copy, tp1):
    rewrite_config(checkpoint_copy, intermediate_size=96)
    hf = read_hf_config(checkpoint_copy)
    model = empty_model(hf)
    with pytest.raises(HFCheckpointError, match=r"mlp\.gate_proj\.weight' has shape \[128, 64\]"):
        load_hf_checkpoint(model, checkpoint_copy, hf)


def test_missing_shard_of_an_index_is_named(tiny_hf_checkpoints, single_rank_world, tmp_path):
    model, hf = build_hf_model(tiny_hf_checkpoints["mistral"])
    out = export_hf(
        tmp_path / "m", hf.arch, model.state_dict(), family="mistral", max_shard_bytes=1
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    second = sorted(set(index["weight_map"].values()))[1]
    assert second.startswith("model-00002-of-")
    (out / second).unlink()
    with pytest.raises(HFCheckpointError, match=rf"{second}: weight shard .* is missing"):
        load_hf_checkpoint(model, out, read_hf_config(out))


def test_weights_of_another_family_are_refused(tiny_hf_checkpoints, single_rank_world):
    qwen3 = read_hf_config(tiny_hf_checkpoints["qwen3"])
    model, _ = build_hf_model(tiny_hf_checkpoints["qwen2"])
    with pytest.raises(HFCheckpointError, match=r"qwen2: tensor 'lm_head\.weight' is missing"):
        load_hf_checkpoint(model, tiny_hf_checkpoints["qwen2"], qwen3)


def test_tokenizer_larger_than_the_embedding_is_refused(checkpoint_copy):
    rewrite_config(checkpoint_copy, vocab_size=256)
    hf = read_hf_config(checkpoint_copy)
    with pytest.raises(HFCheckpointError, match=r"300 tokens.*config\.json vocab_size=256"):
        load_hf_tokenizer(checkpoint_copy, hf)
    rewrite_config(checkpoint_copy, vocab_size=300)  # exactly the tokenizer's size: fine
    assert load_hf_tokenizer(checkpoint_copy, read_hf_config(checkpoint_copy)).vocab_size == 300


def test_export_refuses_a_tokenizer_larger_than_the_exported_vocab(
    tiny_hf_checkpoints, single_rank_world, tmp_path
):
    model, hf = build_hf_model(tiny_hf_checkpoints["llama"])
    with pytest.raises(HFCheckpointError, match="300 tokens.*256 embedding rows"):
        export_hf(
            tmp_path / "x",
            hf.arch,
            model.state_dict(),
            family="llama",
            vocab_size=256,
            tokenizer_dir=tiny_hf_checkpoints["llama"],
        )


def test_explicit_tp_rank_must_be_in_range_and_match_the_model(tiny_hf_checkpoints, tp1):
    hf = read_hf_config(tiny_hf_checkpoints["llama"])
    model = empty_model(hf)
    with pytest.raises(ValueError, match=r"tp_rank=2 is not in \[0, 2\)"):
        load_hf_checkpoint(model, tiny_hf_checkpoints["llama"], hf, tp_rank=2, tp_size=2)
    shapes = r"word_embeddings\.weight' has shape \[384, 64\], the checkpoint gives \[192, 64\]"
    with pytest.raises(ValueError, match=shapes + " at TP rank 1 of 2"):
        load_hf_checkpoint(model, tiny_hf_checkpoints["llama"], hf, tp_rank=1, tp_size=2)
