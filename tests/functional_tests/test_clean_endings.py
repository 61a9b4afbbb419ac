"""Every bad input and every fault ends cleanly: one message naming the problem, a non-zero
status within seconds, nothing half-written, the checkpoint directory still loadable.

Runs ``pretrain_grpo.py`` directly, under ``megatron.trainer.launch`` (the README's command) and
under plain torchrun, whose own report of a failed worker cannot be changed from a worker (see
``megatron/trainer/launch.py``) but shows the worker's message as the root cause.
"""

from __future__ import annotations

import math
import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from golden_values import (
    ROOT,
    python_command,
    read_metrics,
    subprocess_env,
    training_command,
)

TINY = {
    "train-iters": 2,
    "lr-warmup-iters": 0,
    "rl-forced-lag": 1,
    "grpo-prompts-per-step": 4,
    "grpo-group-size": 4,
    "micro-batch-size": 8,
}
SHARD = Path("iter_0000002") / "mp_rank_00" / "model_optim_rng.pt"


def run(cmd: list[str], timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run(
        cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=timeout
    )
    return proc, time.monotonic() - start


def error_lines(stderr: str) -> list[str]:
    """stderr without library warnings (megatron-core warns about Apex and TE on import)."""
    return [
        line
        for line in stderr.splitlines()
        if line.strip() and "Warning" not in line and "warnings.warn" not in line
    ]


def assert_one_message(proc: subprocess.CompletedProcess, *needles: str) -> str:
    lines = error_lines(proc.stderr)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr
    messages = [line for line in lines if "error:" in line]
    assert len(messages) == 1, lines
    for needle in needles:
        assert needle in messages[0], messages[0]
    return messages[0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A run saved at iteration 1 and 2 (``--save-interval 1``)."""
    root = tmp_path_factory.mktemp("ckpt") / "CK"
    proc, _ = run(python_command({**TINY, "save": root, "save-interval": 1}), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def corrupt(root: Path, kind: str) -> Path:
    """Damage one file of the checkpoint as the issue's reproductions did; the file."""
    files = {
        "truncated-shard": root / SHARD,
        "random-shard": root / SHARD,
        "garbage-tracker": root / "latest_checkpointed_iteration.txt",
        "truncated-rollout-state": root / "iter_0000002" / "rollout_state.json",
    }
    path = files[kind]
    data = path.read_bytes()
    if kind == "random-shard":
        path.write_bytes(random.Random(0).randbytes(len(data)))
    elif kind == "garbage-tracker":
        path.write_text("garbage\n")
    else:
        path.write_bytes(data[: len(data) // 2])
    return path


@pytest.mark.parametrize(
    "kind", ["truncated-shard", "random-shard", "garbage-tracker", "truncated-rollout-state"]
)
def test_corrupt_checkpoint_names_load_the_file_and_the_iteration_to_fall_back_to(
    checkpoint, tmp_path, kind
):
    root = tmp_path / "CK"
    shutil.copytree(checkpoint, root)
    path = corrupt(root, kind)
    before = sorted(str(p) for p in root.rglob("*"))
    args = {**TINY, "train-iters": 4, "load": root}
    proc, seconds = run(python_command(args))
    message = assert_one_message(proc, f"--load {root}", str(path))
    assert seconds < 60
    if kind == "garbage-tracker":
        assert "holds 'garbage'" in message and "--ckpt-step 2" in message
    else:
        assert "iteration 2" in message and "--ckpt-step 1" in message
    assert sorted(str(p) for p in root.rglob("*")) == before  # nothing written
    print(f"{kind}: exited 1 in {seconds:.1f} s: {message}")
    # The suggested --ckpt-step resumes. The kinds that damage iteration 2 fall back to
    # iteration 1 alike (its files are untouched): one of them resumes, as the tracker's does.
    if kind in ("truncated-shard", "garbage-tracker"):
        step = 2 if kind == "garbage-tracker" else 1
        resumed = tmp_path / "resumed.jsonl"
        proc, _ = run(python_command({**args, "ckpt-step": step, "metrics-file": resumed}), 300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert [m["step"] for m in read_metrics(resumed)] == list(range(step, 4))


def test_corrupt_checkpoint_under_the_launcher_with_two_ranks_prints_one_message(
    checkpoint, tmp_path
):
    root = tmp_path / "CK"
    shutil.copytree(checkpoint, root)
    corrupt(root, "truncated-shard")
    proc, seconds = run(training_command(2, {**TINY, "train-iters": 4, "load": root}))
    assert_one_message(proc, f"--load {root}", "--ckpt-step 1")
    assert proc.returncode == 1 and seconds < 90


@pytest.mark.parametrize(
    "flag, value, problem",
    [
        pytest.param("metrics-file", "F/m.jsonl", "F is not a directory", id="metrics-under-file"),
        pytest.param("metrics-file", "D", "is a directory", id="metrics-is-directory"),
        pytest.param("metrics-file", "/proc/m/m.jsonl", "cannot write there", id="metrics-proc"),
        pytest.param("save", "F/ck", "F is not a directory", id="save-under-file"),
    ],
)
@pytest.mark.parametrize("nproc", [0, 2], ids=["python", "launcher-dp2"])
def test_unusable_output_path_exits_before_anything_is_built(tmp_path, nproc, flag, value, problem):
    (tmp_path / "F").write_text("a file")
    (tmp_path / "D").mkdir()
    path = value if value.startswith("/") else str(tmp_path / value)
    args = {**TINY, flag: path}
    cmd = python_command(args) if nproc == 0 else training_command(nproc, args)
    proc, seconds = run(cmd)
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0] == "pretrain_grpo.py: error: invalid arguments:" and len(lines) == 2, lines
    assert lines[1].startswith(f"  --{flag} {path}: ") and problem in lines[1], lines
    assert "tier:" not in proc.stdout  # nothing was built
    assert seconds < (30 if nproc == 0 else 60)
    print(f"--{flag} {value} ({'python' if nproc == 0 else 'launcher'}): {seconds:.1f} s")


@pytest.mark.parametrize("nproc", [0, 2], ids=["python", "launcher-dp2"])
def test_env_config_entry_that_leaves_no_room_for_a_prompt_exits_2_naming_it(tmp_path, nproc):
    config = tmp_path / "envs.yaml"
    data = ROOT / "examples/rl/environments/math/tiny_arithmetic.jsonl"
    config.write_text(
        "- agent_type: examples.rl.environments.math:MathEnvironment\n  env_id: math\n"
        f"  agent_args: {{path: {data}, max_tokens: 32}}\n"
    )
    args = {**TINY, "env-config": config, "seq-length": 32}
    proc, seconds = run(python_command(args) if nproc == 0 else training_command(nproc, args))
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert lines == [
        "pretrain_grpo.py: error: invalid arguments:",
        f"  --env-config {config}, entry 'math': agent_args.max_tokens (32) must be smaller than "
        "--seq-length (32) to leave room for the prompt",
    ]
    assert "tier:" not in proc.stdout  # nothing was built
    assert seconds < (30 if nproc == 0 else 60)


def test_sequence_too_short_for_any_prompt_stops_with_the_engines_reason():
    args = {**TINY, "seq-length": 4, "rl-default-max-tokens": 3}
    proc, seconds = run(python_command(args))
    assert_one_message(proc, "every rollout of batch 0 failed", "max_seq_len=4")
    assert seconds < 60


def test_environment_over_its_failure_budget_stops_the_run_naming_it(tmp_path):
    config = tmp_path / "envs.yaml"
    config.write_text("- agent_type: grpo_testing.fakes:RaisingDigits\n  env_id: raising\n")
    args = {**TINY, "train-iters": 20, "env-config": config, "rl-max-failed-rollout-fraction": 0.1}
    proc, seconds = run(python_command(args))
    assert proc.returncode == 1 and seconds < 60
    messages = [line for line in error_lines(proc.stderr) if "error:" in line]
    assert len(messages) == 1 and messages[0].startswith("pretrain_grpo.py: error: environment")
    assert "'raising'" in messages[0] and "above the limit of 10%" in messages[0]
    # The environment's first raise is logged once, with its traceback; the exit has none.
    assert proc.stderr.count("Traceback") == 1 and proc.stderr.count("raised on group") == 1


def test_env_server_unreachable_at_start_up_is_one_message(tmp_path):
    config = tmp_path / "envs.yaml"
    config.write_text(
        "- agent_type: remote\n  env_id: far\n"
        "  agent_args: {url: 'http://127.0.0.1:9', max_retries: 1, backoff_s: 0.01}\n"
    )
    proc, seconds = run(training_command(1, {**TINY, "env-config": config}))
    assert_one_message(proc, "env server http://127.0.0.1:9")
    assert proc.returncode == 1 and seconds < 60


def test_plain_torchrun_shows_the_workers_message_as_the_root_cause(tmp_path):
    """torchrun's ChildFailedError report cannot be avoided from a worker; its root cause line
    carries the message instead of a link to torch's documentation."""
    root = tmp_path / "missing"
    root.mkdir()
    cmd = training_command(1, {**TINY, "load": root}, launcher="torch.distributed.run")
    proc, _ = run(cmd)
    assert proc.returncode == 1
    assert f"traceback : --load {root}: no latest_checkpointed_iteration.txt" in proc.stderr


# --------------------------------------------------------------------------- hangs and NaNs

FAULTY = "tests/grpo_testing/faulty_train.py"
TIMEOUT_MINUTES = 0.15
"""The watchdog's timeout in these runs (9 s): each waits it out once; their start-up and steps
take a fraction of it."""
WATCHDOG = {
    **TINY,
    "train-iters": 6,
    "rl-forced-lag": 0,
    "micro-batch-size": 4,
    "watchdog-timeout-minutes": TIMEOUT_MINUTES,
}


def assert_checkpoints_intact(save: Path, iterations: list[int]) -> None:
    """``save`` holds exactly the finished checkpoints of ``iterations``, the tracker names the
    last, and no save was left half-written."""
    assert int((save / "latest_checkpointed_iteration.txt").read_text()) == iterations[-1]
    assert sorted(p.name for p in save.iterdir() if p.is_dir()) == [
        f"iter_{i:07d}" for i in iterations
    ]


def stacks_files(message: str) -> list[Path]:
    """The stacks files of every rank that the watchdog's message names."""
    pattern = Path(message.rsplit(" are in ", 1)[1])
    return sorted(pattern.parent.glob(pattern.name))


@pytest.mark.parametrize("silent_from", [0, 1], ids=["first-step", "later-step"])
def test_an_environment_that_never_answers_is_stopped_by_the_watchdog(tmp_path, silent_from):
    config = tmp_path / "envs.yaml"
    config.write_text(
        "- agent_type: grpo_testing.fakes:SilentDigits\n  env_id: silent\n"
        f"  agent_args: {{silent_from_batch: {silent_from}}}\n"
    )
    save, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    args = {
        **WATCHDOG,
        "env-config": config,
        "save": save,
        "save-interval": 1,
        "metrics-file": metrics,
    }
    proc, seconds = run(python_command(args))
    message = assert_one_message(
        proc,
        f"pretrain_grpo.py: error: no progress in {TIMEOUT_MINUTES:g} min: step {silent_from} "
        "has not finished "
        "(watchdog, --watchdog-timeout-minutes); rank 0 waits in megatron/trainer/generation/host.py:",
        f"stacks of every rank are in {tmp_path}/watchdog-",
    )
    assert proc.returncode == 1 and TIMEOUT_MINUTES * 60 <= seconds < 90
    (stacks,) = stacks_files(message)  # next to --metrics-file
    text = stacks.read_text()
    assert f"step {silent_from} has not finished after {TIMEOUT_MINUTES:g} min" in text
    assert "in next_batch" in text  # the main thread's Python stack (faulthandler)
    assert text.count("in SilentDigits.group_rollout") == 4  # the event loop's tasks: 4 groups
    steps = [m["step"] for m in read_metrics(metrics)] if metrics.exists() else []
    assert steps == list(range(silent_from))
    if silent_from:
        assert_checkpoints_intact(save, [1])
    else:  # nothing was saved, nothing was started
        assert not save.exists() or not any(save.iterdir())
    print(f"silent environment: exit 1 after {seconds:.1f} s: {message}")


def test_a_rank_that_never_enters_a_collective_is_stopped_by_the_watchdog(tmp_path):
    save, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    args = {
        **WATCHDOG,
        "hang-rank": 1,
        "hang-at-step": 2,
        "save": save,
        "save-interval": 1,
        "metrics-file": metrics,
    }
    proc, seconds = run(training_command(2, args, script=FAULTY))
    message = assert_one_message(
        proc,
        f"no progress in {TIMEOUT_MINUTES:g} min: step 2 has not finished",
        "rank 0 waits in megatron/trainer/train/optimizer.py:",
        "(allreduce_gradients)",
    )
    assert proc.returncode == 1 and TIMEOUT_MINUTES * 60 <= seconds < 120
    rank0, rank1 = stacks_files(message)
    assert "in all_reduce" in rank0.read_text() and "in hanging" in rank1.read_text()
    assert [m["step"] for m in read_metrics(metrics)] == [0, 1]
    assert_checkpoints_intact(save, [1, 2])
    print(f"rank 1 out of its collective: exit 1 after {seconds:.1f} s: {message}")


def test_a_non_finite_logit_stops_its_step_before_the_update_naming_rank_and_micro_batch(
    tmp_path,
):
    save, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    args = {
        **WATCHDOG,
        "inf-logits-rank": 1,
        "inf-logits-at-step": 1,
        "inf-logits-micro-batch": 1,
        "save": save,
        "save-interval": 1,
        "metrics-file": metrics,
    }
    proc, seconds = run(training_command(2, args, script=FAULTY))
    message = assert_one_message(proc)
    assert message == (
        "pretrain_grpo.py: error: step 1: the update was not applied "
        "(--check-for-nan-in-loss-and-grad): rank 1: the loss of micro-batch 1 (of 2) is nan"
    )
    assert proc.returncode == 1 and seconds < 90
    assert [m["step"] for m in read_metrics(metrics)] == [0]
    assert_checkpoints_intact(save, [1])


def test_nan_rewards_are_masked_rollouts_and_the_run_trains_on(tmp_path):
    config = tmp_path / "envs.yaml"
    config.write_text("- agent_type: grpo_testing.fakes:NaNRewardDigits\n  env_id: nan\n")
    metrics = tmp_path / "metrics.jsonl"
    proc, _ = run(
        python_command({**TINY, "train-iters": 4, "env-config": config, "metrics-file": metrics})
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(metrics)
    assert sum(m["placeholder_rollouts"] for m in records) > 0
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in records)
    assert "reward is not finite: nan" in proc.stderr  # the first one is logged, once
