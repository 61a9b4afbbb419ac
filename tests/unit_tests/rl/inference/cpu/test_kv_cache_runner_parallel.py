"""Generation under tensor parallelism (gloo): every TP rank samples what a single rank samples."""

from __future__ import annotations

import torch
from grpo_testing.distributed import run_on_ranks
from grpo_testing.models import VOCAB, tiny_gpt
from megatron.core import parallel_state

from megatron.rl.inference.cpu.kv_cache import KVCache
from megatron.rl.inference.cpu.kv_cache_runner import KVCacheRowRunner
from megatron.rl.inference.protocol import RowWork


def generate_on_rank(rank: int, world_size: int) -> list[tuple[int, int, float]]:
    model = tiny_gpt(tp=world_size, seed=3)
    c = model.config
    cache = KVCache(
        c.num_layers,
        3,
        32,
        c.num_query_groups // world_size,
        c.kv_channels,
        torch.float32,
        torch.device("cpu"),
    )
    runner = KVCacheRowRunner(model, cache, VOCAB, parallel_state.get_tensor_model_parallel_group())
    assert runner.cached_forward is not None  # the plain program, all-reducing over TP
    rows = [
        RowWork(0, (2, 3, 4), 0, 1.0, 1.0, 0, seed=11),
        RowWork(1, (5,), 0, 0.7, 0.9, 0, seed=12),
        RowWork(2, (6, 7), 0, 1.3, 1.0, 5, seed=13),
    ]
    out = []
    for _ in range(8):
        results = runner.run(rows)
        out += [(r.slot, r.token, r.logprob) for r in results]
        rows = [
            RowWork(
                r.slot,
                (r.token,),
                row.start + len(row.tokens),
                row.temperature,
                row.top_p,
                row.top_k,
                row.seed,
            )
            for r, row in zip(results, rows)
        ]
    return out


def test_tp2_samples_the_same_tokens_as_tp1_on_every_rank():
    (single,) = run_on_ranks(generate_on_rank, 1)
    tp_rank0, tp_rank1 = run_on_ranks(generate_on_rank, 2)
    assert [t[:2] for t in tp_rank0] == [t[:2] for t in single]
    assert tp_rank0 == tp_rank1  # identical decisions on both TP ranks, no broadcast needed
    for (_, _, a), (_, _, b) in zip(single, tp_rank0):
        assert abs(a - b) < 1e-5
