"""Under ``--bf16`` on the CPU tier neither the engine's forward nor the trained model's forward
and backward print a library warning: their RMSNorms get bfloat16 hidden states and float32
weights, a mixed-dtype call torch warns about on every step (``megatron/rl/models/rms_norm.py``
computes it as torch does, without that call)."""

from __future__ import annotations

import warnings

import torch
from grpo_testing.models import VOCAB, tiny_gpt

from megatron.rl.inference.cpu.kv_cache import KVCache
from megatron.rl.inference.cpu.kv_cache_runner import KVCacheRowRunner
from megatron.rl.inference.protocol import RowWork

QWEN3 = dict(
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    disable_bias_linear=True,
    qk_layernorm=True,
    kv_channels=16,
)


def caught_warnings(run) -> list[str]:
    """The messages of the warnings ``run()`` issues (each one, not once per place)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def test_bf16_generation_prints_no_warning(single_rank_world):
    model = tiny_gpt(**QWEN3).eval()
    c = model.config
    cache = KVCache(
        c.num_layers, 2, 24, c.num_query_groups, c.kv_channels, torch.bfloat16, torch.device("cpu")
    )
    runner = KVCacheRowRunner(model, cache, VOCAB, compute_dtype=torch.bfloat16)
    assert runner.cached_forward is not None
    prompts = [(3, 4, 5, 6), (7, 8)]

    def generate():
        rows = [RowWork(i, p, 0, 1.0, 1.0, 0, seed=i) for i, p in enumerate(prompts)]
        results = runner.run(rows)  # prefill
        runner.run(
            [
                RowWork(i, (r.token,), len(prompts[i]), 1.0, 1.0, 0, seed=i)
                for i, r in enumerate(results)
            ]
        )

    assert caught_warnings(generate) == []


def test_bf16_training_forward_and_backward_print_no_warning(single_rank_world):
    model = tiny_gpt(**QWEN3)
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))  # (B, T)

    def train_step():
        with torch.autocast("cpu", torch.bfloat16):
            logits = model(ids, torch.arange(6)[None].expand(2, 6), None)  # (B, T, V)
        logits.float().sum().backward()

    assert caught_warnings(train_step) == []
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
