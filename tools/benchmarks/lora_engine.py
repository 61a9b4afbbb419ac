"""Part 3 of ``lora.py``: the engine's decode cost of an unmerged LoRA adapter against the
adapters off and the adapter merged into the bfloat16 weights, and each variant's logprob error
against the training forward. Runs in ``lora.py``'s process, last (it starts torch.distributed).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any


def run_engine(opts: argparse.Namespace) -> dict[str, Any]:
    """Part 3: the engine's cost of an unmerged adapter, and the error of merging it into the
    bfloat16 weights instead (SmolLM2-135M, ``--bf16``, rank ``--rank`` with B ~ N(0, 0.02^2),
    the recipe's model as the CPU tier builds it: frozen bfloat16 base stored transposed).

    Decode: ``--engine-batch`` requests of ``--engine-tokens`` new tokens each on the trainer's
    engine, interleaved ``--engine-repeats`` times: the adapter unmerged (each adapted layer: one
    more product with A, one with each B), the adapters off (the base's cost, = a merged model's
    per step), and a model whose bfloat16 weights have the adapter merged in. Error: over a batch
    of prompts + generated tokens, the mean KL and the largest |log p| difference between the
    training forward (modules, unmerged, autocast) and each engine variant."""
    import asyncio

    import torch

    from megatron.rl.inference.cpu.kv_cache import KVCache
    from megatron.rl.inference.cpu.kv_cache_runner import KVCacheRowRunner
    from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
    from megatron.rl.inference.step_group import StepGroup
    from megatron.rl.lora.frozen import store_frozen_linear_weights
    from megatron.rl.lora.model import adapters_disabled, lora_adapters, merged_state_dict
    from megatron.rl.models.hf.gguf import SMOLLM2, packaged_checkpoint
    from megatron.rl.wire import SamplingParams
    from megatron.trainer import config as trainer_config
    from megatron.trainer.model.hf_io import weight_loader
    from megatron.trainer.model.provider import build_model
    from megatron.trainer.runtime.initialize import initialize_distributed
    from megatron.trainer.tiers.cpu import CPUTier
    from tools.benchmarks.common import Stopwatch
    from tools.benchmarks.hf_shapes import trainer_args

    torch.set_num_threads(opts.threads)
    ckpt = packaged_checkpoint(SMOLLM2)
    flags = ["--bf16", "--lora-rank", str(opts.rank), "--lora-alpha", "32"]
    cfg = trainer_args(ckpt, 256, flags)
    ctx = initialize_distributed(cfg)
    vocab = trainer_config.tokenizer(cfg).vocab_size
    tier = CPUTier(trainer_config.tier_config(cfg), ctx)
    lora = tier.build_model(vocab, weight_loader(tier.config.model)).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, _, adapter in lora_adapters(lora).adapters():
            for b in adapter.lora_B.values():
                b.copy_(torch.randn(b.shape, generator=g) * 0.02)
    base_cfg = trainer_args(ckpt, 256, ["--bf16"])
    merged = build_model(trainer_config.model_build(base_cfg), vocab, ctx.device, initialize=False)
    merged.load_state_dict(merged_state_dict(lora))
    merged.requires_grad_(False)
    store_frozen_linear_weights(merged, torch.bfloat16)  # as the LoRA base: bf16, transposed
    merged.eval()
    prompts = [[1 + (7 * i + j) % 4000 for j in range(24)] for i in range(opts.engine_batch)]
    seq = 24 + opts.engine_tokens

    def decode(model, adapters_on: bool) -> tuple[float, list[list[int]], list]:
        c = model.config
        cache = KVCache(
            c.num_layers,
            len(prompts),
            seq,
            c.num_query_groups,
            c.kv_channels,
            torch.bfloat16,
            torch.device("cpu"),
        )
        runner = KVCacheRowRunner(model, cache, vocab, compute_dtype=torch.bfloat16)
        engine = ContinuousBatchingScheduler(
            StepGroup(runner), SchedulerConfig(len(prompts), seq, -1), lambda: 0
        )
        sampling = SamplingParams(max_tokens=opts.engine_tokens)

        async def go():
            engine.start()
            engine.resume()
            with Stopwatch() as watch:
                outs = await asyncio.gather(
                    *(engine.generate(p, sampling, seed=i) for i, p in enumerate(prompts))
                )
            await engine.aclose()
            return watch, outs

        if adapters_on:
            watch, outs = asyncio.run(go())
        else:
            with adapters_disabled(model):
                watch, outs = asyncio.run(go())
        return watch.wall, [p + o.tokens for p, o in zip(prompts, outs)], outs

    variants = {
        "adapter unmerged": (lora, True),
        "adapters off (base)": (lora, False),
        "merged into bf16": (merged, True),
    }
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    outputs = {}
    for r in range(opts.engine_repeats):
        order = list(variants) if r % 2 == 0 else list(variants)[::-1]
        for name in order:
            model, on = variants[name]
            wall, sequences, outs = decode(model, on)
            seconds[name].append(wall)
            outputs[name] = (sequences, outs)
    tokens = len(prompts) * opts.engine_tokens
    sequences, outs = outputs["adapter unmerged"]
    ids = torch.tensor([s[:-1] for s in sequences])  # (B, T)
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, cache_enabled=False):
        train_logp = torch.log_softmax(lora(ids, positions, None).float()[..., :vocab], -1)
    generated = torch.tensor([o.tokens for o in outs])  # (B, N)
    trained = train_logp[:, 23:].gather(-1, generated[..., None])[..., 0]  # (B, N)
    errors = {}
    for name in ("adapter unmerged", "merged into bf16"):
        model, _ = variants[name]
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, cache_enabled=False):
            engine_logp = torch.log_softmax(model(ids, positions, None).float()[..., :vocab], -1)
        if name == "adapter unmerged":  # the engine's own logprobs of its sampled tokens
            got = torch.tensor([o.logprobs for o in outs])
        else:  # the merged model's logprobs of the same tokens
            got = engine_logp[:, 23:].gather(-1, generated[..., None])[..., 0]
        ratio = got - trained
        errors[name] = {
            "mismatch_kl": float((torch.exp(-ratio) - 1 + ratio).mean()),  # k3, as mismatch_kl
            "max_abs_logprob_difference": float(ratio.abs().max()),
        }
    return {
        "batch": len(prompts),
        "new_tokens": opts.engine_tokens,
        "repeats": opts.engine_repeats,
        "tokens_per_second": {n: tokens / statistics.median(s) for n, s in seconds.items()},
        "seconds": seconds,
        "errors": errors,
    }
