"""PEFT adapter directories: what we write, PEFT loads onto the Hugging Face model with our logits;
what PEFT (or we) wrote loads back, at any tensor-parallel size."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from grpo_testing.distributed import run_on_ranks
from grpo_testing.hf_models import build_hf_model, full_logits, mixed_batch

from megatron.rl.lora.config import LoRAConfig
from megatron.rl.lora.model import apply_lora, lora_adapters
from megatron.rl.lora.peft import (
    AdapterLoadError,
    gather_adapter_tensors,
    load_adapter_directory,
    write_adapter_directory,
)

pytest.importorskip("peft")
TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")
CONFIG = LoRAConfig(rank=4, alpha=16.0, targets=TARGETS, seed=2)


def trained(model, seed: int = 1) -> None:
    """B != 0 (an adapter that has trained); A as initialized."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, _, adapter in lora_adapters(model).adapters():
            for b in adapter.lora_B.values():
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)


@pytest.mark.parametrize("family, rslora", [("llama", False), ("qwen2", False), ("qwen3", True)])
def test_peft_loads_our_adapter_with_our_logits(
    single_rank_world, tiny_hf_checkpoints, family, rslora, tmp_path
):
    """PEFT on the Hugging Face base gives our logits (with rsLoRA's scale alpha / sqrt(r))."""
    import transformers
    from peft import PeftModel

    directory = tiny_hf_checkpoints[family]
    model, hf = build_hf_model(directory)
    config = dataclasses.replace(CONFIG, rslora=rslora)
    apply_lora(model, config)
    trained(model)
    ids, mask = mixed_batch(vocab=hf.vocab_size)
    ours = full_logits(model, ids, hf.vocab_size)
    write_adapter_directory(
        tmp_path, gather_adapter_tensors(lora_adapters(model)), config, str(directory)
    )
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (saved["r"], saved["lora_alpha"], saved["target_modules"]) == (4, 16.0, list(TARGETS))
    assert saved["use_rslora"] is rslora
    base = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path).eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=ids, attention_mask=mask.long()).logits
        with peft_model.disable_adapter():
            plain = peft_model(input_ids=ids, attention_mask=mask.long()).logits
    torch.testing.assert_close(ours[mask], theirs[mask], atol=2e-4, rtol=1e-4)
    assert (theirs[mask] - plain[mask]).abs().max() > 1e-2  # the adapter changes the model


def test_an_adapter_peft_trained_continues_here(single_rank_world, tiny_hf_checkpoints, tmp_path):
    """PEFT's own directory (its key names, its config) loads into our adapters."""
    import transformers
    from peft import LoraConfig, get_peft_model

    directory = tiny_hf_checkpoints["llama"]
    base = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    peft_model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=16, target_modules=list(TARGETS), lora_dropout=0.0)
    )
    with torch.no_grad():  # as if trained: B != 0
        g = torch.Generator().manual_seed(3)
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    peft_model.save_pretrained(tmp_path)
    ids, mask = mixed_batch()
    with torch.no_grad():
        theirs = peft_model.eval()(input_ids=ids, attention_mask=mask.long()).logits
    model, hf = build_hf_model(directory)
    apply_lora(model, CONFIG)
    load_adapter_directory(lora_adapters(model), tmp_path)
    ours = full_logits(model, ids, hf.vocab_size)
    torch.testing.assert_close(ours[mask], theirs[mask], atol=2e-4, rtol=1e-4)


def test_a_directory_that_does_not_fit_is_refused_naming_it(
    single_rank_world, tiny_hf_checkpoints, tmp_path
):
    model, _ = build_hf_model(tiny_hf_checkpoints["llama"])
    adapters = apply_lora(model, CONFIG)
    tensors = gather_adapter_tensors(adapters)
    other = LoRAConfig(rank=2, alpha=2.0, targets=TARGETS)
    write_adapter_directory(tmp_path / "rank", tensors, other)
    with pytest.raises(AdapterLoadError, match="rank 2 targets .* do not match"):
        load_adapter_directory(adapters, tmp_path / "rank")
    key = next(iter(tensors))
    write_adapter_directory(
        tmp_path / "missing", {k: v for k, v in tensors.items() if k != key}, CONFIG
    )
    with pytest.raises(AdapterLoadError, match=f"missing tensor '{key}'"):
        load_adapter_directory(adapters, tmp_path / "missing")
    extra = {**tensors, key.replace("layers.0", "layers.9"): tensors[key].clone()}
    write_adapter_directory(tmp_path / "extra", extra, CONFIG)
    with pytest.raises(AdapterLoadError, match="fit no adapter of this model"):
        load_adapter_directory(adapters, tmp_path / "extra")
    wrong = {**tensors, key: tensors[key][:, :-1]}
    write_adapter_directory(tmp_path / "shape", wrong, CONFIG)
    with pytest.raises(AdapterLoadError, match="has shape"):
        load_adapter_directory(adapters, tmp_path / "shape")


def load_on_rank(rank: int, world_size: int, directory, adapter_dir) -> dict:
    model, hf = build_hf_model(directory, tp=world_size)
    adapters = apply_lora(model, CONFIG)
    load_adapter_directory(adapters, adapter_dir)
    ids, _ = mixed_batch(vocab=hf.vocab_size)
    return {
        "logits": full_logits(model, ids, hf.vocab_size),
        "tensors": gather_adapter_tensors(adapters),
    }


def test_tensor_parallel_ranks_load_their_shards_and_gather_the_whole(
    tiny_hf_checkpoints, tmp_path
):
    from safetensors.torch import load_file

    directory = tiny_hf_checkpoints["llama"]
    (single,) = run_on_ranks(_write_on_rank, 1, directory, tmp_path)
    written = load_file(str(tmp_path / "adapter_model.safetensors"))
    first, second = run_on_ranks(load_on_rank, 2, directory, tmp_path)
    for key, tensor in written.items():
        assert torch.equal(first["tensors"][key], tensor) and torch.equal(
            second["tensors"][key], tensor
        )
    torch.testing.assert_close(first["logits"], single, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second["logits"], single, atol=1e-5, rtol=1e-5)


def _write_on_rank(rank: int, world_size: int, directory, out) -> torch.Tensor:
    model, hf = build_hf_model(directory)
    adapters = apply_lora(model, CONFIG)
    trained(model)
    write_adapter_directory(out, gather_adapter_tensors(adapters), CONFIG)
    ids, _ = mixed_batch(vocab=hf.vocab_size)
    return full_logits(model, ids, hf.vocab_size)
