"""The checkpoint directory protocol with the CPU tier's shards: full round trip, atomic writes,
and refusing an incompatible resume."""

from __future__ import annotations

import argparse
import copy
import json
import random

import pytest
import torch
from grpo_testing.models import tiny_args, tiny_gpt
from grpo_testing.rollouts import synthetic_groups
from grpo_testing.trainer import one_rank_context

from megatron.rl.rollout.generator import PipelineState
from megatron.trainer.checkpoint import directory as checkpointing
from megatron.trainer.checkpoint.directory import TRACKER, TrainState
from megatron.trainer.config import optimizer_settings
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.tiers.cpu_checkpoint import TorchShards
from megatron.trainer.train.optimizer import build_optimizer, load_optimizer_state

pytestmark = pytest.mark.usefixtures("single_rank_world")


def run_args(**overrides) -> argparse.Namespace:
    args = tiny_args()
    args = args.with_flags(
        seed=3,
        lr=1e-2,
        min_lr=1e-3,
        lr_warmup_iters=0,
        lr_decay_style="cosine",
        train_iters=10,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.99,
        adam_eps=1e-8,
        rl_forced_lag=2,
        grpo_prompts_per_step=2,
        grpo_group_size=4,
    )
    args = args.with_flags(**overrides)
    return args


def context() -> ParallelContext:
    return one_rank_context()


def pipeline_state(next_batch_id: int) -> PipelineState:
    groups = synthetic_groups(2, 4, 21, seed=next_batch_id)
    groups = [
        g.model_copy(update={"batch_id": next_batch_id + i // 2, "index_in_batch": i % 2})
        for i, g in enumerate(groups * 2)
    ]
    return PipelineState(
        next_batch_id=next_batch_id,
        submitted=next_batch_id + 2,
        forced_lag=2,
        groups_per_batch=2,
        group_size=4,
        groups=groups,
    )


def fresh_state(seed: int):
    """A model with its optimizer and LR scheduler as a starting run builds them."""
    model = tiny_gpt(seed=seed)
    optimizer, scheduler = build_optimizer(model, optimizer_settings(run_args()))
    return model, optimizer, scheduler


def trained_state(seed: int):
    """A model and optimizer after one AdamW step (so the optimizer has state to save)."""
    model, optimizer, scheduler = fresh_state(seed)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.1 * (seed + 1))
    optimizer.step()
    scheduler.step(1)
    return model, optimizer, scheduler


def assert_same_state(got, want, path="optimizer") -> None:
    """Nested state dicts equal value by value (tensors bitwise)."""
    assert type(got) is type(want), path
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want), path
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for key in want:
            assert_same_state(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_state(g, w, f"{path}[{i}]")
    else:
        assert got == want, path


def save_checkpoint(root, iteration, model, optimizer, scheduler, pipeline, args, ctx):
    """The protocol's save with the CPU tier's shards."""
    state = TrainState(model, optimizer, scheduler)
    checkpointing.save_checkpoint(root, iteration, TorchShards(ctx), state, pipeline, args, ctx)


def load_checkpoint(root, model, optimizer, scheduler, args, ctx):
    """The protocol's load with the CPU tier's shards."""
    state = TrainState(model, optimizer, scheduler)
    return checkpointing.load_checkpoint(root, TorchShards(ctx), state, args, ctx)


def test_round_trip_restores_weights_optimizer_scheduler_and_pipeline(tmp_path):
    model, optimizer, scheduler = trained_state(seed=1)
    state = pipeline_state(7)
    save_checkpoint(str(tmp_path), 7, model, optimizer, scheduler, state, run_args(), context())

    fresh, fresh_opt, fresh_sched = fresh_state(seed=2)
    resumed = load_checkpoint(str(tmp_path), fresh, fresh_opt, fresh_sched, run_args(), context())

    assert resumed.iteration == 7 and resumed.pipeline == state
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
    assert_same_state(fresh_opt.state_dict(), optimizer.state_dict())
    assert fresh_sched.state_dict() == scheduler.state_dict()
    assert (tmp_path / TRACKER).read_text() == "7\n"
    assert not list(tmp_path.glob("*.partial")) and not list(tmp_path.rglob("*.tmp"))


def test_a_crash_during_a_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    model, optimizer, scheduler = trained_state(seed=1)
    save_checkpoint(
        str(tmp_path), 5, model, optimizer, scheduler, pipeline_state(5), run_args(), context()
    )
    saved = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}

    def crash(obj, path):
        open(path, "wb").write(b"half a checkpoint")
        raise OSError("disk full")

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    monkeypatch.setattr(checkpointing.torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(
            str(tmp_path),
            10,
            model,
            optimizer,
            scheduler,
            pipeline_state(10),
            run_args(),
            context(),
        )
    monkeypatch.undo()

    assert (tmp_path / TRACKER).read_text() == "5\n"
    fresh, fresh_opt, fresh_sched = fresh_state(seed=2)
    resumed = load_checkpoint(str(tmp_path), fresh, fresh_opt, fresh_sched, run_args(), context())
    assert resumed.iteration == 5 and resumed.pipeline == pipeline_state(5)
    for key, value in saved.items():
        assert torch.equal(fresh.state_dict()[key], value)

    # The next save at the same step succeeds over the debris of the crashed one.
    save_checkpoint(
        str(tmp_path), 10, model, optimizer, scheduler, pipeline_state(10), run_args(), context()
    )
    assert (tmp_path / TRACKER).read_text() == "10\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000005", "iter_0000010", TRACKER]


