"""GPU benchmark of the CUDA tier: rollout generation tokens/s and training tokens/s + MFU.

    python tools/bench_cuda.py                          # ~125M GPT (12 x 768, 12 heads), bf16
    python tools/bench_cuda.py --engine local           # the CPU tier's engine, same GPU, to compare
    python tools/bench_cuda.py --fp32 --train-steps 5   # float32 weights and math

Builds the model, optimizer and engine through ``megatron.trainer.tiers.cuda.CUDATier`` (megatron-core
DDP, ``get_megatron_optimizer``, ``get_forward_backward_func``, ``DynamicInferenceEngine`` with
flash-attn or ``flash_reference``) on one GPU, then measures:

* generation: ``--gen-requests`` requests of ``--prompt-len`` random prompt tokens, each generating
  exactly ``--gen-tokens`` tokens (no EOS), all submitted at once; generated tokens / wall time of
  the whole window (after one warm-up window);
* training: GRPO optimizer steps on a synthetic batch of ``--batch-size`` full-length rollouts
  (``--seq-length`` tokens, the last ``--seq-length - --prompt-len`` generated); trained tokens /
  step time, median over ``--train-steps`` after ``--warmup-steps``. MFU is the model FLOPs per
  trained token (``training_flops_per_token``: 3 x forward matmul FLOPs incl. the output layer and
  causal attention, no recomputation) times tokens/s over the GPU's peak dense bf16 FLOP/s
  (``--peak-tflops``; known for H100/H200/A100 by device name).

Prints one JSON object (also the attention kernels the engine used and the parameter count).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.rl.grpo.batch import TrainBatch  # noqa: E402
from megatron.rl.grpo.loss import GRPOLossConfig  # noqa: E402
from megatron.rl.inference.scheduler import SchedulerConfig  # noqa: E402
from megatron.rl.wire import SamplingParams  # noqa: E402
from megatron.trainer.checkpoint.directory import TrainState  # noqa: E402
from megatron.trainer.config import tier_config  # noqa: E402
from megatron.trainer.flags.parse import check  # noqa: E402
from megatron.trainer.flags.run import RunConfig  # noqa: E402
from megatron.trainer.train.losses import GRPOLoss  # noqa: E402
from megatron.trainer.train.policy import PolicyConfig  # noqa: E402
from megatron.trainer.train.step import StepConfig  # noqa: E402

PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.4, "H200": 989.4, "A100": 312.0}
"""Dense bf16 tensor-core peak per device name fragment (first match wins; SXM for H100)."""
PEAK_MEMORY_TBPS = {"H100 PCIe": 2.0, "H100": 3.35, "H200": 4.8, "A100": 2.0}
"""HBM bandwidth in TB/s per device name fragment (first match wins; SXM for H100)."""
SHAPES = {
    "llama-3.2-1b": dict(
        num_layers=16,
        hidden_size=2048,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=8192,
        vocab_size=128256,
        untie=False,
        qkv_bias=False,
    ),
    "qwen2.5-1.5b": dict(
        num_layers=28,
        hidden_size=1536,
        num_attention_heads=12,
        num_query_groups=2,
        ffn_hidden_size=8960,
        vocab_size=151936,
        untie=False,
        qkv_bias=True,
    ),
    "tiny": dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=192,
        vocab_size=512,
        untie=False,
        qkv_bias=False,
    ),
}
"""``--shape``: Llama-style models (SwiGLU, RMSNorm, RoPE, grouped-query attention) of real
shapes, randomly initialized (nothing to download); ``tiny`` is the CPU dry run's."""


def training_flops_per_token(
    num_layers: int,
    hidden: int,
    ffn: int,
    heads: int,
    kv_heads: int,
    seq_len: int,
    vocab: int,
    gated: bool = False,
) -> float:
    """Model FLOPs of one trained token: 3 x (2 x matmul weights + causal attention); a gated
    (SwiGLU) MLP has three ``hidden x ffn`` matrices instead of two."""
    kv_dim = hidden * kv_heads // heads
    mlp = (3 if gated else 2) * hidden * ffn
    per_layer = hidden * (hidden + 2 * kv_dim) + hidden * hidden + mlp
    matmul_weights = num_layers * per_layer + hidden * vocab  # + the output layer
    attention = num_layers * 2 * hidden * seq_len  # QK^T and AV over seq_len / 2 keys on average
    return 3.0 * (2.0 * matmul_weights + attention)


def peak_tflops_for(device_name: str) -> float | None:
    """Dense bf16 peak TFLOP/s of a device, if known."""
    for fragment, peak in PEAK_BF16_TFLOPS.items():
        if fragment in device_name:
            return peak
    return None


def peak_tbps_for(device_name: str) -> float | None:
    """Memory bandwidth (TB/s) of a device, if known."""
    for fragment, peak in PEAK_MEMORY_TBPS.items():
        if fragment in device_name:
            return peak
    return None


