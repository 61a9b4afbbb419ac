"""``--check-for-nan-in-loss-and-grad``: a non-finite loss or gradient norm stops the update before
the optimizer applies it, naming the rank and the micro-batch, on every rank alike."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from grpo_testing.batches import build_train_batch
from grpo_testing.distributed import env_without_world, run_on_ranks
from grpo_testing.models import VOCAB
from grpo_testing.rollouts import synthetic_groups
from grpo_testing.trainer import grpo_update, one_rank_context, step_config, train_args
from megatron.core import parallel_state

from megatron.rl.grpo.batch import TrainBatch
from megatron.trainer.checkpoint.directory import TrainState
from megatron.trainer.config import optimizer_settings, tier_config
from megatron.trainer.errors import NonFiniteUpdate
from megatron.trainer.runtime.initialize import initialize_distributed
from megatron.trainer.tiers.cpu import CPUTier
from megatron.trainer.tiers.cuda import ddp_config
from megatron.trainer.train.nonfinite import LossCheck
from megatron.trainer.train.policy import PolicyConfig

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "losses, grad_norm, needle",
    [
        pytest.param([1.0, math.nan, 2.0], 3.0, "micro-batch 1 (of 3) is nan", id="nan-loss"),
        pytest.param(
            [math.inf, 1.0, -math.inf], 3.0, "micro-batches 0, 2 (of 3) is inf, -inf", id="infs"
        ),
        pytest.param([1.0, 2.0], math.inf, "every micro-batch's loss is finite", id="grad-norm"),
        pytest.param([math.nan], math.nan, "the global gradient norm is nan", id="both"),
    ],
)
def test_a_non_finite_loss_or_gradient_norm_is_named(losses, grad_norm, needle):
    check = LossCheck(True, rank=0)
    for value in losses:
        check.record(torch.tensor(value))
    with pytest.raises(NonFiniteUpdate, match="--check-for-nan-in-loss-and-grad") as info:
        check.verify(grad_norm, CPU)
    assert needle in str(info.value)


@pytest.mark.parametrize("enabled", [True, False], ids=["finite", "disabled"])
def test_finite_updates_and_a_disabled_check_pass(enabled):
    check = LossCheck(enabled, rank=0)
    check.record(torch.tensor(1.0 if enabled else math.nan))
    check.verify(2.0 if enabled else math.nan, CPU)


def test_megatron_cores_gradient_check_becomes_this_ranks_message():
    check = LossCheck(True, rank=3)
    check.record(torch.tensor(math.nan))
    found = RuntimeError(
        "Rank 3, node n, device 0, iteration 5: Unexpected result nan (message='found NaN in "
        "local grad norm for bucket #0 in backward pass before data-parallel communication "
        "collective')"
    )
    error = check.megatron_core_error(found)
    assert isinstance(error, NonFiniteUpdate)
    assert str(error).startswith(
        "the update was not applied (--check-for-nan-in-loss-and-grad): rank 3: the loss of "
        "micro-batch 0 (of 1) is nan; megatron-core found a non-finite gradient before the "
        "data-parallel reduction (Rank 3, node n"
    )
    assert check.megatron_core_error(RuntimeError("CUDA out of memory")) is None


@pytest.mark.parametrize("flag", [True, False])
def test_the_flag_sets_megatron_cores_gradient_check(flag):
    args = train_args(check_for_nan_in_loss_and_grad=flag)
    assert ddp_config(optimizer_settings(args)).check_for_nan_in_grad is flag


def with_nan_advantage(batch: TrainBatch, row: int) -> TrainBatch:
    advantages = batch.advantages.clone()
    advantages[row] = math.nan
    return dataclasses.replace(batch, advantages=advantages)


@pytest.fixture
def tier(single_rank_world) -> CPUTier:
    parallel_state.initialize_model_parallel()
    return CPUTier(tier_config(train_args()), one_rank_context())


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_a_nan_advantage_stops_the_update_before_the_optimizer_applies_it(tier, check):
    torch.manual_seed(3)
    model = tier.build_model(VOCAB)
    state = TrainState(model, *tier.build_optimizer(model))
    config = step_config(VOCAB, check_finite=check)  # 8 rows, micro-batches of 4
    batch = with_nan_advantage(build_train_batch(synthetic_groups(2, 4, VOCAB, seed=1), 0), 5)
    before = [p.detach().clone() for p in model.parameters()]
    policy = tier.build_policy(state, PolicyConfig.of(config))
    if not check:  # what the guard prevents: the NaN reaches every weight
        grpo_update(policy, batch, config)
        assert not all(torch.isfinite(p).all() for p in model.parameters())
        return
    with pytest.raises(NonFiniteUpdate) as info:
        grpo_update(policy, batch, config)
    assert "rank 0: the loss of micro-batch 1 (of 2) is nan" in str(info.value)
    assert "the global gradient norm is nan" in str(info.value)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert state.scheduler.num_steps == 0 and not state.optimizer.state


def update_with_a_nan_on_rank_1(rank: int, world_size: int) -> str:
    """One DP update whose only NaN advantage is in rank 1's second micro-batch; the message
    this rank raised."""
    args = train_args()
    ctx = initialize_distributed(args)
    tier = CPUTier(tier_config(args), ctx)
    model = tier.build_model(VOCAB)
    state = TrainState(model, *tier.build_optimizer(model))
    config = step_config(VOCAB)  # 16 rows: 8 per rank, micro-batches of 4
    batch = with_nan_advantage(build_train_batch(synthetic_groups(4, 4, VOCAB, seed=2), 0), 13)
    try:
        grpo_update(tier.build_policy(state, PolicyConfig.of(config)), batch, config)
    except NonFiniteUpdate as exc:
        return str(exc)
    return "applied"


def test_every_data_parallel_rank_stops_with_the_same_message_naming_the_rank():
    messages = run_on_ranks(update_with_a_nan_on_rank_1, 2)
    assert messages[0] == messages[1]
    assert "rank 1: the loss of micro-batch 1 (of 2) is nan" in messages[0]
    assert "rank 0:" not in messages[0]


CUDA_TIER_EMULATED = """
import dataclasses, math, os, sys
import torch
from grpo_testing.emulated_cuda import emulate_cuda_on_cpu
emulate_cuda_on_cpu()
from grpo_testing.models import VOCAB
from grpo_testing.rollouts import synthetic_groups
from grpo_testing.trainer import grpo_update, step_config, train_args
from grpo_testing.batches import build_train_batch
from megatron.trainer.checkpoint.directory import TrainState
from megatron.trainer.runtime.initialize import initialize_distributed
from megatron.trainer.errors import NonFiniteUpdate
from megatron.trainer.train.policy import PolicyConfig
from megatron.trainer.config import tier_config
from megatron.trainer.tiers.cuda import CUDATier

