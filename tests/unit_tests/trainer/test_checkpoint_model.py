"""The model that serve and evaluate load: a trainer checkpoint's weights into the model of the
flags (CPU tier), its iteration as the policy version, and refusals that name the flag."""

from __future__ import annotations

import pytest
import torch
from grpo_testing.trainer import one_rank_context
from megatron.core import parallel_state

from megatron.rl.rollout.generator import PipelineState
from megatron.trainer.checkpoint import directory as checkpointing
from megatron.trainer.checkpoint.directory import TrainState
from megatron.trainer.checkpoint_model import (
    architecture_mismatches,
    default_model_name,
    load_checkpoint_model,
)
from megatron.trainer.config import tier_config
from megatron.trainer.flags.parse import parse_args
from megatron.trainer.flags.run import RunConfig
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.tiers import CPUTier


def context() -> ParallelContext:
    """This process as a world of one (megatron-core's parallel state set up)."""
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    return one_rank_context()


def flags(*argv: str) -> RunConfig:
    """The trainer's validated flags of the default tiny model (character tokenizer)."""
    return parse_args(["--num-layers", "2", "--hidden-size", "32", *argv])


def save_trained(root: str, iteration: int, seed: int) -> dict[str, torch.Tensor]:
    """A trainer checkpoint of a freshly initialized model at ``iteration``; its weights."""
    args, ctx = flags("--seed", str(seed)), context()
    torch.manual_seed(seed)
    tier = CPUTier(tier_config(args), ctx)
    model = tier.build_model(vocab_size=21)
    state = TrainState(model, *tier.build_optimizer(model))
    pipeline = PipelineState(
        next_batch_id=iteration,
        submitted=iteration,
        forced_lag=0,
        groups_per_batch=1,
        group_size=2,
        groups=[],
    )
    shards = tier.checkpoint_shards()
    checkpointing.save_checkpoint(root, iteration, shards, state, pipeline, args, ctx)
    return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


@pytest.fixture
def checkpoint(single_rank_world, tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    """``CK`` with iterations 2 and 4 (the tracker's), and the weights of iteration 4."""
    root = str(tmp_path / "CK")
    save_trained(root, 2, seed=1)
    return root, save_trained(root, 4, seed=2)


def test_a_trainer_checkpoint_loads_its_weights_and_iteration(checkpoint):
    root, weights = checkpoint
    loaded = load_checkpoint_model(flags("--load", root, "--seed", "9"), context())
    assert loaded.policy_version == 4 and loaded.source == f"--load {root} (iteration 4)"
    assert not loaded.model.training
    assert all(not p.requires_grad for p in loaded.model.parameters())
    state = loaded.model.state_dict()
    for name, value in weights.items():
        assert torch.equal(state[name], value), name
    older = load_checkpoint_model(flags("--load", root, "--ckpt-step", "2"), context())
    assert older.policy_version == 2
    assert not torch.equal(
        older.model.state_dict()["embedding.word_embeddings.weight"],
        weights["embedding.word_embeddings.weight"],
    )


def test_another_architecture_is_refused_naming_the_flags(checkpoint):
    root, _ = checkpoint
    with pytest.raises(SystemExit) as exc:
        load_checkpoint_model(flags("--load", root, "--hidden-size", "64"), context())
    message = str(exc.value.code)
    assert message.startswith(
        f"--load {root}: iteration 4 was saved with --hidden-size 32 (here: 64)"
    )
    assert "architecture flags" in message


def test_a_missing_iteration_names_the_one_to_load(checkpoint):
    root, _ = checkpoint
    with pytest.raises(SystemExit) as exc:
        load_checkpoint_model(flags("--load", root, "--ckpt-step", "3"), context())
    message = str(exc.value.code)
    assert "iteration 3" in message and "--ckpt-step 2" in message


@pytest.mark.parametrize(
    "saved, now, expected",
    [
        pytest.param({"num_layers": 2}, {"num_layers": 2}, [], id="same"),
        pytest.param({"num_layers": 2}, {"num_layers": 4}, ["--num-layers 2 (here: 4)"], id="diff"),
        pytest.param({}, {"qk_layernorm": False}, [], id="flag-added-later-is-off"),
        pytest.param({}, {"kv_channels": None}, [], id="unset-is-not-saved"),
        pytest.param({}, {"kv_channels": 16}, ["--kv-channels None (here: 16)"], id="set-now-only"),
        pytest.param(
            {"swiglu": True}, {"swiglu": False}, ["--swiglu True (here: False)"], id="switch"
        ),
    ],
)
def test_architecture_mismatches(saved, now, expected):
    assert architecture_mismatches(saved, now) == expected


def test_the_default_model_name_is_the_checkpoint_directory(tmp_path):
    hf, ck = tmp_path / "Qwen2.5-0.5B", tmp_path / "runs" / "ck"
    assert default_model_name(RunConfig().with_flags(hf_checkpoint=str(hf))) == hf.name
    assert default_model_name(RunConfig().with_flags(load=f"{ck}/", hf_checkpoint=str(hf))) == "ck"