def decode_bytes(
    weight_bytes: int,
    requests: int,
    prompt_len: int,
    new_tokens: int,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    kv_bytes: int = 2,
) -> float:
    """Bytes the decode steps of one window must read at least: every weight once per step, and
    each request's keys and values up to its position (step s of ``new_tokens`` attends to
    ``prompt_len + s`` positions); the prefill is not counted."""
    per_position = 2 * num_layers * kv_heads * head_dim * kv_bytes  # keys and values
    positions = requests * (new_tokens * prompt_len + new_tokens * (new_tokens - 1) / 2)
    return new_tokens * weight_bytes + positions * per_position


def device_name() -> str:
    """The GPU's name, or ``cpu`` (the dry run)."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def sync() -> None:
    """Wait for the GPU (nothing on the CPU dry run)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def trainer_args(opts: argparse.Namespace) -> RunConfig:
    """The run config of the benchmarked model: the resolved defaults with its options (and the
    derived fields) replaced."""
    defaults, problems = check([])
    if defaults is None:
        raise SystemExit("\n".join(problems))
    llama = {}
    if opts.shape is not None:  # SwiGLU, RMSNorm, RoPE, grouped-query attention, no biases
        shape = SHAPES[opts.shape]
        llama = dict(
            swiglu=True,
            normalization="RMSNorm",
            position_embedding_type="rope",
            group_query_attention=True,
            num_query_groups=shape["num_query_groups"],
            disable_bias_linear=True,
            add_qkv_bias=shape["qkv_bias"],
            untie_embeddings_and_output_weights=shape["untie"],
        )
    return defaults.with_flags(
        **llama,
        num_layers=opts.num_layers,
        hidden_size=opts.hidden_size,
        num_attention_heads=opts.num_attention_heads,
        ffn_hidden_size=opts.ffn_hidden_size,
        seq_length=opts.seq_length,
        max_position_embeddings=opts.seq_length,
        micro_batch_size=opts.micro_batch_size,
        bf16=not opts.fp32,
        use_distributed_optimizer=opts.distributed_optimizer,
        lr=1e-4,
        min_lr=1e-5,
        lr_warmup_iters=0,
        train_iters=1000,
        world_size=1,
        data_parallel_size=1,
        inference_max_requests=opts.gen_requests,
    )


