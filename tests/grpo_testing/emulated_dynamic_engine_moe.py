"""megatron-core's ``DynamicInferenceEngine`` (CPU-emulated, or on a GPU) on an MoE checkpoint.

Generates greedy and sampled requests with the local engine (``KVCacheRowRunner``) and with
megatron-core's engine recording the routes (``DynamicEngineConfig.record_routing``), in one
window and with suspend/resume windows (requests re-prefilled), then routes each request's
prompt + generated[:-1] in one full forward. Prints one JSON line per engine run: whether the
tokens agree with the local engine, the largest logprob difference, and per request whether the
rows' routes, concatenated, equal the full forward's (and how many token rows differ), and the
number of re-prefills (recompute mode: the row fed one token, megatron-core its whole sequence).

    python tests/grpo_testing/emulated_dynamic_engine_moe.py CHECKPOINT_DIR [--device cuda]

Own process on CPU (``emulate_cuda_on_cpu`` patches torch globally); ``--device cuda`` runs the
same comparison on a real GPU without the emulation.
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


class RouteCapture:
    """A row runner that keeps, per request prompt, the routes of every row's result, and counts
    the re-prefills (a megatron-core request fed more than one token after its first step)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.prompt_of: dict[int, tuple[int, ...]] = {}
        self.routes: dict[tuple[int, ...], list[torch.Tensor | None]] = {}
        self.re_prefills = 0
        stepped: set[int] = set()
        take_routes = runner.sampler.take_routes

        def counting_take_routes() -> dict[int, torch.Tensor]:
            routes = take_routes()
            self.re_prefills += sum(r in stepped and len(t) > 1 for r, t in routes.items())
            stepped.update(routes)
            return routes

        runner.sampler.take_routes = counting_take_routes

    def run(self, rows):
        """The runner's results; their routes are kept under their request's prompt."""
        for row in rows:
            if row.start == 0:
                self.prompt_of[row.slot] = tuple(row.tokens)
                self.routes.setdefault(tuple(row.tokens), [])
        results = self.runner.run(rows)
        for result in results:
            self.routes[self.prompt_of[result.slot]].append(result.routes)
        return results

    def end_window(self, idle: bool = False) -> None:
        self.runner.end_window(idle)


def full_forward_routes(model, tokens: list[int], device: str) -> torch.Tensor:
    """(T, L, k) routes of one forward of ``tokens`` (batch of one: router row t is token t)."""
    from megatron.rl.models.routing_replay import recorded_routes, start_recording

    ids = torch.tensor([tokens], device=device)
    start_recording(model)
    with torch.no_grad():
        model(ids, torch.arange(len(tokens), device=device)[None], None)
    return recorded_routes(model).cpu()


def compare_routes(model, capture: RouteCapture, got, device: str) -> dict:
    """Per request: its rows' routes concatenated vs a full forward's, and the differing rows."""
    same, differing_rows, complete = [], [], []
    for (prompt, *_), output in zip(REQUESTS, got):
        rows = capture.routes[tuple(prompt)]
        complete.append(len(rows) == len(output.tokens) and all(r is not None for r in rows))
        if not complete[-1]:
            same.append(False)
            differing_rows.append(-1)
            continue
        recorded = torch.cat(rows)  # (len(prompt) + generated - 1, L, k)
        want = full_forward_routes(model, list(prompt) + output.tokens[:-1], device)
        if recorded.shape != want.shape:
            same.append(False)
            differing_rows.append(-1)
            continue
        rows_differ = (recorded.sort(-1).values != want.sort(-1).values).any(-1).any(-1)
        same.append(bool(torch.equal(recorded, want)))
        differing_rows.append(int(rows_differ.sum()))
    return {"routes_complete": complete, "same_routes": same, "differing_rows": differing_rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--device", default="cpu")
    opts = parser.parse_args()
    root = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(root), str(root / "tests")]
    if opts.device == "cpu":
        torch.set_num_threads(1)
        from grpo_testing.emulated_cuda import emulate_cuda_on_cpu

        emulate_cuda_on_cpu()
    else:
        torch.cuda.set_device(0)
    from grpo_testing.distributed import init_single_rank_world
    from grpo_testing.emulated_dynamic_engine import generate
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
        model = model.to(opts.device)
    a, n = hf.arch, len(REQUESTS)
    cache = KVCache(a.num_layers, n, 32, a.query_groups, a.head_dim, torch.float32, opts.device)
    schedule = SchedulerConfig(n, 32, 2)
    local = ContinuousBatchingScheduler(
        StepGroup(KVCacheRowRunner(model, cache, hf.vocab_size)), schedule, lambda: 0
    )
    want = asyncio.run(generate(local, windows=False, requests=REQUESTS))
    for windows in (False, True):
        config = DynamicEngineConfig(n, 32, eos_id=2, block_size_tokens=8, record_routing=True)
        capture = RouteCapture(de.dynamic_row_runner(model, config, hf.vocab_size, a.vocab_size))
        engine = ContinuousBatchingScheduler(StepGroup(capture), schedule, lambda: 0)
        got = asyncio.run(generate(engine, windows, requests=REQUESTS))
        diff = max(abs(x - y) for g, w in zip(got, want) for x, y in zip(g.logprobs, w.logprobs))
        run = {
            "windows": windows,
            "same_tokens": [g.tokens == w.tokens for g, w in zip(got, want)],
            "lengths": [len(w.tokens) for w in want],
            "greedy": [t == 0.0 for _, t, _, _ in REQUESTS],
            "max_logprob_difference": diff,
            "megatron_steps": capture.runner.steps,
            "re_prefills": capture.re_prefills,
            **compare_routes(model, capture, got, opts.device),
        }
        print(json.dumps(run), flush=True)


if __name__ == "__main__":
    main()
