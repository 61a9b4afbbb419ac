"""Tiny Hugging Face checkpoints and the megatron-core models built from them, for tests."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron.rl.models.architecture import build_gpt_model, layer_spec, transformer_config
from megatron.rl.models.gpt_spec import SDPASpecProvider
from megatron.rl.models.hf import HFModelConfig, load_hf_checkpoint, read_hf_config
from megatron.rl.models.hf.tiny import TINY_FAMILIES, make_tiny_checkpoint

PROMPT_LENGTHS = (9, 3, 14, 6)
"""A mixed-length batch (right-padded to the longest)."""


def make_checkpoints(root: Path) -> dict[str, Path]:
    """One tiny checkpoint per family under ``root`` (seeded per family)."""
    return {
        family: make_tiny_checkpoint(family, root / family, seed=i)
        for i, family in enumerate(TINY_FAMILIES)
    }


def mixed_batch(seed: int = 0, vocab: int = 290) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, T) right-padded with 0 and the bool mask (B, T) of real tokens."""
    g = torch.Generator().manual_seed(seed)
    width = max(PROMPT_LENGTHS)
    ids = torch.randint(7, vocab, (len(PROMPT_LENGTHS), width), generator=g)  # (B, T)
    mask = torch.arange(width)[None, :] < torch.tensor(PROMPT_LENGTHS)[:, None]  # (B, T)
    return torch.where(mask, ids, 0), mask


def build_hf_model(
    directory: Path, tp: int = 1, ep: int = 1
) -> tuple[torch.nn.Module, HFModelConfig]:
    """Our GPTModel of an HF checkpoint at TP ``tp`` and EP ``ep`` (parallel state set up if
    needed), eval."""
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, expert_model_parallel_size=ep
        )
    hf = read_hf_config(directory)
    moe = {} if hf.arch.num_experts is None else dict(expert_model_parallel_size=ep)
    config = transformer_config(hf.arch, tensor_model_parallel_size=tp, **moe)
    model = build_gpt_model(hf.arch, config, layer_spec(hf.arch, SDPASpecProvider()))
    load_hf_checkpoint(model, directory, hf)
    return model.eval(), hf


def full_logits(model: torch.nn.Module, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, T, vocab_size) logits at positions 0..T-1, vocab-parallel shards gathered."""
    positions = torch.arange(ids.shape[1])[None, :].expand_as(ids)  # (B, T)
    with torch.no_grad():
        out = model(ids, positions, None)  # (B, T, V_padded / tp)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(out) for _ in range(tp)]
        dist.all_gather(
            parts, out.contiguous(), group=parallel_state.get_tensor_model_parallel_group()
        )
        out = torch.cat(parts, dim=-1)
    return out[..., :vocab_size]


def hf_logits(directory: Path, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """transformers' float32 logits (B, T, V) of the right-padded batch."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(input_ids=ids, attention_mask=mask.long()).logits


def greedy_tokens(
    model: torch.nn.Module, hf: HFModelConfig, prompts: list[list[int]], steps: int = 32
) -> list[list[int]]:
    """``steps`` greedy tokens per prompt from the engine's ``KVCacheRowRunner`` and ``KVCache``.

    All prompts are prefilled in one step (rows of different lengths), then decoded together,
    each row at its own position.
    """
    from megatron.rl.inference.cpu.kv_cache import KVCache
    from megatron.rl.inference.cpu.kv_cache_runner import KVCacheRowRunner
    from megatron.rl.inference.protocol import RowWork

    tp = parallel_state.get_tensor_model_parallel_world_size()
    arch = hf.arch
    cache = KVCache(
        arch.num_layers,
        len(prompts),
        max(map(len, prompts)) + steps,
        arch.query_groups // tp,
        arch.head_dim,
        torch.float32,
        torch.device("cpu"),
    )
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    runner = KVCacheRowRunner(model, cache, hf.vocab_size, group)
    rows = [RowWork(i, tuple(p), 0, 0.0, 1.0, 0, seed=i) for i, p in enumerate(prompts)]
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        results = runner.run(rows)
        rows = [
            RowWork(row.slot, (res.token,), row.start + len(row.tokens), 0.0, 1.0, 0, row.seed)
            for row, res in zip(rows, results)
        ]
        for res in results:
            out[res.slot].append(res.token)
    return out


def hf_greedy_tokens(directory: Path, prompts: list[list[int]], steps: int = 32) -> list[list[int]]:
    """transformers ``generate(do_sample=False)`` of the prompts as one left-padded batch (the
    attention mask gives each row its own positions), ``steps`` tokens each, no EOS stop."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # else generate() merges the model's EOS ids back
    config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=steps, eos_token_id=None, pad_token_id=0
    )
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # (B, T) left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # (B, T)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, generation_config=config)
    return out[:, width:].tolist()
