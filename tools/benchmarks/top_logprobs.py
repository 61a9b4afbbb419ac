"""The cost of alternatives per token (``top_logprobs`` k = 0, 5, 20) and of scoring a prompt, on
the trainer's engine with SmolLM2-135M-Instruct (CPU tier, ``--bf16``, its 49152-token vocabulary).

Decode: ``--batch`` requests of ``--tokens`` new tokens each, every k in turn, interleaved over
``--repeats`` rounds (the order reversed every other round), so drift of a shared machine falls on
all of them alike; the figure is seconds per generated token (wall / tokens), and its ratio to
k = 0 in the same round. Scoring: ``--batch`` prompts of ``--score-length`` tokens scored one by
one (a plain forward each) with k = 0 and 5 alternatives, seconds per scored token. Exactness, in
float32 and in bfloat16: the generated tokens' k = 20 alternatives against the same positions
scored by the plain forward (the share of positions with the same 20 ids in the same order, with
the same most likely id, the mean share of the 20 ids both list, and the largest |logprob
difference| of an id both list).

    python -m tools.benchmarks.top_logprobs [--threads 2] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

KS = (0, 5, 20)


def measure(opts: argparse.Namespace) -> dict[str, Any]:
    """Every figure of the module docstring, as one JSON-ready dict."""
    import torch

    from megatron.rl.inference.interface import LocalInferenceInterface
    from megatron.rl.models.hf.gguf import SMOLLM2, packaged_checkpoint
    from megatron.rl.models.hf.tokenizer import HuggingFaceTokenizer
    from megatron.rl.wire import InferenceRequest, SamplingParams, ScoreRequest
    from megatron.trainer import config as trainer_config
    from megatron.trainer.model.hf_io import weight_loader
    from megatron.trainer.runtime.initialize import initialize_distributed
    from megatron.trainer.tiers.cpu import CPUTier
    from tools.benchmarks.hf_shapes import trainer_args

    torch.set_num_threads(opts.threads)
    ckpt = packaged_checkpoint(SMOLLM2)
    seq = opts.score_length + opts.tokens + 8
    tokenizer = HuggingFaceTokenizer(ckpt)
    models, ctx = {}, None
    for precision, flags in (("bf16", ["--bf16"]), ("fp32", [])):
        cfg = trainer_args(ckpt, seq, flags)
        ctx = ctx or initialize_distributed(cfg)
        tier = CPUTier(trainer_config.tier_config(cfg), ctx)
        loaded = tier.build_model(tokenizer.vocab_size, weight_loader(tier.config.model))
        models[precision] = loaded.eval()
    prompts = [[1 + (7 * i + j) % 4000 for j in range(24)] for i in range(opts.batch)]
    scored = [
        [1 + (11 * i + j) % 4000 for j in range(opts.score_length)] for i in range(opts.batch)
    ]

    async def session(work, precision: str = "bf16"):
        from megatron.rl.inference.cpu.kv_cache import KVCache
        from megatron.rl.inference.cpu.kv_cache_runner import KVCacheRowRunner
        from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
        from megatron.rl.inference.step_group import StepGroup

        model = models[precision]
        dtype = torch.bfloat16 if precision == "bf16" else None
        c = model.config
        cache = KVCache(
            c.num_layers,
            opts.batch,
            seq,
            c.num_query_groups,
            c.kv_channels,
            dtype or torch.float32,
            "cpu",
        )
        runner = KVCacheRowRunner(model, cache, tokenizer.vocab_size, None, dtype)
        engine = ContinuousBatchingScheduler(
            StepGroup(runner), SchedulerConfig(opts.batch, seq, -1), lambda: 0
        )
        engine.start()
        engine.resume()
        try:
            return await work(LocalInferenceInterface(engine, tokenizer))
        finally:
            await engine.aclose()

    def decode(k: int, precision: str = "bf16") -> tuple[float, list]:
        sampling = SamplingParams(max_tokens=opts.tokens, top_logprobs=k)

        async def work(inference):
            start = time.perf_counter()
            outs = await asyncio.gather(
                *(
                    inference.generate(InferenceRequest(prompt_tokens=p, sampling=sampling, seed=i))
                    for i, p in enumerate(prompts)
                )
            )
            return time.perf_counter() - start, outs

        return asyncio.run(session(work, precision))

    def score(k: int) -> float:
        async def work(inference):
            start = time.perf_counter()
            for p in scored:
                await inference.score(ScoreRequest(prompt_tokens=p, top_logprobs=k))
            return time.perf_counter() - start

        return asyncio.run(session(work))

    decode(0)  # warm-up: first-touch allocations, the forward's weight copies
    per_token: dict[int, list[float]] = {k: [] for k in KS}
    ratios: dict[int, list[float]] = {k: [] for k in KS}
    outputs = {}
    for r in range(opts.repeats):
        walls = {}
        for k in KS if r % 2 == 0 else KS[::-1]:
            walls[k], outputs[k] = decode(k)
            per_token[k].append(walls[k] / (opts.batch * opts.tokens))
        for k in KS:
            ratios[k].append(walls[k] / walls[0])
    scoring = {k: score(k) / (opts.batch * (opts.score_length - 1)) for k in (0, 5)}

    exactness = {}
    for precision in ("fp32", "bf16"):
        outs = decode(20, precision)[1]

        async def rescored(inference, outs=outs):  # the alternatives against a plain forward
            requests = [
                ScoreRequest(prompt_tokens=o.prompt_tokens + o.tokens, top_logprobs=20)
                for o in outs
            ]
            return [await inference.score(r) for r in requests]

        plain = asyncio.run(session(rescored, precision))
        same, first, overlap, positions, worst = 0, 0, 0.0, 0, 0.0
        for out, scored in zip(outs, plain):
            start = len(out.prompt_tokens) - 1
            for i, generated in enumerate(out.top_logprobs):
                forward = dict(scored.top_logprobs[start + i])
                ids = [t for t, _ in generated]
                positions += 1
                same += ids == list(forward)
                first += ids[0] == next(iter(forward))
                overlap += len(set(ids) & set(forward)) / len(ids)
                for token, value in generated:
                    if token in forward:
                        worst = max(worst, abs(value - forward[token]))
        exactness[precision] = {
            "same_ids_share": same / positions,
            "same_top1_share": first / positions,
            "mean_id_overlap": overlap / positions,
            "max_abs_logprob_difference": worst,
        }
    return {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized), --bf16, CPU tier",
        "vocabulary": tokenizer.vocab_size,
        "batch": opts.batch,
        "new_tokens": opts.tokens,
        "repeats": opts.repeats,
        "threads": opts.threads,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "torch": torch.__version__,
        "decode_seconds_per_token": {str(k): statistics.median(v) for k, v in per_token.items()},
        "decode_ratio_to_k0": {str(k): statistics.median(v) for k, v in ratios.items()},
        "score_seconds_per_token": {str(k): v for k, v in scoring.items()},
        "score_length": opts.score_length,
        "alternatives_vs_plain_forward": exactness,
    }


def report(result: dict[str, Any]) -> str:
    """The markdown table of ``result``."""
    d, r = result["decode_seconds_per_token"], result["decode_ratio_to_k0"]
    s = result["score_seconds_per_token"]
    exact = result["alternatives_vs_plain_forward"]
    lines = [
        "# Top logprobs: cost per token",
        "",
        f"{result['model']}, vocabulary {result['vocabulary']}, {result['machine']}, torch "
        f"{result['torch']}. Decode: {result['batch']} requests x {result['new_tokens']} new "
        f"tokens, median of {result['repeats']} interleaved rounds "
        "(`python -m tools.benchmarks.top_logprobs`).",
        "",
        "| k (`top_logprobs`) | decode ms / token | ratio to k=0 (same round) |",
        "| --- | --- | --- |",
    ]
    for k in KS:
        lines.append(f"| {k} | {1000 * d[str(k)]:.2f} | {r[str(k)]:.3f} |")
    lines += [
        "",
        f"Scoring (echo, a plain forward of {result['score_length']} tokens): "
        f"{1000 * s['0']:.3f} ms per scored token without alternatives, "
        f"{1000 * s['5']:.3f} ms with 5.",
        "",
        "Generated alternatives (k=20) against a plain forward of the same sequence:",
        "",
        "| precision | same 20 ids, same order | same most likely id | ids both list "
        "| largest abs logprob difference |",
        "| --- | --- | --- | --- | --- |",
    ]
    for precision, e in exact.items():
        lines.append(
            f"| {precision} | {100 * e['same_ids_share']:.1f}% | "
            f"{100 * e['same_top1_share']:.1f}% | {100 * e['mean_id_overlap']:.1f}% | "
            f"{e['max_abs_logprob_difference']:.2e} |"
        )
    lines += [
        "",
        "float32: the same numbers to rounding. bfloat16: the engine's cached forward and the "
        "plain forward round differently, as the engine's and the trainer's logprobs do "
        "(`mismatch_kl`; lora.md's engine table).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--score-length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    opts = parser.parse_args()
    result = measure(opts)
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "top_logprobs.json").write_text(json.dumps(result, indent=2) + "\n")
    (opts.out / "top_logprobs.md").write_text(report(result))
    print(report(result))


if __name__ == "__main__":
    main()
