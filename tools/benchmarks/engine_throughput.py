"""Engine throughput: generated tokens/s of the scheduler + KV-cache runner vs naive loops and HF
``generate``.

    python tools/benchmarks/engine_throughput.py [--batch 64 --new-tokens 32 --repeats 7]

Measures sampled tokens per second (prefill included, EOS disabled so every request generates
exactly ``--new-tokens``; temperature 1, no top-k/top-p) for the same prompts on two models of
the same shape and parameter count (the trainer's default: 2 layers, hidden 64, 4 heads, MLP
256, vocabulary padded to 128, random init):

* ``engine, batch 64``: the trainer's ``ContinuousBatchingScheduler`` (continuous batching, per-slot
  KV cache) on the megatron-core ``GPTModel``, ``--batch`` requests in flight at once;
* ``engine, one at a time``: the same engine, requests awaited one after another (batch 1);
* ``HF generate, batch 64``: ``transformers`` ``GPT2LMHeadModel.generate`` (sampling, KV cache)
  on the equivalent GPT-2, all ``--batch`` prompts in one call;
* ``HF generate, one at a time``: ``generate`` per prompt;
* ``recompute, batch 64``: the megatron-core model re-running the whole prefix every token
  (no KV cache).

The one-at-a-time loops run ``--serial-requests`` requests (tokens/s does not depend on how
many). All configurations run in one process, interleaved (rotating order) ``--repeats`` times;
tokens/s is the median, and each ratio to the engine at batch 64 is the median of the per-repeat
ratios (each measured back to back).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.rl.inference.cpu.kv_cache import KVCache  # noqa: E402
from megatron.rl.inference.cpu.kv_cache_runner import KVCacheRowRunner  # noqa: E402
from megatron.rl.inference.sampling import sample_tokens  # noqa: E402
from megatron.rl.inference.scheduler import (  # noqa: E402
    ContinuousBatchingScheduler,
    SchedulerConfig,
)
from megatron.rl.inference.step_group import StepGroup  # noqa: E402
from megatron.rl.tokenizer import CharTokenizer  # noqa: E402
from megatron.rl.wire import SamplingParams  # noqa: E402
from megatron.trainer.config import model_build  # noqa: E402
from megatron.trainer.flags.parse import check  # noqa: E402
from megatron.trainer.model.provider import build_model  # noqa: E402
from megatron.trainer.runtime.initialize import initialize_distributed  # noqa: E402
from tools.benchmarks.common import Stopwatch  # noqa: E402
from tools.benchmarks.hf_models import gpt2_like, unused_ids  # noqa: E402

ENGINE_B = "engine, batch {b}"
NAMES = [
    ENGINE_B,
    "engine, one at a time",
    "HF generate, batch {b}",
    "HF generate, one at a time",
    "recompute, batch {b}",
]


def time_engine(
    model, prompts: list[list[int]], new_tokens: int, concurrent: bool, vocab: int | None = None
) -> Stopwatch:
    """Time for the engine (scheduler + KV-cache runner) to generate ``new_tokens`` for every
    prompt, all at once (``concurrent``) or one at a time; ``vocab``: the tokenizer's size
    (default: the character tokenizer's)."""
    c = model.config
    seq = max(len(p) for p in prompts) + new_tokens
    slots = len(prompts) if concurrent else 1
    cache = KVCache(
        c.num_layers,
        slots,
        seq,
        c.num_query_groups,
        c.kv_channels,
        torch.float32,
        torch.device("cpu"),
    )
    vocab = CharTokenizer().vocab_size if vocab is None else vocab
    runner = KVCacheRowRunner(model, cache, vocab)
    # eos_id=-1: no token ends a request, so each runs exactly to its budget
    engine = ContinuousBatchingScheduler(
        StepGroup(runner), SchedulerConfig(slots, seq, -1), lambda: 0
    )
    sampling = SamplingParams(max_tokens=new_tokens)

    async def generate() -> Stopwatch:
        engine.start()
        engine.resume()
        with Stopwatch() as watch:
            if concurrent:
                outs = await asyncio.gather(
                    *(engine.generate(p, sampling, seed=i) for i, p in enumerate(prompts))
                )
            else:
                outs = [await engine.generate(p, sampling, seed=i) for i, p in enumerate(prompts)]
        await engine.aclose()
        assert all(len(o.tokens) == new_tokens for o in outs)
        return watch

    return asyncio.run(generate())


@torch.no_grad()
def time_hf(model, prompts: list[list[int]], new_tokens: int, batched: bool) -> Stopwatch:
    """Time for HF ``generate`` (sampling, KV cache) on every prompt."""
    kwargs = dict(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        suppress_tokens=unused_ids(model.config.vocab_size),
        pad_token_id=CharTokenizer.pad_id,
        use_cache=True,
    )
    batches = [prompts] if batched else [[p] for p in prompts]
    with Stopwatch() as watch:
        for batch in batches:
            ids = torch.tensor(batch)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
            assert out.shape[1] == ids.shape[1] + new_tokens
    return watch


@torch.no_grad()
def time_recompute(model, prompts: list[list[int]], new_tokens: int) -> Stopwatch:
    """Time to decode the batch re-running the whole prefix for every new token."""
    vocab = CharTokenizer().vocab_size
    seqs = torch.tensor(prompts)
    b = seqs.shape[0]
    g = torch.Generator().manual_seed(0)
    with Stopwatch() as watch:
        for _ in range(new_tokens):
            positions = torch.arange(seqs.shape[1])[None].expand_as(seqs)
            logits = model(seqs, positions, None)[:, -1].float()  # (B, V)
            logits[:, vocab:] = float("-inf")
            tokens, _ = sample_tokens(
                logits, torch.ones(b), torch.ones(b), torch.zeros(b), torch.rand(b, generator=g)
            )
            seqs = torch.cat([seqs, tokens[:, None]], dim=1)
    return watch


def run(opts: argparse.Namespace) -> dict[str, Any]:
    """Interleaved measurements of every configuration; returns tokens/s and ratios."""
    seq = opts.prompt_length + opts.new_tokens
    cfg, errors = check(["--seq-length", str(seq)])
    assert cfg is not None, errors
    ctx = initialize_distributed(cfg)
    torch.set_num_threads(opts.threads)
    tok = CharTokenizer()
    ours = build_model(model_build(cfg), tok.vocab_size, ctx.device).eval()
    arch = cfg.architecture_flags
    hf = gpt2_like(
        arch["num_layers"],
        arch["hidden_size"],
        arch["num_attention_heads"],
        arch["ffn_hidden_size"],
        ours.embedding.word_embeddings.weight.shape[0],
        arch["max_position_embeddings"],
        cfg.training.seed,
    ).eval()
    params = {
        "megatron-core GPTModel": sum(p.numel() for p in ours.parameters()),
        "HF GPT2LMHeadModel": sum(p.numel() for p in hf.parameters()),
    }
    prompts = [tok.encode(f"{i:0{opts.prompt_length - 1}d}=") for i in range(opts.batch)]
    serial = prompts[: opts.serial_requests]
    names = [n.format(b=opts.batch) for n in NAMES]
    runs: list[tuple[str, Callable[[], Stopwatch], int]] = [
        (names[0], lambda: time_engine(ours, prompts, opts.new_tokens, True), len(prompts)),
        (names[1], lambda: time_engine(ours, serial, opts.new_tokens, False), len(serial)),
        (names[2], lambda: time_hf(hf, prompts, opts.new_tokens, True), len(prompts)),
        (names[3], lambda: time_hf(hf, serial, opts.new_tokens, False), len(serial)),
        (names[4], lambda: time_recompute(ours, prompts, opts.new_tokens), len(prompts)),
    ]
    for _, fn, _ in runs:  # warm-up (allocator, lazy imports, first-call paths)
        fn()
    rates: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    uncontended: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    wall = runq = 0.0
    for rep in range(opts.repeats):
        shift = rep % len(runs)
        for name, fn, requests in runs[shift:] + runs[:shift]:
            watch = fn()
            rates[name].append(requests * opts.new_tokens / watch.wall)
            if watch.runq is not None:
                uncontended[name].append(requests * opts.new_tokens / (watch.wall - watch.runq))
                wall, runq = wall + watch.wall, runq + watch.runq

    def ratio(per_run: dict[str, list[float]], name: str) -> float | None:
        pairs = list(zip(per_run[names[0]], per_run[name]))
        return statistics.median(e / r for e, r in pairs) if pairs else None

    results = []
    for name, _, requests in runs:
        results.append(
            {
                "name": name,
                "requests": requests,
                "tokens_per_s": statistics.median(rates[name]),
                "engine_b64_over_this": ratio(rates, name),
                "uncontended_engine_b64_over_this": ratio(uncontended, name),
            }
        )
    return {
        "batch": opts.batch,
        "new_tokens": opts.new_tokens,
        "prompt_length": opts.prompt_length,
        "repeats": opts.repeats,
        "threads": torch.get_num_threads(),
        "runq_fraction": runq / wall if wall else None,
        "parameters": params,
        "results": results,
    }


def markdown(res: dict[str, Any]) -> str:
    """The throughput comparison as a markdown table."""
    lines = [
        "| generator | requests | tokens/s (median) | engine batch-64 tokens/s ÷ this |"
        " same, without run-queue wait |",
        "|---|---|---|---|---|",
    ]
    for r in res["results"]:
        unc = r["uncontended_engine_b64_over_this"]
        lines.append(
            f"| {r['name']} | {r['requests']} | {r['tokens_per_s']:.0f} | "
            f"**{r['engine_b64_over_this']:.2f}x** | "
            + ("n/a" if unc is None else f"{unc:.2f}x")
            + " |"
        )
    runq = res.get("runq_fraction")
    if runq is not None:
        lines.append(f"\nRun-queue wait (contention) during the measurements: {runq:.0%}.")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (shared with ``run_all.py``)."""
    parser.add_argument("--batch", type=int, default=64, help="Concurrent requests.")
    parser.add_argument("--new-tokens", type=int, default=32, help="Tokens per request.")
    parser.add_argument("--prompt-length", type=int, default=6, help="Prompt tokens.")
    parser.add_argument("--serial-requests", type=int, default=8, help="One-at-a-time runs.")
    parser.add_argument("--repeats", type=int, default=7, help="Interleaved repetitions.")
    parser.add_argument("--threads", type=int, default=1, help="Torch threads.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    parser.add_argument("--json", type=Path, default=None, help="Also write the results here.")
    opts = parser.parse_args()
    res = run(opts)
    print(markdown(res))
    if opts.json:
        opts.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
