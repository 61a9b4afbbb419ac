"""Routing replay on the CPU engine: a tiny MoE GPT through the real scheduler and
``KVCacheRowRunner`` records, for every position a request fed, the experts each router chose,
and those are the routes one plain forward of the whole sequence chooses."""

from __future__ import annotations

import asyncio

import pytest
import torch
from megatron.core import parallel_state

from megatron.rl.inference.backends import RunnerInputs
from megatron.rl.inference.cpu.cached_forward import CachedForward
from megatron.rl.inference.cpu.kv_cache import KVCache
from megatron.rl.inference.cpu.kv_cache_runner import KVCacheRowRunner, build_kv_cache_runner
from megatron.rl.inference.protocol import GenerationOutput, RowWork
from megatron.rl.inference.requests import SchedulerConfig
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler
from megatron.rl.inference.step_group import StepGroup
from megatron.rl.models.architecture import (
    GPTArchitecture,
    build_gpt_model,
    layer_spec,
    transformer_config,
)
from megatron.rl.models.gpt_spec import SDPASpecProvider
from megatron.rl.models.routing_replay import clear_routing, recorded_routes, start_recording
from megatron.rl.wire import SamplingParams

VOCAB = 128
LAYERS, TOPK = 2, 2
MOE = GPTArchitecture(
    num_layers=LAYERS,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    add_bias_linear=False,
    num_experts=4,
    moe_router_topk=TOPK,
    moe_ffn_hidden_size=16,
)
REQUESTS = [  # (prompt, max_tokens, seed): prompts of several lengths, one shared by a group
    ([5, 9, 17, 3, 44, 2], 7, 11),
    ([5, 9, 17, 3, 44, 2], 7, 12),
    ([5, 9, 17, 3, 44, 2], 5, 13),
    ([60, 61], 9, 14),
    ([7, 100, 31, 8, 8, 8, 90, 12, 1, 66], 4, 15),
]


@pytest.fixture
def moe_model(single_rank_world):
    parallel_state.initialize_model_parallel()
    torch.manual_seed(0)
    model = build_gpt_model(MOE, transformer_config(MOE), layer_spec(MOE, SDPASpecProvider()))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # larger weights than the init: the routers' logits far from ties
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def engine_of(model: torch.nn.Module, record: bool, slots: int = 8) -> ContinuousBatchingScheduler:
    config = SchedulerConfig(max_requests=slots, max_seq_len=48, eos_id=1, record_routing=record)
    inputs = RunnerInputs(model, config, VOCAB, torch.device("cpu"))
    return ContinuousBatchingScheduler(StepGroup(build_kv_cache_runner(inputs)), config, lambda: 0)


def generate(engine: ContinuousBatchingScheduler, requests=REQUESTS) -> list[GenerationOutput]:
    async def run():
        engine.start()
        engine.resume()
        try:
            return await asyncio.gather(
                *(
                    engine.generate(p, SamplingParams(max_tokens=n, ignore_eos=True), seed=s)
                    for p, n, s in requests
                )
            )
        finally:
            await engine.aclose()

    return asyncio.run(run())


@torch.no_grad()
def full_forward_routes(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """(len(tokens), L, k) routes of one plain fp32 forward of ``tokens`` (batch 1)."""
    start_recording(model)
    model(torch.tensor([tokens]), torch.arange(len(tokens))[None], None)
    routes = recorded_routes(model)
    clear_routing(model)
    return routes


def engine_routes(out: GenerationOutput) -> torch.Tensor:
    return torch.tensor(out.routed_experts, dtype=torch.int16).view(-1, LAYERS, TOPK)


def test_finished_requests_carry_the_routes_of_one_full_forward(moe_model):
    outputs = generate(engine_of(moe_model, record=True))
    compared = 0
    for (prompt, max_tokens, _), out in zip(REQUESTS, outputs):
        fed = prompt + out.tokens[:-1]
        assert len(out.tokens) == max_tokens and len(out.routed_experts) == len(fed)
        assert all(len(route) == LAYERS * TOPK for route in out.routed_experts)
        # exact, top-k order included: no router logit of this model is within rounding of a tie
        assert torch.equal(engine_routes(out), full_forward_routes(moe_model, fed))
        compared += len(fed)
    assert compared == sum(len(p) + n - 1 for p, n, _ in REQUESTS)


def test_samples_of_one_prompt_get_identical_prompt_routes(moe_model):
    outputs = generate(engine_of(moe_model, record=True))
    prompt = REQUESTS[0][0]
    group = [out.routed_experts[: len(prompt)] for out in outputs[:3]]
    assert group[0] == group[1] == group[2]
    assert len({tuple(out.tokens) for out in outputs[:3]}) > 1  # the samples themselves differ
    assert group[0] != outputs[3].routed_experts[:2]  # not a constant


def test_recording_off_returns_no_routes_and_the_same_tokens(moe_model):
    recorded = generate(engine_of(moe_model, record=True))
    plain = generate(engine_of(moe_model, record=False))
    assert all(out.routed_experts is None for out in plain)
    assert [(o.tokens, o.logprobs) for o in plain] == [(o.tokens, o.logprobs) for o in recorded]


def test_runner_rows_carry_their_fed_tokens_routes_and_stop_recording(moe_model):
    c = moe_model.config
    cache = KVCache(c.num_layers, 4, 32, c.num_query_groups, c.kv_channels, torch.float32, "cpu")
    runner = KVCacheRowRunner(moe_model, cache, VOCAB, record_routing=True)
    rows = [
        RowWork(0, (5, 9, 17), 0, 1.0, 1.0, 0, seed=1),
        RowWork(2, (60,), 0, 1.0, 1.0, 0, seed=2),
    ]
    results = runner.run(rows)
    assert [tuple(r.routes.shape) for r in results] == [(3, LAYERS, TOPK), (1, LAYERS, TOPK)]
    assert results[0].routes.dtype == torch.int16
    assert torch.equal(results[0].routes, full_forward_routes(moe_model, [5, 9, 17]))
    assert torch.equal(results[1].routes, full_forward_routes(moe_model, [60]))
    assert recorded_routes(moe_model) is None  # the runner does not leave its routers recording


def test_a_dense_model_records_nothing(single_rank_world):
    from grpo_testing.models import tiny_gpt

    model = tiny_gpt().eval()
    c = model.config
    cache = KVCache(c.num_layers, 2, 16, c.num_query_groups, c.kv_channels, torch.float32, "cpu")
    runner = KVCacheRowRunner(model, cache, 64, record_routing=True)
    assert not runner.record_routing
    assert runner.run([RowWork(0, (5, 9), 0, 1.0, 1.0, 0, seed=1)])[0].routes is None


def test_recording_refuses_a_forward_that_bypasses_the_routers(moe_model, monkeypatch):
    """Were the plain program ever to run an MoE model, its routers would record nothing: the
    runner says so instead of returning no routes."""
    monkeypatch.setattr(CachedForward, "of", classmethod(lambda cls, *args: object()))
    c = moe_model.config
    cache = KVCache(c.num_layers, 2, 16, c.num_query_groups, c.kv_channels, torch.float32, "cpu")
    with pytest.raises(ValueError, match="record_routing: the runner's cached forward"):
        KVCacheRowRunner(moe_model, cache, VOCAB, record_routing=True)
    assert KVCacheRowRunner(moe_model, cache, VOCAB).cached_forward is not None  # not recording
