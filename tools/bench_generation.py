"""Generation benchmark of the local engine against full recomputation, measured side by side.

    python tools/bench_generation.py [--prompts 8 --group-size 8 --new-tokens 16]

One "GRPO step" of generation = prompts x group-size requests of ``--new-tokens`` tokens each
(EOS is masked out so every request generates exactly that many), on the default tiny model
(2 layers, 64 wide). Timed twice in one process, alternating, median over ``--repeats``:

* engine: the continuous-batching ``LocalInferenceEngine`` with its per-slot KV cache;
* recompute: the same batch decoded by re-running the whole prefix every token (what a
  generator without a KV cache does).

DESIGN.md's reference point for this shape on two cores is about 0.06 s per step for HF
``generate`` with a KV cache inside TRL's GRPOTrainer (measured elsewhere, not by this tool).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.rl.inference.engine import LocalEngineConfig, LocalInferenceEngine  # noqa: E402
from megatron.rl.inference.model_runner import ModelRunner  # noqa: E402
from megatron.rl.inference.sampling import sample_tokens  # noqa: E402
from megatron.rl.inference.step_group import StepGroup  # noqa: E402
from megatron.rl.models.kv_cache import KVCache  # noqa: E402
from megatron.rl.tokenizer import CharTokenizer  # noqa: E402
from megatron.rl.wire import SamplingParams  # noqa: E402
from megatron.training.arguments import build_parser, validate_args  # noqa: E402
from megatron.training.initialize import initialize_distributed  # noqa: E402
from megatron.training.model_provider import build_model  # noqa: E402


class NoEosRunner(ModelRunner):
    """The engine's runner with EOS masked, so every request runs to its token budget."""

    def _gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        logits = super()._gather_vocab(logits)
        logits[:, CharTokenizer.eos_id] = float("-inf")
        return logits


def engine_step(model, prompts: list[list[int]], new_tokens: int, seq_len: int) -> float:
    """Seconds to generate ``new_tokens`` for every prompt through the engine."""
    c = model.config
    cache = KVCache(c.num_layers, len(prompts), seq_len, c.num_query_groups, c.kv_channels,
                    torch.float32, torch.device("cpu"))  # fmt: skip
    runner = NoEosRunner(model, cache, CharTokenizer().vocab_size)
    engine = LocalInferenceEngine(
        StepGroup(runner), LocalEngineConfig(len(prompts), seq_len, eos_id=-1), lambda: 0
    )
    sampling = SamplingParams(max_tokens=new_tokens)

    async def run() -> float:
        engine.start()
        engine.resume()
        start = time.perf_counter()
        outs = await asyncio.gather(
            *(engine.generate(p, sampling, seed=i) for i, p in enumerate(prompts))
        )
        elapsed = time.perf_counter() - start
        await engine.aclose()
        assert all(len(o.tokens) == new_tokens for o in outs)
        return elapsed

    return asyncio.run(run())


@torch.no_grad()
def recompute_step(model, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds to generate the same batch re-running the full prefix for every token."""
    model.eval()
    vocab = CharTokenizer().vocab_size
    width = max(len(p) for p in prompts)
    seqs = torch.tensor([[CharTokenizer.pad_id] * (width - len(p)) + p for p in prompts])
    g = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for _ in range(new_tokens):
        positions = torch.arange(seqs.shape[1])[None].expand_as(seqs)
        logits = model(seqs, positions, None)[:, -1].float()  # (B, V)
        logits[:, vocab:] = float("-inf")
        logits[:, CharTokenizer.eos_id] = float("-inf")
        b = seqs.shape[0]
        tokens, _ = sample_tokens(logits, torch.ones(b), torch.ones(b), torch.zeros(b),
                                  torch.rand(b, generator=g))  # fmt: skip
        seqs = torch.cat([seqs, tokens[:, None]], dim=1)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompt-length", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=7)
    opts = parser.parse_args()

    args = build_parser().parse_args([])
    args.seq_length = opts.prompt_length + opts.new_tokens
    assert not validate_args(args, world_size=1, cuda=False)
    ctx = initialize_distributed(args)
    model = build_model(args, CharTokenizer().vocab_size, ctx.device)
    tok = CharTokenizer()
    prompts = [tok.encode(f"{i:0{opts.prompt_length - 1}d}=")[: opts.prompt_length]
               for i in range(opts.prompts) for _ in range(opts.group_size)]  # fmt: skip
    engine_s, recompute_s = [], []
    for _ in range(opts.repeats):  # alternate, so both see the same machine state
        engine_s.append(engine_step(model, prompts, opts.new_tokens, args.seq_length))
        recompute_s.append(recompute_step(model, prompts, opts.new_tokens))
    tokens = len(prompts) * opts.new_tokens
    e, r = statistics.median(engine_s), statistics.median(recompute_s)
    print(
        f"{len(prompts)} requests x {opts.new_tokens} new tokens (prompt {opts.prompt_length}), "
        f"{torch.get_num_threads()} threads, median of {opts.repeats}\n"
        f"engine (KV cache, continuous batching): {e * 1000:.1f} ms/step, {tokens / e:.0f} tok/s\n"
        f"recompute (no cache):                   {r * 1000:.1f} ms/step, {tokens / r:.0f} tok/s\n"
        f"speed-up: {r / e:.2f}x"
    )


if __name__ == "__main__":
    main()
