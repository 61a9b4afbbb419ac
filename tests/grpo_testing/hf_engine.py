"""The real inference engine (scheduler + KV-cache runner) over a tiny Hugging Face model, for
tests of what generates through it: the inference server, chat prompts, example environments."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

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


async def serve_on_port(
    model: torch.nn.Module,
    tokenizer: HuggingFaceTokenizer,
    work: Callable[[str], Any],
    max_seq_len: int = 64,
    policy_version: Callable[[], int] = lambda: 0,
) -> Any:
    """``await work(base_url)`` against the inference server over ``running_engine`` on a real
    local port; the server and the engine are stopped afterwards."""
    from megatron.rl.inference.interface import LocalInferenceInterface
    from megatron.rl.server.http import EmbeddedServer
    from megatron.rl.server.inference_server import create_inference_app

    vocab, eos = tokenizer.vocab_size, tokenizer.eos_id
    async with running_engine(model, vocab, eos, 4, max_seq_len, policy_version) as engine:
        app = create_inference_app(LocalInferenceInterface(engine, tokenizer), tokenizer)
        server = await EmbeddedServer.start(app, "127.0.0.1", 0)
        try:
            return await work(server.url)
        finally:
            await server.stop()
