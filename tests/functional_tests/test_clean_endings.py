"""Every bad input and every fault ends cleanly: one message naming the problem, a non-zero
status within seconds, nothing half-written, the checkpoint directory still loadable.

Runs ``pretrain_grpo.py`` directly, under ``megatron.trainer.launch`` (the README's command) and
under plain torchrun, whose own report of a failed worker cannot be changed from a worker (see
``megatron/trainer/launch.py``) but shows the worker's message as the root cause.
"""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from golden_values import ROOT, read_metrics, subprocess_env, training_command

TINY = {"train-iters": 2, "lr-warmup-iters": 0, "rl-forced-lag": 1, "grpo-prompts-per-step": 4,
        "grpo-group-size": 4, "micro-batch-size": 8}  # fmt: skip
SHARD = Path("iter_0000002") / "mp_rank_00" / "model_optim_rng.pt"


def python_command(args: dict) -> list[str]:
    argv = [f"--{k}" if v is True else f"--{k}={v}" for k, v in args.items()]
    return [sys.executable, "pretrain_grpo.py", *argv]


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
        path.write_bytes(bytes(random.Random(0).randrange(256) for _ in range(len(data))))
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
    step = 2 if kind == "garbage-tracker" else 1
    resumed = tmp_path / "resumed.jsonl"
    proc, _ = run(python_command({**args, "ckpt-step": step, "metrics-file": resumed}), 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m["step"] for m in read_metrics(resumed)] == list(range(step, 4))
    print(f"{kind}: exited 1 in {seconds:.1f} s: {message}")


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


def stop_with_sigterm(cmd: list[str], metrics: Path, after_steps: int) -> tuple[int, float, str]:
    """Start ``cmd``, send SIGTERM to it after ``after_steps`` steps; (status, seconds to exit
    after the signal, stdout)."""
    with (
        open(metrics.with_suffix(".out"), "w") as out,
        open(metrics.with_suffix(".err"), "w") as err,
    ):
        proc = subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(), stdout=out, stderr=err)
        deadline = time.monotonic() + 300
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= after_steps):
            assert proc.poll() is None, metrics.with_suffix(".err").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=120)
        seconds = time.monotonic() - signalled
    return status, seconds, metrics.with_suffix(".out").read_text()


@pytest.mark.parametrize(
    "launcher, nproc, status",
    [
        pytest.param(None, 1, 143, id="python"),
        pytest.param("megatron.trainer.launch", 2, 143, id="launcher-dp2"),
        pytest.param("torch.distributed.run", 1, 1, id="plain-torchrun"),
    ],
)
def test_sigterm_drains_saves_and_exits_143_and_the_run_resumes(tmp_path, launcher, nproc, status):
    save, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    args = {**TINY, "train-iters": 100000, "save": save, "save-interval": 100000,
            "metrics-file": metrics}  # fmt: skip
    cmd = (
        python_command(args)
        if launcher is None
        else training_command(nproc, args, launcher=launcher)
    )
    code, seconds, out = stop_with_sigterm(cmd, metrics, after_steps=3)
    assert code == status  # plain torchrun: its SignalException (the workers exited 143)
    iteration = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert f"SIGTERM: stopped after step {iteration - 1}, saved iteration {iteration}" in out
    assert [m["step"] for m in read_metrics(metrics)] == list(range(iteration))
    assert not list(save.glob("*.partial"))
    if launcher != "torch.distributed.run":
        assert "Traceback" not in metrics.with_suffix(".err").read_text()
    resumed = {**args, "train-iters": iteration + 1, "load": save}
    proc, _ = run(python_command(resumed) if nproc == 1 else training_command(nproc, resumed), 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_metrics(metrics)[-1]["step"] == iteration
    print(f"SIGTERM ({launcher or 'python'}): exit {code} {seconds:.1f} s after the signal")
