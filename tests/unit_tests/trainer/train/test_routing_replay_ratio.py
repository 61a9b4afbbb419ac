"""Rollout routing replay (R3) end to end on the CPU tier, on a tiny MoE GPT whose routers have
near-tied experts (every expert's router row is one shared row plus a perturbation of 1e-6 of its
size): the engine (KV cache, decode shapes) and the trainer's forward (whole sequences) then route
a measurable share of tokens differently from float rounding alone, as bf16 and real models do.

Without replay (``measure``) the routing mismatch is non-zero and the first-iteration ratio
pi_old / pi_inference strays far from 1 on those tokens; with replay the trainer routes every
recorded token as the engine did and the ratio is 1 to float rounding."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.distributed as dist
from grpo_testing.batches import build_train_batch
from grpo_testing.distributed import init_single_rank_world
from grpo_testing.trainer import one_rank_context
from megatron.core import parallel_state

from megatron.rl.inference.backends import RunnerInputs
from megatron.rl.inference.cpu.kv_cache_runner import build_kv_cache_runner
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
from megatron.rl.models.moe import CPUSafeRouter
from megatron.rl.models.routing_replay import (
    configure_routing,
    recorded_routes,
    routing_mismatch,
    start_recording,
)
from megatron.rl.wire import RolloutGroup, SamplingParams, TokenRollout
from megatron.trainer.checkpoint.directory import TrainState
from megatron.trainer.tiers.cpu import CPUPolicy
from megatron.trainer.train.forward import forward_outputs, model_inputs
from megatron.trainer.train.policy import PolicyConfig

VOCAB, LAYERS, TOPK = 64, 2, 2
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
PROMPTS = [[3, 9, 17, 4, 44, 2], [60, 61, 5], [7, 10, 31, 8, 8, 8, 20, 12]]
SAMPLES, NEW_TOKENS = 4, 16


@pytest.fixture(scope="module")
def setup():
    """The near-tie model, and a batch of its own rollouts with the engine's routes."""
    init_single_rank_world()
    try:
        yield near_tie_model_and_batch()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def near_tie_model_and_batch():
    parallel_state.initialize_model_parallel()
    torch.manual_seed(0)
    model = build_gpt_model(MOE, transformer_config(MOE), layer_spec(MOE, SDPASpecProvider()))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for router in (m for m in model.modules() if isinstance(m, CPUSafeRouter)):
            shared = torch.randn(1, router.weight.shape[1], generator=g)
            router.weight.copy_(shared + 1e-6 * torch.randn(router.weight.shape, generator=g))
    model.eval()
    return model, build_train_batch(rollout_groups(model), pad_id=0)


def rollout_groups(model: torch.nn.Module) -> list[RolloutGroup]:
    """SAMPLES sampled completions of each prompt from the engine, routes recorded."""
    config = SchedulerConfig(max_requests=16, max_seq_len=48, eos_id=1, record_routing=True)
    runner = build_kv_cache_runner(RunnerInputs(model, config, VOCAB, torch.device("cpu")))
    engine = ContinuousBatchingScheduler(StepGroup(runner), config, lambda: 0)
    sampling = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)

    async def run():
        engine.start()
        engine.resume()
        try:
            return await asyncio.gather(
                *(
                    engine.generate(p, sampling, seed=100 * i + s)
                    for i, p in enumerate(PROMPTS)
                    for s in range(SAMPLES)
                )
            )
        finally:
            await engine.aclose()

    outputs = iter(asyncio.run(run()))
    groups = []
    for index, prompt in enumerate(PROMPTS):
        rollouts = []
        for s in range(SAMPLES):
            out = next(outputs)
            rollouts.append(
                TokenRollout(
                    env_id="t",
                    problem_id=str(index),
                    prompt="",
                    completion="",
                    reward=float(s),
                    tokens=prompt + out.tokens,
                    generation_mask=[False] * len(prompt) + [True] * len(out.tokens),
                    logprobs=out.logprobs,
                    policy_versions=out.policy_versions,
                    submission_policy_version=0,
                    routed_experts=out.routed_experts,
                )
            )
        groups.append(RolloutGroup(batch_id=0, index_in_batch=index, rollouts=rollouts))
    return groups


def trainer_forward(model, batch, mode: str):
    """pi_old as the trainer computes it in ``mode``; the routing it used; the mismatch."""
    configure_routing(model, mode)
    start_recording(model)
    inputs = model_inputs(batch, torch.device("cpu"))
    with torch.no_grad():
        logprobs, _ = forward_outputs(model, batch, inputs, VOCAB, None)
    used = recorded_routes(model)  # (t * b, L, k) sequence-major
    b, t = batch.input_ids.shape
    used = used.view(t, b, LAYERS * TOPK).transpose(0, 1)  # (b, t, L * k)
    return logprobs, used, routing_mismatch(model)


def ratio_error(logprobs: torch.Tensor, batch) -> float:
    """max |pi_old / pi_inference - 1| over the generated tokens."""
    mask = batch.loss_mask.bool()
    return float((logprobs - batch.inference_logprobs)[mask].exp().sub(1).abs().max())


def test_without_replay_the_routing_mismatch_is_measurable(setup):
    model, batch = setup
    logprobs, used, (differing, compared) = trainer_forward(model, batch, "measure")
    recorded = batch.routed_experts >= 0
    assert (
        compared
        == int(recorded[..., 0].sum())
        == sum(len(p) + NEW_TOKENS - 1 for p in PROMPTS for _ in range(SAMPLES))
    )
    share = differing / compared
    error = ratio_error(logprobs, batch)
    print(
        f"without replay: routing mismatch {share:.3f} ({differing}/{compared}), "
        f"max |ratio - 1| {error:.3e}"
    )
    assert share > 0.02  # measured: 0.17 (42 of 248 tokens)
    assert error > 1e-2


def test_with_replay_the_trainer_routes_as_the_engine_and_the_ratio_is_one(setup):
    model, batch = setup
    logprobs, used, (differing, _) = trainer_forward(model, batch, "replay")
    recorded = batch.routed_experts[..., 0] >= 0  # (b, t)
    same_set = (
        (
            used.unflatten(-1, (LAYERS, TOPK)).sort(-1).values
            == batch.routed_experts.long().unflatten(-1, (LAYERS, TOPK)).sort(-1).values
        )
        .all(-1)
        .all(-1)
    )  # (b, t)
    assert same_set[recorded].all()  # every recorded token, every layer
    assert differing > 0  # the router's own choice still differs (measured before the replay)
    error = ratio_error(logprobs, batch)
    print(f"with replay: max |ratio - 1| {error:.3e}")
    assert error < 1e-4


def test_the_policy_replays_in_get_logprobs_and_reports_nothing_afterwards(setup):
    model, batch = setup
    configure_routing(model, "replay")
    config = PolicyConfig(vocab_size=VOCAB, micro_batch_size=4, clip_grad=1.0)
    policy = CPUPolicy(TrainState(model, None, None), config, one_rank_context())
    old = policy.get_logprobs(batch)
    assert ratio_error(old, batch) < 1e-4
    assert routing_mismatch(model) == (0, 0)  # the policy call forgot its targets
    configure_routing(model, "off")  # routes are ignored: the router's own choice
    assert ratio_error(policy.get_logprobs(batch), batch) > 1e-2
