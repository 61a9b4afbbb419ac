"""megatron-core's ``DynamicInferenceEngine`` (CPU-emulated) on a RoPE model from an HF checkpoint.

The dynamic engine calls the model with an ``inference_context``, so ``RoPEGPTModel`` leaves
RoPE to megatron-core (its table and ``apply_rotary_emb_query`` over the paged cache) with the
model's exact Llama-3 inverse frequencies. This script (own process: ``emulated_cuda`` patches
torch globally) generates greedy and sampled requests with that engine and with the local engine
(``KVCacheRowRunner`` + ``KVCache``, where ``RoPEGPTModel`` applies RoPE at the given positions) and
prints one JSON line: per request whether the tokens agree, and the largest logprob difference.

    python tests/grpo_testing/emulated_dynamic_engine_hf.py CHECKPOINT_DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import torch

REQUESTS = [  # prompt, temperature, max_tokens, seed
    ([1, 23, 24, 17, 29, 35], 0.0, 12, 11),
    ([1, 31], 0.0, 16, 12),
    ([1, 272, 265, 227, 25, 25, 263, 40, 41], 1.0, 10, 13),
    ([1, 50, 60], 0.8, 14, 14),
]


async def generate(engine):
    from megatron.rl.wire import SamplingParams

    engine.start()
    engine.resume()
    try:
        return await asyncio.gather(
            *(
                engine.generate(p, SamplingParams(temperature=t, max_tokens=n), seed=s)
                for p, t, n, s in REQUESTS
            )
        )
    finally:
        await engine.aclose()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", type=Path)
    opts = parser.parse_args()
    root = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(root), str(root / "tests")]
    torch.set_num_threads(1)
    from grpo_testing.emulated_cuda import emulate_cuda_on_cpu

    emulate_cuda_on_cpu()
    from grpo_testing.distributed import init_single_rank_world
    from grpo_testing.hf_models import build_hf_model

    from megatron.rl.inference.cpu.kv_cache import KVCache
    from megatron.rl.inference.cpu.kv_cache_runner import KVCacheRowRunner
    from megatron.rl.inference.megatron_core import dynamic_engine as de
    from megatron.rl.inference.megatron_core.dynamic_runner import DynamicEngineConfig
    from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
    from megatron.rl.inference.step_group import StepGroup

    init_single_rank_world()
    with torch.no_grad():
        model, hf = build_hf_model(opts.checkpoint)
    a, n = hf.arch, len(REQUESTS)
    cache = KVCache(a.num_layers, n, 32, a.query_groups, a.head_dim, torch.float32, "cpu")
    local = ContinuousBatchingScheduler(
        StepGroup(KVCacheRowRunner(model, cache, hf.vocab_size)),
        SchedulerConfig(n, 32, 2),
        lambda: 0,
    )
    want = asyncio.run(generate(local))
    config = DynamicEngineConfig(n, 32, eos_id=2, block_size_tokens=8)
    steps = de.build_dynamic_step_group(model, config, hf.vocab_size, a.vocab_size)
    engine = ContinuousBatchingScheduler(steps, SchedulerConfig(n, 32, 2), lambda: 0)
    got = asyncio.run(generate(engine))
    print(
        json.dumps(
            {
                "same_tokens": [g.tokens == w.tokens for g, w in zip(got, want)],
                "lengths": [len(w.tokens) for w in want],
                "max_logprob_difference": max(
                    abs(x - y) for g, w in zip(got, want) for x, y in zip(g.logprobs, w.logprobs)
                ),
                "megatron_steps": steps.runner.steps,
                "rotary": type(model.rotary_pos_emb).__name__,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
