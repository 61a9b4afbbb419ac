"""The real inference engine (scheduler + KV-cache runner) over a tiny Hugging Face model, for
tests of what generates through it: the inference server, chat prompts, example environments."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import torch

from megatron.rl.inference.cpu.kv_cache import KVCache
from megatron.rl.inference.cpu.kv_cache_runner import KVCacheRowRunner
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.inference.step_group import StepGroup
from megatron.rl.models.hf.tokenizer import HuggingFaceTokenizer


def load_hf_policy(directory: Path) -> tuple[torch.nn.Module, HuggingFaceTokenizer]:
    """Our GPTModel of the checkpoint in ``directory`` (eval mode) and its tokenizer.

    Needs a torch.distributed world (the ``single_rank_world`` fixture)."""
    from grpo_testing.hf_models import build_hf_model

    model, _ = build_hf_model(directory)
    return model, HuggingFaceTokenizer(directory)


@contextlib.asynccontextmanager
async def running_engine(
    model: torch.nn.Module,
    vocab_size: int,
    eos_id: int,
    max_requests: int = 8,
    max_seq_len: int = 128,
    policy_version: Callable[[], int] = lambda: 0,
) -> AsyncIterator[ContinuousBatchingScheduler]:
    """A started, resumed ``ContinuousBatchingScheduler`` stepping ``model`` through a
    ``KVCacheRowRunner`` (tokens sampled only below ``vocab_size``); closed on exit."""
    mc = model.config
    cache = KVCache(
        num_layers=mc.num_layers,
        num_slots=max_requests,
        max_seq_len=max_seq_len,
        num_kv_heads=mc.num_query_groups,
        head_dim=mc.kv_channels,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    steps = StepGroup(KVCacheRowRunner(model, cache, vocab_size))
    config = SchedulerConfig(max_requests=max_requests, max_seq_len=max_seq_len, eos_id=eos_id)
    engine = ContinuousBatchingScheduler(steps, config, policy_version)
    engine.start()
    engine.resume()
    try:
        yield engine
    finally:
        await engine.aclose()
