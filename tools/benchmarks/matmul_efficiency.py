"""Matmul efficiency and operator profiles of the trainer's model, for ``hf_shapes.py``.

``matmul_efficiency`` compares the FLOP rate that engine decode and a training step reach with
``torch.mm``'s measured rate on the model's own GEMM shapes (``linear_shapes``, ``matmul_rate``;
the training step is ``train_step_fn``); ``profiles`` runs ``torch.profiler`` over engine decode
steps and one training step and keeps the operators with the most self time. Matmul rates and
training step times are CPU time of the calling thread; profiles give CPU and wall time per step.
What is measured, and why, is in ``hf_shapes.py``'s docstring.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from megatron.rl.inference.cpu.kv_cache import KVCache
from megatron.rl.inference.cpu.kv_cache_runner import KVCacheRowRunner
from megatron.rl.inference.protocol import RowWork


def linear_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """(out, in) of every weight a token passes through as a matmul (linear layers + output)."""
    shapes = []
    for name, p in model.named_parameters():
        if p.dim() == 2 and "embedding" not in name:
            shapes.append(tuple(p.shape))
    # the output layer (tied or not) is a matmul with the embedding's shape
    out = getattr(model, "output_layer", None)
    if out is None or getattr(out, "weight", None) is None:
        shapes.append(tuple(model.embedding.word_embeddings.weight.shape))
    return shapes


def matmul_params(model: torch.nn.Module) -> int:
    """Multiply-accumulates per token through the model's linear layers."""
    return sum(o * i for o, i in linear_shapes(model))


def matmul_rate(shapes: list[tuple[int, int]], rows: int, backward: bool, seconds: float) -> float:
    """Measured FLOP/s of ``torch.mm`` on the model's GEMMs with ``rows`` tokens.

    Forward: (rows, in) @ (in, out); with ``backward`` also the two backward GEMMs
    (grad input (rows, out) @ (out, in), grad weight (out, rows) @ (rows, in)).
    """
    g = torch.Generator().manual_seed(0)
    ops = []
    for o, i in shapes:
        x, w, dy = (torch.randn(s, generator=g) for s in ((rows, i), (i, o), (rows, o)))
        ops.append(lambda x=x, w=w: torch.mm(x, w))
        if backward:
            ops.append(lambda dy=dy, w=w: torch.mm(dy, w.t()))
            ops.append(lambda dy=dy, x=x: torch.mm(dy.t(), x))
    flops_per_pass = 2 * rows * sum(o * i for o, i in shapes) * (3 if backward else 1)
    for op in ops:
        op()
    passes, t0 = 0, time.thread_time()
    while passes < 3 or time.thread_time() - t0 < seconds:
        for op in ops:
            op()
        passes += 1
    return passes * flops_per_pass / (time.thread_time() - t0)


def train_step_fn(model, tokens: torch.Tensor) -> Callable[[], None]:
    """One training step on ``tokens`` (B, T): forward, token log-probs, a policy-gradient loss,
    backward and an Adam update (the work of the trainer's micro-batch step). The model must be
    in train mode while it runs. The optimizer state is real: the weights change."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-6)
    b, t = tokens.shape
    positions = torch.arange(t)[None].expand(b, t)
    adv = torch.randn(b, 1)

    def step() -> None:
        logits = model(tokens, positions, None)  # (B, T, V)
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])
        loss = -(logp.squeeze(-1) * adv).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def time_train_step(model, tokens: torch.Tensor, steps: int) -> float:
    """CPU seconds (this thread) per training step, after one warm-up step."""
    step = train_step_fn(model, tokens)
    model.train()
    step()
    t0 = time.thread_time()
    for _ in range(steps):
        step()
    model.eval()
    return (time.thread_time() - t0) / steps


def _top_ops(prof, cpu: float, wall: float, top: int, steps: int) -> dict[str, Any]:
    """The ``top`` operators by self time (shares of all operators' self time), per step;
    ``cpu``/``wall``: the thread's CPU / wall seconds over the ``steps`` profiled steps (the
    profiler's operator times are wall times)."""
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events) / 1e6  # seconds inside operators
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return {
        "cpu_ms": cpu * 1e3 / steps,
        "wall_ms": wall * 1e3 / steps,
        "operators_ms": total * 1e3 / steps,
        "top": [
            {
                "op": e.key,
                "calls": e.count / steps,
                "ms": e.self_cpu_time_total / 1e3 / steps,
                "share": e.self_cpu_time_total / 1e6 / total,
            }
            for e in events[:top]
        ],
    }


def profiles(model, vocab: int, opts, decode_steps: int = 10) -> dict[str, Any]:
    """torch.profiler of engine decode steps and a training step (times per step)."""
    from torch.profiler import ProfilerActivity, profile

    c = model.config
    cache = KVCache(
        c.num_layers,
        opts.batch,
        64,
        c.num_query_groups,
        c.kv_channels,
        torch.float32,
        torch.device("cpu"),
    )
    runner = KVCacheRowRunner(model, cache, vocab)
    rows = [
        RowWork(slot=i, tokens=(5,), start=20, temperature=1.0, top_p=1.0, top_k=0, seed=i)
        for i in range(opts.batch)
    ]
    runner.run(rows)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0, w0 = time.thread_time(), time.perf_counter()
        for _ in range(decode_steps):
            runner.run(rows)
        decode = (time.thread_time() - t0, time.perf_counter() - w0)
    out = {"decode": _top_ops(prof, *decode, 8, decode_steps)}
    tokens = torch.randint(0, vocab, (opts.train_micro_batch, opts.train_seq))
    step = train_step_fn(model, tokens)
    model.train()
    step()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0, w0 = time.thread_time(), time.perf_counter()
        step()
        train = (time.thread_time() - t0, time.perf_counter() - w0)
    model.eval()
    out["train"] = _top_ops(prof, *train, 8, 1)
    return out


def matmul_efficiency(model, opts, engine_rates: list[float]) -> dict[str, Any]:
    """Achieved vs measured matmul FLOP/s for decode (batch ``opts.batch``) and a train step, all
    in CPU time of this thread (``engine_rates``: tokens per CPU second), so that waiting for a
    core while other jobs run counts on neither side."""
    shapes = linear_shapes(model)
    macs = matmul_params(model)
    decode_peak = matmul_rate(shapes, opts.batch, False, 1.0)
    decode_achieved = 2 * macs * statistics.median(engine_rates)
    g = torch.Generator().manual_seed(0)
    b, t = opts.train_micro_batch, opts.train_seq
    tokens = torch.randint(0, 300, (b, t), generator=g)
    train_peak = matmul_rate(shapes, b * t, True, 1.0)
    seconds = time_train_step(model, tokens, opts.train_steps)
    train_achieved = 3 * 2 * macs * b * t / seconds
    return {
        "matmul_macs_per_token": macs,
        "decode_rows": opts.batch,
        "decode_matmul_flops": decode_peak,
        "decode_achieved_flops": decode_achieved,
        "decode_fraction": decode_achieved / decode_peak,
        "train_tokens": b * t,
        "train_micro_batch": [b, t],
        "train_matmul_flops": train_peak,
        "train_step_seconds": seconds,
        "train_achieved_flops": train_achieved,
        "train_fraction": train_achieved / train_peak,
    }