def synthetic_batch(rows: int, seq_len: int, prompt_len: int, vocab: int) -> TrainBatch:
    """Full-length rollouts of random tokens; the tokens after the prompt carry loss."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, vocab, (rows, seq_len + 1), generator=g)
    mask = torch.zeros(rows, seq_len)
    mask[:, prompt_len - 1 :] = 1.0
    return TrainBatch(
        input_ids=tokens[:, :-1],
        target_ids=tokens[:, 1:],
        loss_mask=mask,
        inference_logprobs=-torch.rand(rows, seq_len, generator=g) * 10 * mask,
        advantages=torch.randn(rows, generator=g),
        temperature=torch.ones(rows),
        lengths=torch.full((rows,), seq_len),
    )


def bench_training(tier, state: TrainState, opts, vocab: int) -> dict:
    """Median step time and throughput of GRPO steps on a synthetic batch."""
    batch = synthetic_batch(opts.batch_size, opts.seq_length, opts.prompt_len, vocab)
    config = StepConfig(GRPOLossConfig(0.2, 0.28), vocab, opts.micro_batch_size, clip_grad=1.0)
    policy, loss = tier.build_policy(state, PolicyConfig.of(config)), GRPOLoss(config)
    times = []
    for step in range(opts.warmup_steps + opts.train_steps):
        sync()
        t0 = time.perf_counter()
        (result,) = policy.train(batch, loss)
        sync()
        if step >= opts.warmup_steps:
            times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    tokens_per_s = result.trained_tokens / seconds
    flops = training_flops_per_token(
        opts.num_layers,
        opts.hidden_size,
        opts.ffn_hidden_size,
        opts.num_attention_heads,
        opts.kv_heads,
        opts.seq_length,
        vocab,
        gated=opts.shape is not None,
    )
    peak = opts.peak_tflops or peak_tflops_for(device_name())
    return {
        "train_step_seconds": seconds,
        "train_tokens_per_s": tokens_per_s,
        "train_model_tflops_per_s": flops * tokens_per_s / 1e12,
        "mfu": None if peak is None else flops * tokens_per_s / (peak * 1e12),
        "peak_tflops": peak,
        "loss": result.loss,
    }


async def _generate(engine, prompts: list[list[int]], new_tokens: int) -> float:
    sampling = SamplingParams(temperature=1.0, max_tokens=new_tokens)
    engine.resume()
    t0 = time.perf_counter()
    outs = await asyncio.gather(
        *(engine.generate(p, sampling, seed=i) for i, p in enumerate(prompts))
    )
    sync()
    elapsed = time.perf_counter() - t0
    engine.suspend()
    engine.steps.stop_followers()  # end the window (megatron-core releases its KV memory)
    assert all(len(o.tokens) == new_tokens for o in outs)
    return elapsed


def bench_generation(tier, model, opts, vocab: int) -> dict:
    """Generated tokens/s of one window of ``--gen-requests`` concurrent requests."""
    from megatron.trainer.tiers import CPUTier

    builder = CPUTier(tier.config, tier.ctx) if opts.engine == "local" else tier
    config = SchedulerConfig(opts.gen_requests, opts.seq_length, eos_id=-1)  # never stops early
    steps = builder.build_step_group(model, config, vocab)
    engine = builder.build_engine(steps, config, lambda: 0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, vocab, (opts.prompt_len,), generator=g).tolist()]
    prompts *= opts.gen_requests
    model.eval()

    async def run() -> tuple[float, float]:
        engine.start()
        try:
            warm = await _generate(engine, prompts[: max(1, len(prompts) // 8)], 8)
            timed = await _generate(engine, prompts, opts.gen_tokens)
            return warm, timed
        finally:
            await engine.aclose()

    _, seconds = asyncio.run(run())
    tokens = opts.gen_requests * opts.gen_tokens
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    needed = decode_bytes(
        weight_bytes,
        opts.gen_requests,
        opts.prompt_len,
        opts.gen_tokens,
        opts.num_layers,
        opts.kv_heads,
        opts.hidden_size // opts.num_attention_heads,
        kv_bytes=4 if opts.fp32 else 2,
    )
    peak = opts.peak_tbps or peak_tbps_for(device_name())
    bandwidth = needed / seconds / 1e12
    return {
        "engine": builder.inference_backend().name,
        "generation_seconds": seconds,
        "generated_tokens": tokens,
        "generated_tokens_per_s": tokens / seconds,
        "decode_bytes_needed": needed,
        "decode_tbps": bandwidth,
        "peak_tbps": peak,
        "decode_bandwidth_utilisation": None if peak is None else bandwidth / peak,
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Benchmark options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="A real model's shape.")
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--hidden-size", type=int, default=768)
    p.add_argument("--num-attention-heads", type=int, default=12)
    p.add_argument("--vocab-size", type=int, default=50257, help="Token ids (padded to 128).")
    p.add_argument("--seq-length", type=int, default=1024, help="Prompt + generation length.")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=256, help="Tokens each request generates.")
    p.add_argument("--gen-requests", type=int, default=128, help="Concurrent requests.")
    p.add_argument("--batch-size", type=int, default=32, help="Rollouts per training step.")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--train-steps", type=int, default=10)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--fp32", action="store_true", help="Float32 instead of bf16.")
    p.add_argument("--distributed-optimizer", action="store_true")
    p.add_argument("--engine", choices=["dynamic", "local"], default="dynamic")
    p.add_argument("--peak-tflops", type=float, default=None, help="GPU peak for the MFU.")
    p.add_argument("--peak-tbps", type=float, default=None, help="GPU memory bandwidth, TB/s.")
    p.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="Run on the CPU tier (no GPU): checks the script, its numbers mean nothing.",
    )
    p.add_argument("--skip-training", action="store_true")
    p.add_argument("--skip-generation", action="store_true")
    opts = p.parse_args(argv)
    opts.ffn_hidden_size, opts.kv_heads = 4 * opts.hidden_size, opts.num_attention_heads
    if opts.shape is not None:  # the preset wins over the single-dimension options
        shape = SHAPES[opts.shape]
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size"):
            setattr(opts, name, shape[name])
        opts.ffn_hidden_size, opts.kv_heads = shape["ffn_hidden_size"], shape["num_query_groups"]
    if opts.prompt_len + opts.gen_tokens > opts.seq_length:
        p.error("--prompt-len + --gen-tokens must not exceed --seq-length")
    if opts.batch_size % opts.micro_batch_size:
        p.error("--batch-size must be a multiple of --micro-batch-size")
    return opts


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark on the current GPU and print the results as JSON."""
    opts = parse(argv)
    if not torch.cuda.is_available() and not opts.cpu_dry_run:
        print("bench_cuda.py needs a CUDA device (or --cpu-dry-run)", file=sys.stderr)
        return 2
    from megatron.core.utils import unwrap_model

    from megatron.trainer.runtime.initialize import initialize_distributed, shutdown_distributed
    from megatron.trainer.tiers import CPUTier
    from megatron.trainer.tiers.cuda import CUDATier

    cfg = trainer_args(opts)
    ctx = initialize_distributed(cfg)
    try:
        tier = (CPUTier if opts.cpu_dry_run else CUDATier)(tier_config(cfg), ctx)
        model = tier.build_model(opts.vocab_size)
        state = TrainState(model, *tier.build_optimizer(model))
        params = sum(p.numel() for p in unwrap_model(model).parameters())
        out = {"device": device_name(), "parameters": params, "shape": opts.shape}
        out["precision"] = "fp32" if opts.fp32 else "bf16"
        if not opts.skip_training:
            out.update(bench_training(tier, state, opts, opts.vocab_size))
        if not opts.skip_generation:
            out.update(bench_generation(tier, model, opts, opts.vocab_size))
        out["tier"] = tier.describe()
        if torch.cuda.is_available():
            out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 1024**3
        print(json.dumps(out, indent=1))
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