@pytest.mark.parametrize(
    "flag, value",
    [
        pytest.param("rl_forced_lag", 1, id="lag"),
        pytest.param("grpo_group_size", 8, id="group-size"),
        pytest.param("seed", 4, id="seed"),
        pytest.param("grpo_max_generation_rounds", 2, id="dynamic-sampling-rounds"),
    ],
)
def test_resume_with_a_different_contract_flag_is_refused_naming_it(tmp_path, flag, value):
    model, optimizer, scheduler = trained_state(seed=1)
    save_checkpoint(
        str(tmp_path), 3, model, optimizer, scheduler, pipeline_state(3), run_args(), context()
    )
    with pytest.raises(SystemExit) as exc:
        load_checkpoint(
            str(tmp_path), model, optimizer, scheduler, run_args(**{flag: value}), context()
        )
    message = str(exc.value)
    assert f"--{flag.replace('_', '-')}" in message and str(tmp_path) in message


def test_missing_rollout_state_is_named(tmp_path):
    model, optimizer, scheduler = trained_state(seed=1)
    save_checkpoint(
        str(tmp_path), 3, model, optimizer, scheduler, pipeline_state(3), run_args(), context()
    )
    (tmp_path / "iter_0000003" / "rollout_state.json").unlink()
    with pytest.raises(SystemExit, match="rollout_state.json"):
        load_checkpoint(str(tmp_path), model, optimizer, scheduler, run_args(), context())


def test_a_resumed_run_drops_metrics_records_it_trains_again(tmp_path):
    from megatron.trainer.metrics.record import MetricsWriter

    path = tmp_path / "metrics.jsonl"
    lines = [f'{{"step": {s}, "loss": {s / 10}}}\n' for s in range(13)] + ['{"step": 13, "lo']
    path.write_text("".join(lines))  # steps 0-12, then a line torn by kill -9
    writer = MetricsWriter(train_iters=20, log_interval=100, metrics_file=str(path), first_step=10)
    writer.write({"step": 10, "loss": 9.0})
    writer.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(11))
    assert records[9]["loss"] == 0.9 and records[10]["loss"] == 9.0


def test_resume_flags_added_later_take_their_defaults_for_older_checkpoints():
    saved = checkpointing.saved_args(run_args())
    del saved["grpo_max_generation_rounds"], saved["grpo_filter_groups_with_same_reward"]
    args = run_args(grpo_max_generation_rounds=1, grpo_filter_groups_with_same_reward=False)
    assert checkpointing.resume_mismatches(saved, args) == []
    changed = run_args(grpo_max_generation_rounds=2, grpo_filter_groups_with_same_reward=True)
    assert checkpointing.resume_mismatches(saved, changed) == [
        "--grpo-filter-groups-with-same-reward False -> True",
        "--grpo-max-generation-rounds 1 -> 2",
    ]


