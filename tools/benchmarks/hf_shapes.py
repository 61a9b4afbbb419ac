"""Engine decode throughput and matmul efficiency on Llama-style Hugging Face checkpoints.

    python tools/benchmarks/hf_shapes.py [--shapes 1m 25m] [--batch 64 --new-tokens 32]

For each shape in ``SHAPES`` a random Llama checkpoint (model + BPE tokenizer) is written with
``megatron.rl.models.hf.tiny.make_tiny_checkpoint`` (no download), then in one process:

* the trainer's model is built from it exactly as ``pretrain_grpo.py --hf-checkpoint DIR`` does
  (``config.json`` -> architecture, weights mapped by ``load_hf_checkpoint``);
* Hugging Face's ``LlamaForCausalLM`` is loaded from the same directory with ``from_pretrained``.

Interleaved (rotating order, ``--repeats`` times) it times generated tokens/s with the same
prompts and sampling settings (temperature 1, no top-k/top-p, every request runs to
``--new-tokens``: EOS never ends a request; ids past the tokenizer's vocabulary never sampled):

* ``engine, batch B``: the trainer's ``ContinuousBatchingScheduler`` + ``KVCacheRowRunner``;
* ``engine, one at a time``: the same engine, requests awaited one after another;
* ``HF generate, batch B``: ``generate`` (sampling, KV cache) on all prompts in one call.

Matmul efficiency (``--matmul``): the machine's fp32 matmul rate on the model's own GEMM shapes
(every linear layer's weight against the rows a decode step or a training micro-batch feeds it,
timed with ``torch.mm`` in the same process) against the FLOP rate the engine's decode steps and
a training step (forward + backward of the GRPO loss's model part, plus the optimizer) reach:
achieved FLOP/s = 2 x (matmul parameters) x tokens (x3 for forward + backward) / seconds.
Attention score FLOPs are not counted on either side (they are < 2% at these lengths).

Matmul rates, training step times and profiles are in CPU time of the (only) working thread.

Profiles: ``torch.profiler`` over 10 engine decode steps (``KVCacheRowRunner.run`` on ``--batch``
one-token rows at position 20 of every slot: forward with the KV cache and sampling) and over one
training step (as above); the operators with the most self CPU time, their share of all
operators' time, and the share of the step's wall time spent outside any operator (Python and
dispatch).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.rl.models.hf.tiny import make_tiny_checkpoint  # noqa: E402
from megatron.trainer import config as trainer_config  # noqa: E402
from megatron.trainer.config import model_build  # noqa: E402
from megatron.trainer.flags.parse import check  # noqa: E402
from megatron.trainer.flags.run import RunConfig  # noqa: E402
from megatron.trainer.model.hf_io import weight_loader  # noqa: E402
from megatron.trainer.model.provider import build_model  # noqa: E402
from megatron.trainer.runtime.initialize import initialize_distributed  # noqa: E402
from tools.benchmarks.common import Stopwatch  # noqa: E402
from tools.benchmarks.engine_throughput import time_engine  # noqa: E402
from tools.benchmarks.matmul_efficiency import matmul_efficiency, profiles  # noqa: E402

SHAPES: dict[str, dict[str, int]] = {
    "1m": dict(hidden_size=128, num_layers=5, num_attention_heads=4, intermediate_size=352),
    "25m": dict(hidden_size=512, num_layers=8, num_attention_heads=8, intermediate_size=1408),
}
"""Llama (multi-head attention, SwiGLU, RMSNorm, RoPE, untied output) shapes; ~1.1M and ~26M
parameters with the tools' 300-token BPE tokenizer."""

NAMES = ["engine, batch {b}", "engine, one at a time", "HF generate, batch {b}"]


def write_checkpoint(shape: str, out: Path) -> Path:
    """The random Llama checkpoint of ``shape`` (model + tokenizer) in ``out``."""
    return make_tiny_checkpoint("llama", out, max_position_embeddings=512, **SHAPES[shape])


def trainer_args(checkpoint: Path, seq_length: int, extra: list[str] = ()) -> RunConfig:
    """``pretrain_grpo.py``'s validated run config for ``--hf-checkpoint checkpoint``."""
    flags = ["--hf-checkpoint", str(checkpoint), "--seq-length", str(seq_length), *extra]
    cfg, errors = check(flags)
    if cfg is None:
        raise SystemExit("\n".join(errors))
    return cfg


