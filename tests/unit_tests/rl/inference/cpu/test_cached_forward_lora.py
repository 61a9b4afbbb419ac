"""The CPU engine generates with base + the current adapter, at every policy version.

An adapter trained but never used by generation (a failure other systems shipped) fails here: the
engine's logits are compared with a full forward of the adapted model after each in-place update
of the adapters, inside a generation window and across windows, and with the base's.
"""

from __future__ import annotations

import pytest
import torch
from grpo_testing.models import VOCAB, tiny_gpt
from test_cached_forward import (
    ARCHITECTURES,
    assert_same_generation,
    generate,
    make_cache,
    randomized,
)

from megatron.rl.inference.cpu.cached_forward import CachedForward
from megatron.rl.inference.cpu.kv_cache_runner import KVCacheRowRunner
from megatron.rl.lora.config import PROJECTIONS, LoRAConfig
from megatron.rl.lora.frozen import store_frozen_linear_weights
from megatron.rl.lora.model import adapters_disabled, apply_lora, lora_adapters

CONFIG = LoRAConfig(rank=3, alpha=6.0, targets=PROJECTIONS, seed=9)


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def update_adapters(model, seed: int) -> None:
    """An optimizer step on the adapters: every A and B changed in place."""
    g = torch.Generator().manual_seed(seed)
    for _, _, adapter in lora_adapters(model).adapters():
        adapter.lora_A.add_(torch.randn(adapter.lora_A.shape, generator=g) * 0.1)
        for b in adapter.lora_B.values():
            b.add_(torch.randn(b.shape, generator=g) * 0.2)


def adapted(overrides: dict) -> torch.nn.Module:
    model = randomized(tiny_gpt(**overrides))
    apply_lora(model, CONFIG)
    update_adapters(model, 0)
    return model.eval()


@pytest.mark.parametrize("overrides", ARCHITECTURES)
def test_engine_steps_compute_what_the_adapted_modules_compute(single_rank_world, overrides):
    """The plain program adds each adapter where the forward hook does: same tokens, logprobs
    to 1e-5, for prefill and decode, with the base stored as the CPU tier stores it."""
    model = adapted(overrides)
    store_frozen_linear_weights(model)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (5, 1, 8, 3)]
    fast = KVCacheRowRunner(model, make_cache(model), VOCAB)
    modules = KVCacheRowRunner(model, make_cache(model), VOCAB)
    assert fast.cached_forward is not None and fast.cached_forward.lora is not None
    modules.cached_forward = None  # the model's own modules, through the hooks
    assert_same_generation(generate(fast, prompts, 10), generate(modules, prompts, 10))


def engine_logits(forward: CachedForward, model, tokens: list[int]) -> torch.Tensor:
    """The engine's logits at the last of ``tokens`` (a fresh cache: prefill + 2 decodes)."""
    cache = make_cache(model, slots=1)
    n = len(tokens)
    for part, start, length in (
        (tokens[: n - 2], 0, n - 2),
        (tokens[n - 2 : n - 1], n - 2, 1),
        (tokens[n - 1 :], n - 1, 1),
    ):
        with cache.step(torch.tensor([0]), torch.tensor([start]), torch.tensor([length])) as step:
            ids, positions = torch.tensor([part]), torch.arange(start, start + length)[None]
            out = forward(ids, positions, step)[0]
    return out


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens]), torch.arange(len(tokens))[None], None)[0, -1]


def test_every_policy_version_generates_with_the_current_adapter(single_rank_world):
    model = adapted(ARCHITECTURES[1].values[0])
    store_frozen_linear_weights(model)
    forward = CachedForward.of(model)
    tokens = torch.randint(2, VOCAB, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    with adapters_disabled(model):
        base = full_logits(model, tokens)
    for version in range(1, 4):
        update_adapters(model, version)  # the optimizer step between two windows ...
        if version == 2:
            forward.transposed.clear()  # ... or the end of a window in between
        current = full_logits(model, tokens)
        got = engine_logits(forward, model, tokens)
        torch.testing.assert_close(got, current, atol=1e-5, rtol=1e-5)
        assert (got - base).abs().max() > 1e-2  # not the base
    with adapters_disabled(model):  # the base, on request (the multi-adapter server's base)
        torch.testing.assert_close(
            engine_logits(forward, model, tokens), base, atol=1e-5, rtol=1e-5
        )


def test_bf16_engine_matches_the_adapted_training_forward(single_rank_world):
    """Under autocast the adapter's products run in bfloat16 in both, as the base's do."""
    model = adapted(ARCHITECTURES[1].values[0])
    store_frozen_linear_weights(model, torch.bfloat16)
    forward = CachedForward.of(model, compute_dtype=torch.bfloat16)
    tokens = torch.randint(2, VOCAB, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.autocast("cpu", torch.bfloat16, cache_enabled=False):
        got = engine_logits(forward, model, tokens).float()
        want = full_logits(model, tokens).float()
    torch.testing.assert_close(got.log_softmax(-1), want.log_softmax(-1), atol=0.02, rtol=0)
