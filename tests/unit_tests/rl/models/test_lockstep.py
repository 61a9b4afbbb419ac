"""Expert-parallel lockstep over gloo (EP=2): ranks with different token counts and different
numbers of forwards (padding forwards), and an engine whose other replica has no rows, give each
rank the results of EP=1."""

from __future__ import annotations

import pytest
import torch
from grpo_testing.distributed import run_on_ranks
from grpo_testing.hf_models import build_hf_model, full_logits

from megatron.rl.inference.cpu.kv_cache import KVCache
from megatron.rl.inference.cpu.kv_cache_runner import KVCacheRowRunner
from megatron.rl.inference.protocol import RowWork
from megatron.rl.models.hf.tiny import make_tiny_checkpoint
from megatron.rl.models.lockstep import agreed_counts, expert_lockstep_group, padding_forward

CPU = torch.device("cpu")
FIRST = [torch.tensor([[40, 41, 42, 43, 44], [9, 10, 11, 0, 0]]), torch.tensor([[100, 7, 250]])]
"""Each rank's first forward: (2, 5) and (1, 3) tokens."""
SECOND = torch.tensor([[17, 18, 19, 20]])
"""Rank 1's second forward; rank 0 has none (a padding forward)."""
PROMPTS = {0: [40, 41, 42, 43], 1: [9, 10]}


def greedy(runner: KVCacheRowRunner, rows_of_rank: bool, steps: int = 4) -> dict[int, list[int]]:
    """Greedy tokens of ``PROMPTS`` (``rows_of_rank``), or ``steps`` empty engine steps."""
    seqs = {s: list(p) for s, p in PROMPTS.items()}
    rows = [RowWork(s, tuple(p), 0, 0.0, 1.0, 0, seed=s) for s, p in PROMPTS.items()]
    for _ in range(steps):
        results = runner.run(rows if rows_of_rank else [])
        rows = []
        for res in results:
            seqs[res.slot].append(res.token)
            rows.append(RowWork(res.slot, (res.token,), len(seqs[res.slot]) - 1, 0.0, 1.0, 0, 0))
    return seqs if rows_of_rank else {}


def lockstep_rank(rank: int, world_size: int, checkpoint: str) -> dict:
    """At EP = ``world_size``: this rank's logits of its batches (every batch at EP=1) and its
    greedy tokens (EP=2: rank 0 generates, rank 1 steps with no rows)."""
    model, hf = build_hf_model(checkpoint, ep=world_size)
    group = expert_lockstep_group(model)
    out: dict = {"group": None if group is None else group.size()}
    batches = [FIRST[rank], SECOND] if world_size == 2 else [*FIRST, SECOND]
    if world_size == 2:
        mine = [1, 2][rank]
        (most,) = agreed_counts([mine], group, CPU)
        out["logits"] = [full_logits(model, b, hf.vocab_size) for b in batches[:mine]]
        with torch.no_grad():
            for _ in range(most - mine):
                padding_forward(model, CPU)
    else:
        out["logits"] = [full_logits(model, b, hf.vocab_size) for b in batches]
    mc = model.config
    cache = KVCache(mc.num_layers, 4, 16, mc.num_query_groups, mc.kv_channels, torch.float32, CPU)
    runner = KVCacheRowRunner(model, cache, hf.vocab_size)
    out["greedy"] = greedy(runner, rank == 0)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[list[dict], dict]:
    checkpoint = make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("moe"), seed=5)
    return (
        run_on_ranks(lockstep_rank, 2, str(checkpoint)),
        run_on_ranks(lockstep_rank, 1, str(checkpoint))[0],
    )


def test_uneven_forwards_over_ep2_give_the_ep1_logits(results):
    ep2, ep1 = results
    assert ep1["group"] is None and [r["group"] for r in ep2] == [2, 2]
    got = [ep2[0]["logits"][0], ep2[1]["logits"][0], ep2[1]["logits"][1]]
    for a, b in zip(got, ep1["logits"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_engine_steps_with_an_idle_replica_give_the_ep1_tokens(results):
    ep2, ep1 = results
    assert ep2[0]["greedy"] == ep1["greedy"] and ep2[1]["greedy"] == {}
    assert all(len(s) == len(PROMPTS[k]) + 4 for k, s in ep1["greedy"].items())
