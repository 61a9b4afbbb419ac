"""The CPU tier's ``--bf16`` (bfloat16 products under autocast on float32 weights, in training and
in the engine) and its chunked output layer (``forward.forward_outputs``), on a tiny Llama-shaped
GPT (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied output layer)."""

from __future__ import annotations

import pytest
import torch
from grpo_testing.batches import build_train_batch
from grpo_testing.models import VOCAB
from grpo_testing.rollouts import synthetic_groups
from grpo_testing.trainer import grpo_update, one_rank_context, step_config, train_args
from megatron.core import parallel_state

from megatron.rl.grpo.batch import TrainBatch
from megatron.rl.inference.protocol import RowWork
from megatron.rl.inference.scheduler import SchedulerConfig
from megatron.trainer.checkpoint.directory import TrainState
from megatron.trainer.config import tier_config
from megatron.trainer.tiers.cpu import CPUTier
from megatron.trainer.train.forward import forward_outputs, model_inputs
from megatron.trainer.train.policy import PolicyConfig

LLAMA = dict(
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    disable_bias_linear=True,
    group_query_attention=True,
    num_query_groups=2,
    untie_embeddings_and_output_weights=True,
)


@pytest.fixture
def ctx(single_rank_world):
    parallel_state.initialize_model_parallel()
    return one_rank_context()


def tier(ctx, bf16: bool, **overrides) -> CPUTier:
    return CPUTier(tier_config(train_args(bf16=bf16, **{**LLAMA, **overrides})), ctx)


def a_batch(seed: int = 1) -> TrainBatch:
    return build_train_batch(synthetic_groups(2, 4, VOCAB, seed=seed), pad_id=0)


def one_update(ctx, bf16: bool):
    cpu = tier(ctx, bf16)
    torch.manual_seed(3)
    model = cpu.build_model(VOCAB)
    state = TrainState(model, *cpu.build_optimizer(model))
    config = step_config(VOCAB)
    result = grpo_update(cpu.build_policy(state, PolicyConfig.of(config)), a_batch(), config)
    return result, state


def test_bf16_trains_float32_weights_with_bfloat16_products(ctx):
    fp32, _ = one_update(ctx, bf16=False)
    bf16, state = one_update(ctx, bf16=True)
    assert all(p.dtype == torch.float32 for p in state.model.parameters())
    moments = [s["exp_avg"] for s in state.optimizer.state.values()]
    assert moments and all(m.dtype == torch.float32 for m in moments)
    assert all(p.grad is None for p in state.model.parameters())  # freed after the update
    assert bf16.loss != fp32.loss  # the products were rounded to bfloat16 ...
    assert bf16.loss == pytest.approx(fp32.loss, rel=0.05, abs=1e-3)  # ... and only that
    assert bf16.grad_norm == pytest.approx(fp32.grad_norm, rel=0.05)


def engine_logprobs(runner, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Sample ``steps`` tokens after ``prompt`` on slot 0: the tokens and their logprobs."""
    tokens, logprobs, feed, start = [], [], tuple(prompt), 0
    for _ in range(steps):
        (out,) = runner.run([RowWork(0, feed, start, 1.0, 0.0, -1, seed=11)])
        tokens.append(out.token)
        logprobs.append(out.logprob)
        start += len(feed)
        feed = (out.token,)
    return tokens, logprobs


@pytest.mark.parametrize("bf16", [pytest.param(False, id="fp32"), pytest.param(True, id="bf16")])
def test_the_engine_computes_what_training_computes_in_either_precision(ctx, bf16):
    cpu = tier(ctx, bf16)
    torch.manual_seed(4)
    model = cpu.build_model(VOCAB).eval()
    steps = cpu.build_step_group(model, SchedulerConfig(max_requests=2, max_seq_len=32), VOCAB)
    cache = steps.runner.cache
    assert cache.keys.dtype == (torch.bfloat16 if bf16 else torch.float32)
    prompt = [3, 7, 5, 9, 2]
    tokens, engine = engine_logprobs(steps.runner, prompt, steps=12)
    sequence = torch.tensor([prompt + tokens])  # (1, T + 1)
    batch = TrainBatch(
        input_ids=sequence[:, :-1],
        target_ids=sequence[:, 1:],
        loss_mask=torch.ones(1, sequence.shape[1] - 1),
        inference_logprobs=torch.zeros(1, 16),
        advantages=torch.zeros(1),
        temperature=torch.ones(1),
        lengths=torch.tensor([16]),
    )
    policy = cpu.build_policy(TrainState(model, None, None), PolicyConfig.of(step_config(VOCAB)))
    trained = policy.get_logprobs(batch)[0, len(prompt) - 1 :]  # (12,) the generated tokens
    error = (trained - torch.tensor(engine)).abs().max().item()
    if bf16:  # bfloat16 products in both, summed in other orders: bfloat16 rounding apart
        assert 1e-6 < error < 0.01
    else:
        assert error < 1e-5


def outputs_and_grads(model, batch: TrainBatch, ctx, chunk_elements: int, packing=None):
    model.zero_grad(set_to_none=True)
    inputs = model_inputs(batch, ctx.device, packing)
    logprobs, entropy = forward_outputs(
        model, batch, inputs, VOCAB, ctx.tp_group, True, chunk_elements
    )
    mask = batch.loss_mask
    ((logprobs * mask).sum() + 0.1 * (entropy * mask).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return (logprobs * mask).detach(), (entropy * mask).detach(), grads


@pytest.mark.parametrize(
    "untied, packing",
    [
        pytest.param(True, None, id="untied"),
        pytest.param(False, None, id="tied"),
        pytest.param(True, 24, id="packed"),
    ],
)
def test_the_chunked_output_layer_gives_the_whole_layers_values_and_gradients(ctx, untied, packing):
    cpu = tier(ctx, False, untie_embeddings_and_output_weights=untied)
    torch.manual_seed(5)
    model = cpu.build_model(VOCAB)
    batch = a_batch(seed=2)
    whole = outputs_and_grads(model, batch, ctx, chunk_elements=1 << 30, packing=packing)
    chunked = outputs_and_grads(model, batch, ctx, chunk_elements=3 * 24, packing=packing)
    torch.testing.assert_close(chunked[0], whole[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked[1], whole[1], atol=1e-5, rtol=1e-5)
    assert whole[2].keys() == chunked[2].keys()
    for name, grad in whole[2].items():
        torch.testing.assert_close(chunked[2][name], grad, atol=1e-5, rtol=1e-4, msg=name)
