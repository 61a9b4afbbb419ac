"""Megatron-LM's run flags, end to end under torchrun: --exit-interval, --finetune, --no-load-optim,
--no-load-rng, --eval-iters, --global-batch-size below a collection, wandb (offline), and the
default warmup with a short --train-iters."""

from __future__ import annotations

import os
import subprocess

import pytest
from golden_values import ROOT, run_training as run, subprocess_env, training_command

SMALL = {
    "rl-forced-lag": 1,
    "train-iters": 4,
    "lr-warmup-iters": 1,
    "grpo-prompts-per-step": 4,
    "grpo-group-size": 4,
    "micro-batch-size": 8,
    "seed": 5,
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 4-iteration run that exits after 2 iterations (--exit-interval), saving first."""
    root = tmp_path_factory.mktemp("exit")
    metrics = run(1, {**SMALL, "save": root / "ck", "exit-interval": 2})
    return root / "ck", metrics


def test_exit_interval_saves_then_exits_cleanly(saved):
    ck, metrics = saved
    assert [m["step"] for m in metrics] == [0, 1]
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "2\n"


def test_the_default_warmup_with_five_iterations_runs_under_torchrun():
    metrics = run(1, {"rl-forced-lag": 2, "train-iters": 5})
    assert [m["staleness_max"] for m in metrics] == [0, 1, 2, 2, 2]
    assert all(a["lr"] < b["lr"] for a, b in zip(metrics, metrics[1:]))  # warming up throughout


def test_finetune_loads_the_weights_and_starts_a_new_run(saved):
    ck, _ = saved
    fresh = run(1, {**SMALL, "train-iters": 2})
    tuned = run(1, {**SMALL, "train-iters": 2, "load": ck, "finetune": True})
    assert [m["step"] for m in tuned] == [0, 1]
    assert tuned[0]["batch_id"] == 0 and tuned[0]["staleness_max"] == 0  # a new pipeline
    assert tuned[0]["lr"] == fresh[0]["lr"]  # a new LR schedule
    assert tuned[0]["loss"] != fresh[0]["loss"]  # other weights: the saved ones


def test_no_load_optim_keeps_the_weights_and_drops_the_adam_moments(saved):
    ck, _ = saved
    full = run(1, {**SMALL, "load": ck})
    no_optim = run(1, {**SMALL, "load": ck, "no-load-optim": True})
    no_rng = run(1, {**SMALL, "load": ck, "no-load-rng": True})
    assert [m["step"] for m in full] == [m["step"] for m in no_optim] == [2, 3]
    assert no_optim[0]["loss"] == full[0]["loss"]  # same weights and rollouts
    assert no_optim[0]["lr"] != full[0]["lr"]  # the LR schedule restarts with the optimizer
    assert no_optim[1]["loss"] != full[1]["loss"]  # fresh moments, another update
    assert [m["loss"] for m in no_rng] == [
        m["loss"] for m in full
    ]  # sampling is seeded per request


def test_eval_iters_turns_evaluation_on_at_the_end():
    metrics = run(1, {**SMALL, "eval-iters": 1, "eval-prompts": 2, "eval-samples": 2})
    evaluated = [m["step"] for m in metrics if "eval/greedy_reward" in m]
    assert evaluated == [3]


def test_a_global_batch_below_the_collection_trains_it_in_several_iterations():
    args = {**SMALL, "global-batch-size": 8, "grpo-iterations": 2, "train-iters": 8}
    metrics = run(1, args)
    assert [m["batch_id"] for m in metrics] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [m["batch_staleness"] for m in metrics] == [0] * 4 + [1] * 4
    assert len({m["lr"] for m in metrics}) == 8


def test_wandb_offline_writes_its_files(tmp_path):
    pytest.importorskip("wandb")
    env = {**subprocess_env(), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    args = {
        **SMALL,
        "train-iters": 2,
        "wandb-project": "grpo-test",
        "wandb-exp-name": "offline",
        "wandb-save-dir": tmp_path / "wb",
        "metrics-file": tmp_path / "m.jsonl",
    }
    proc = subprocess.run(
        training_command(1, args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(p.suffix == ".wandb" for p in runs[0].iterdir())
    assert os.path.getsize(next(p for p in runs[0].iterdir() if p.suffix == ".wandb")) > 0