check = sys.argv[1] == "on"
args = train_args(check_for_nan_in_loss_and_grad=check)
torch.cuda.is_available = lambda: False  # gloo and the CPU as the context's device
ctx = initialize_distributed(args)
torch.cuda.is_available = lambda: True
tier = CUDATier(tier_config(args), ctx)
model = tier.build_model(VOCAB)
state = TrainState(model, *tier.build_optimizer(model))
config = step_config(VOCAB, check_finite=check)
batch = build_train_batch(synthetic_groups(2, 4, VOCAB, seed=1), 0)
advantages = batch.advantages.clone()
advantages[5] = math.nan
batch = dataclasses.replace(batch, advantages=advantages)
before = [p.detach().clone() for p in model.parameters()]
try:
    grpo_update(tier.build_policy(state, PolicyConfig.of(config)), batch, config)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print("applied, weights finite:", finite)
except NonFiniteUpdate as exc:
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    print("refused, weights unchanged:", unchanged, exc)
"""


@pytest.mark.parametrize("check", ["on", "off"])
def test_the_cuda_tier_emulated_refuses_the_update_through_megatron_cores_check(tmp_path, check):
    """The CUDA tier on CPU (``grpo_testing.emulated_cuda``; one process: it patches torch)."""
    script = tmp_path / "cuda_tier_nan.py"
    script.write_text(textwrap.dedent(CUDA_TIER_EMULATED))
    root = Path(__file__).resolve().parents[4]
    env = env_without_world(  # a world of one, no port
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(root), str(root / "tests")]),
    )
    proc = subprocess.run(
        [sys.executable, str(script), check],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    if check == "off":
        assert "applied, weights finite: False" in proc.stdout
        return
    assert (
        "refused, weights unchanged: True the update was not applied "
        "(--check-for-nan-in-loss-and-grad): rank 0: the loss of micro-batch 1 (of 2) is nan; "
        "megatron-core found a non-finite gradient before the data-parallel reduction"
    ) in proc.stdout