def corrupt(path, how: str) -> None:
    """Damage ``path`` as a crash, a bad copy or a disk error would."""
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "random":
        path.write_bytes(bytes(random.Random(0).randrange(256) for _ in range(len(data))))
    else:
        path.write_text(how)


@pytest.mark.parametrize(
    "target, how, reason",
    [
        pytest.param("shard", "truncate", "PytorchStreamReader", id="truncated-shard"),
        pytest.param("shard", "random", "UnpicklingError", id="random-shard"),
        pytest.param("rollout", "truncate", "json_invalid", id="truncated-rollout-state"),
        pytest.param(TRACKER, "garbage", "holds 'garbage'", id="garbage-tracker"),
    ],
)
def test_an_unreadable_checkpoint_names_flag_file_iteration_and_the_older_one(
    tmp_path, target, how, reason
):
    model, optimizer, scheduler = trained_state(seed=1)
    for iteration in (3, 6):
        save_checkpoint(
            str(tmp_path),
            iteration,
            model,
            optimizer,
            scheduler,
            pipeline_state(iteration),
            run_args(),
            context(),
        )
    files = {
        "shard": tmp_path / "iter_0000006" / "mp_rank_00" / "model_optim_rng.pt",
        "rollout": tmp_path / "iter_0000006" / "rollout_state.json",
        TRACKER: tmp_path / TRACKER,
    }
    corrupt(files[target], how)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    fresh, fresh_opt, fresh_sched = fresh_state(seed=2)
    with pytest.raises(SystemExit) as exc:
        load_checkpoint(str(tmp_path), fresh, fresh_opt, fresh_sched, run_args(), context())
    message = str(exc.value)
    assert message.startswith(f"--load {tmp_path}: ") and str(files[target]) in message
    assert reason in message and "\n" not in message
    assert (target == TRACKER) or "iteration 6" in message
    want = "complete checkpoint" if target == TRACKER else "older complete checkpoint"
    if target == TRACKER:  # the newest one with its files is named (6 is intact here)
        assert f"the newest {want} is iteration 6" in message
    else:
        assert f"the newest {want} is iteration 3" in message and "--ckpt-step 3" in message
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written

    args = run_args()
    resumed = checkpointing.load_checkpoint(
        str(tmp_path),
        TorchShards(context()),
        TrainState(fresh, fresh_opt, fresh_sched),
        args,
        context(),
        step=3,
    )
    assert resumed.iteration == 3 and resumed.pipeline == pipeline_state(3)


def test_ckpt_step_of_a_missing_iteration_is_named(tmp_path):
    model, optimizer, scheduler = trained_state(seed=1)
    save_checkpoint(
        str(tmp_path), 3, model, optimizer, scheduler, pipeline_state(3), run_args(), context()
    )
    with pytest.raises(SystemExit, match="no checkpoint of iteration 5 .*iteration 3"):
        checkpointing.load_checkpoint(
            str(tmp_path),
            TorchShards(context()),
            TrainState(model, optimizer, scheduler),
            run_args(),
            context(),
            step=5,
        )


def test_a_checkpoint_of_the_multi_tensor_adamw_resumes_on_the_fused_one():
    model, optimizer, _ = fresh_state(seed=1)
    assert all(g["fused"] for g in optimizer.param_groups)
    # the optimizer as this trainer built it before: torch's default multi-tensor AdamW
    old = torch.optim.AdamW([{**g, "fused": None, "foreach": True} for g in optimizer.param_groups])
    for step in range(2):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.1 * (step + 1))
        old.step()
    saved = copy.deepcopy(old.state_dict())  # as torch.save / torch.load hand it back
    resumed_model, resumed, _ = fresh_state(seed=1)
    resumed_model.load_state_dict(model.state_dict())
    load_optimizer_state(resumed, saved)
    assert all(g["fused"] and not g["foreach"] for g in resumed.param_groups)
    assert_same_state(resumed.state_dict()["state"], saved["state"])
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        p.grad, q.grad = torch.full_like(p, -0.2), torch.full_like(q, -0.2)
    old.step()
    resumed.step()  # the same update, by the fused kernel (up to rounding)
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        torch.testing.assert_close(q, p)
