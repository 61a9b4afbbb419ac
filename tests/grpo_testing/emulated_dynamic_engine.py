"""Run megatron-core's real ``DynamicInferenceEngine`` on CPU, against the KV-cache runner.

megatron-core's dynamic context and engine allocate with ``torch.cuda.current_device()`` and time
steps with CUDA events; nothing else in their Python code needs a GPU. This script, run in its own
process (``grpo_testing.emulated_cuda`` patches torch globally), points those calls at the CPU, then
generates the same requests with the CPU tier's ``ContinuousBatchingScheduler`` and with the CUDA tier's
adapter over megatron-core's engine (dynamic context, paged KV cache, ``GPTInferenceWrapper``, the
seeded controller, ``flash_reference`` attention), with and without suspend/resume windows, in
one KV-cache mode (``compat.KV_CACHE_MODES``; the weights do not change, so every mode must give
the local engine's tokens), and prints one JSON line per run. It exercises megatron-core's request
bookkeeping, block tables and attention calls without a GPU; the ``gpu`` tests run the same
comparison on CUDA.

    python tests/grpo_testing/emulated_dynamic_engine.py [--block-size 16] [--kv-cache-mode M]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import torch

REQUESTS = [  # prompt, temperature, max_tokens, seed
    ([2, 3, 4], 0.0, 6, 11),
    ([5], 1.0, 8, 12),
    ([6, 7, 8, 9, 10, 11], 1.0, 5, 13),
    ([3, 3], 0.0, 9, 14),
    ([12, 13, 14, 15], 0.7, 7, 15),
    ([4, 2], 1.0, 4, 16),
]


async def generate(engine, windows: bool, requests=None):
    """All ``requests`` ((prompt, temperature, max_tokens, seed); default ``REQUESTS``) at once;
    with ``windows``, suspend and resume every few loop turns."""
    from megatron.rl.wire import SamplingParams

    engine.start()
    tasks = [
        asyncio.ensure_future(
            engine.generate(p, SamplingParams(temperature=t, max_tokens=n), seed=s)
        )
        for p, t, n, s in (REQUESTS if requests is None else requests)
    ]
    try:
        while not all(t.done() for t in tasks):
            engine.resume()
            for _ in range(3 if windows else 10_000):
                await asyncio.sleep(0)
            if windows:
                engine.suspend()
                engine.steps.stop_followers()
        return [t.result() for t in tasks]
    finally:
        await engine.aclose()


def poison_stale_metadata(runner) -> None:
    """Suspend megatron-core's engine, then fill the request metadata it just freed with the first
    token request 0 generates: an engine that still read the freed tensors after resuming would
    take that token for the termination id and finish requests early (megatron-core 0.16 and 0.17;
    0.18+ has no such references in the controller)."""
    runner.end_window()
    stale = getattr(runner.engine.controller, "_request_metadata", None)
    if stale is not None:
        stale["termination_id"].fill_(4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-mode", default="recompute")
    opts = parser.parse_args()
    root = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(root), str(root / "tests")]
    torch.set_num_threads(1)
    from grpo_testing.emulated_cuda import emulate_cuda_on_cpu

    emulate_cuda_on_cpu()
    from grpo_testing.distributed import init_single_rank_world
    from grpo_testing.models import VOCAB, tiny_gpt

    from megatron.rl.inference.cpu.kv_cache import KVCache
    from megatron.rl.inference.cpu.kv_cache_runner import KVCacheRowRunner
    from megatron.rl.inference.megatron_core import dynamic_engine as de
    from megatron.rl.inference.megatron_core.dynamic_runner import DynamicEngineConfig
    from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
    from megatron.rl.inference.step_group import StepGroup

    init_single_rank_world()
    with torch.no_grad():
        model = tiny_gpt(seed=3).eval()
    c = model.config
    cache = KVCache(c.num_layers, 3, 32, c.num_query_groups, c.kv_channels, torch.float32, "cpu")
    local = ContinuousBatchingScheduler(
        StepGroup(KVCacheRowRunner(model, cache, VOCAB)), SchedulerConfig(3, 32, 1), lambda: 0
    )
    want = asyncio.run(generate(local, windows=False))
    for windows, suspended_first in ((False, False), (True, False), (True, True)):
        config = DynamicEngineConfig(
            3, 32, eos_id=1, block_size_tokens=opts.block_size, kv_cache_mode=opts.kv_cache_mode
        )
        steps = de.build_dynamic_step_group(model, config, VOCAB, 24)
        if suspended_first:  # the trainer's first window ends before any request is added
            poison_stale_metadata(steps.runner)
        engine = ContinuousBatchingScheduler(steps, SchedulerConfig(3, 32, 1), lambda: 0)
        got = asyncio.run(generate(engine, windows))
        same = [g.tokens == w.tokens for g, w in zip(got, want)]
        diff = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.logprobs, w.logprobs))
        print(
            json.dumps(
                {
                    "windows": windows,
                    "kv_cache_mode": config.kv_cache_mode,
                    "suspended_first": suspended_first,
                    "same_tokens": same,
                    "max_logprob_difference": diff,
                    "megatron_steps": steps.runner.steps,
                    "attention": de.flash_reference.attention_backend_name(),
                    "tokens": sum(len(g.tokens) for g in got),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