def load_ours(cfg: RunConfig, vocab_size: int) -> torch.nn.Module:
    """The trainer's CPU model with the checkpoint's weights, in eval mode."""
    model = build_model(model_build(cfg), vocab_size, torch.device("cpu"))
    weight_loader(model_build(cfg))(model)
    return model.eval()


@torch.no_grad()
def time_hf(model, prompts: list[list[int]], new_tokens: int, vocab: int, pad: int) -> Stopwatch:
    """Time for HF ``generate`` (sampling, KV cache) on all prompts in one call (left-padded)."""
    rows = model.config.vocab_size
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        suppress_tokens=list(range(vocab, rows)),
        pad_token_id=pad,
        use_cache=True,
    )
    with Stopwatch() as watch:
        out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert out.shape[1] == width + new_tokens
    return watch


def prompts_for(tokenizer, count: int) -> list[list[int]]:
    """``count`` short arithmetic prompts (4-8 tokens with the tools' tokenizer)."""
    return [tokenizer.encode(f"{i % 97}+{(7 * i) % 53}=") for i in range(count)]


# ---------------------------------------------------------------------------------- measuring


def run_shape(shape: str, opts: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Every measurement of one shape (interleaved), as a dict."""
    from transformers import AutoModelForCausalLM

    ckpt = write_checkpoint(shape, workdir / f"llama-{shape}")
    cfg = trainer_args(ckpt, 64)
    tokenizer = trainer_config.tokenizer(cfg)
    vocab = tokenizer.vocab_size
    ours = load_ours(cfg, vocab)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    params = {
        "ours": sum(p.numel() for p in ours.parameters()),
        "HF": sum(p.numel() for p in hf.parameters()),
    }
    prompts = prompts_for(tokenizer, opts.batch)
    serial = prompts[: opts.serial_requests]
    pad = tokenizer.pad_id
    names = [n.format(b=opts.batch) for n in NAMES]
    runs: list[tuple[str, Callable[[], Stopwatch], int]] = [
        (names[0], lambda: time_engine(ours, prompts, opts.new_tokens, True, vocab), len(prompts)),
        (names[1], lambda: time_engine(ours, serial, opts.new_tokens, False, vocab), len(serial)),
        (names[2], lambda: time_hf(hf, prompts, opts.new_tokens, vocab, pad), len(prompts)),
    ]
    for _, fn, _ in runs:  # warm-up
        fn()
    rates: dict[str, list[float]] = {n: [] for n, _, _ in runs}
    unc: dict[str, list[float]] = {n: [] for n, _, _ in runs}
    cpu: dict[str, list[float]] = {n: [] for n, _, _ in runs}
    wall = runq = 0.0
    for rep in range(opts.repeats):
        shift = rep % len(runs)
        for name, fn, requests in runs[shift:] + runs[:shift]:
            watch = fn()
            rates[name].append(requests * opts.new_tokens / watch.wall)
            cpu[name].append(requests * opts.new_tokens / watch.cpu)
            if watch.runq is not None:
                unc[name].append(requests * opts.new_tokens / (watch.wall - watch.runq))
                wall, runq = wall + watch.wall, runq + watch.runq

    def ratio(per: dict[str, list[float]], name: str) -> float | None:
        pairs = list(zip(per[names[0]], per[name]))
        return statistics.median(e / r for e, r in pairs) if pairs else None

    results = [
        {
            "name": name,
            "requests": requests,
            "tokens_per_s": statistics.median(rates[name]),
            "engine_batch_over_this": ratio(rates, name),
            "engine_batch_over_this_rounds": [e / r for e, r in zip(rates[names[0]], rates[name])],
            "uncontended_engine_batch_over_this": ratio(unc, name),
            "cpu_engine_batch_over_this": ratio(cpu, name),
        }
        for name, _, requests in runs
    ]
    res: dict[str, Any] = {
        "shape": shape,
        "architecture": {**SHAPES[shape], "vocab_rows": int(hf.config.vocab_size)},
        "parameters": params,
        "prompt_tokens_mean": statistics.fmean(len(p) for p in prompts),
        "runq_fraction": runq / wall if wall else None,
        "results": results,
    }
    if opts.matmul:
        res["matmul"] = matmul_efficiency(ours, opts, cpu[names[0]])
    if opts.profile:
        res["profiles"] = profiles(ours, vocab, opts)
    return res


def run(opts: argparse.Namespace) -> dict[str, Any]:
    """Every shape, one after another, in this process."""
    initialize_distributed(_plain_config())
    torch.set_num_threads(opts.threads)
    with tempfile.TemporaryDirectory() as tmp:
        shapes = [run_shape(s, opts, Path(tmp)) for s in opts.shapes]
    return {
        "batch": opts.batch,
        "new_tokens": opts.new_tokens,
        "repeats": opts.repeats,
        "threads": torch.get_num_threads(),
        "shapes": shapes,
    }


def _plain_config() -> RunConfig:
    cfg, errors = check([])
    assert cfg is not None, errors
    return cfg


def markdown(res: dict[str, Any]) -> str:
    """Tables of the throughput and matmul efficiency per shape."""
    lines = [
        "| shape | parameters | generator | requests | tokens/s (median) |"
        " engine batch ÷ this (per repeat) | without run-queue wait | in CPU time |"
        " run-queue wait |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in res["shapes"]:
        for r in s["results"]:
            rounds = r["engine_batch_over_this_rounds"]
            unc = r["uncontended_engine_batch_over_this"]
            lines.append(
                f"| {s['shape']} | {s['parameters']['ours']:,} | {r['name']} | {r['requests']} | "
                f"{r['tokens_per_s']:.0f} | **{r['engine_batch_over_this']:.2f}x** "
                f"({min(rounds):.2f}-{max(rounds):.2f}) | "
                + ("n/a" if unc is None else f"{unc:.2f}x")
                + f" | {r['cpu_engine_batch_over_this']:.2f}x | {s['runq_fraction'] or 0:.0%} |"
            )
    mm = [s for s in res["shapes"] if "matmul" in s]
    if mm:
        lines += [
            "",
            "| shape | work | measured torch.mm rate (model's GEMMs) | achieved | fraction |",
            "|---|---|---|---|---|",
        ]
        for s in mm:
            m = s["matmul"]
            lines.append(
                f"| {s['shape']} | decode, {m['decode_rows']} rows/step | "
                f"{m['decode_matmul_flops'] / 1e9:.1f} GFLOP/s | "
                f"{m['decode_achieved_flops'] / 1e9:.1f} GFLOP/s | **{m['decode_fraction']:.0%}** |"
            )
            b, t = m["train_micro_batch"]
            lines.append(
                f"| {s['shape']} | training step, {b}x{t} tokens (fwd+bwd+Adam) | "
                f"{m['train_matmul_flops'] / 1e9:.1f} GFLOP/s | "
                f"{m['train_achieved_flops'] / 1e9:.1f} GFLOP/s | **{m['train_fraction']:.0%}** |"
            )
    prof = [s for s in res["shapes"] if "profiles" in s]
    for s in prof:
        for kind, label in (
            ("decode", f"engine decode step ({res['batch']} rows)"),
            ("train", "training step"),
        ):
            p = s["profiles"][kind]
            outside = max(0.0, 1 - p["operators_ms"] / p["wall_ms"])
            ops = ", ".join(
                f"`{t['op']}` {t['share']:.0%} ({t['calls']:.0f} calls)" for t in p["top"][:6]
            )
            lines.append(
                f"\n*Profile, {s['shape']}, {label}*: {p['cpu_ms']:.1f} ms CPU, "
                f"{p['wall_ms']:.1f} ms wall per step (profiler on), {p['operators_ms']:.1f} ms "
                f"inside operators (outside: {outside:.0%} of wall, Python and dispatch); by "
                f"self time: {ops}."
            )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (shared with ``run_all.py``)."""
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["1m", "25m"])
    parser.add_argument("--batch", type=int, default=64, help="Concurrent requests.")
    parser.add_argument("--new-tokens", type=int, default=32, help="Tokens per request.")
    parser.add_argument("--serial-requests", type=int, default=8, help="One-at-a-time runs.")
    parser.add_argument("--repeats", type=int, default=5, help="Interleaved repetitions.")
    parser.add_argument("--threads", type=int, default=1, help="Torch threads.")
    parser.add_argument(
        "--no-matmul",
        dest="matmul",
        action="store_false",
        help="Skip the matmul efficiency measurement.",
    )
    parser.add_argument("--train-micro-batch", type=int, default=32, help="Training rows.")
    parser.add_argument("--train-seq", type=int, default=64, help="Training sequence length.")
    parser.add_argument("--train-steps", type=int, default=3, help="Timed training steps.")
    parser.add_argument(
        "--no-profile", dest="profile", action="store_false", help="Skip the torch.profiler tables."
    )


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
