"""Remote environments end to end: a real uvicorn env server process and torchrun trainers."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import golden_values
import httpx
import pytest
from golden_values import (
    ROOT,
    TOLERANCES,
    remote_env_config,
    run_training,
    subprocess_env,
    training_command,
)

COMMON = {"rl-forced-lag": 2, "train-iters": 12, "lr-warmup-iters": 2, "seed": 1234}
COPY_ENV = "- agent_type: digits\n  env_id: copy\n  agent_args: {task: copy}\n"


@contextlib.contextmanager
def env_server(
    tmp_path: Path,
    config: str = COPY_ENV,
    log_level: str = "warning",
    api_key_file: Path | None = None,
):
    """A real env server process serving ``config`` (see ``golden_values.env_server``)."""
    with golden_values.env_server(tmp_path, config, log_level, api_key_file) as served:
        yield served


def remote_config(tmp_path: Path, url: str, env_id: str = "copy") -> Path:
    return remote_env_config(tmp_path, url, [env_id])


@contextlib.contextmanager
def training_in_background(tmp_path: Path, cmd: list[str], min_steps: int):
    """Start a trainer (output to files, never a full pipe), wait for ``min_steps`` steps."""
    metrics = tmp_path / "metrics.jsonl"
    stderr = tmp_path / "trainer.err"
    with open(tmp_path / "trainer.out", "w") as out, open(stderr, "w") as err:
        trainer = subprocess.Popen(
            [*cmd, f"--metrics-file={metrics}"],
            cwd=ROOT,
            env=subprocess_env(),
            stdout=out,
            stderr=err,
        )
        try:
            deadline = time.monotonic() + 120
            while not (metrics.exists() and len(metrics.read_text().splitlines()) >= min_steps):
                assert trainer.poll() is None, stderr.read_text()[-3000:]
                assert time.monotonic() < deadline, "the trainer made no progress"
                time.sleep(0.2)
            yield trainer, metrics, stderr
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()


def test_killing_the_env_server_makes_the_trainer_exit_naming_it(tmp_path):
    with env_server(tmp_path) as (url, server):
        args = {**COMMON, "train-iters": 100000, "env-config": remote_config(tmp_path, url)}
        cmd = training_command(1, args)
        with training_in_background(tmp_path, cmd, min_steps=3) as (trainer, _, stderr):
            server.kill()
            killed = time.monotonic()
            trainer.wait(timeout=60)
            elapsed = time.monotonic() - killed
    assert trainer.returncode == 1
    assert elapsed < 60
    errors = [line for line in stderr.read_text().splitlines() if "error:" in line]
    assert len(errors) == 1 and f"env server {url}" in errors[0], errors
    assert "Traceback" not in stderr.read_text()
    print(f"trainer exited {elapsed:.1f} s after the env server was killed")


def test_env_server_shuts_down_cleanly_on_sigterm(tmp_path):
    with env_server(tmp_path, log_level="info") as (url, server):
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=20) == 0
    log = (tmp_path / "env_server.log").read_text()
    assert "environments and connections closed" in log
    assert "Traceback" not in log


def test_trainer_exits_on_sigterm_and_shuts_its_pipeline_down(tmp_path):
    with env_server(tmp_path) as (url, server):
        args = {**COMMON, "train-iters": 100000, "env-config": remote_config(tmp_path, url)}
        # Without torchrun, so that the signal reaches the trainer itself.
        cmd = [sys.executable, "pretrain_grpo.py", *[f"--{k}={v}" for k, v in args.items()]]
        with training_in_background(tmp_path, cmd, min_steps=2) as (trainer, metrics, _):
            trainer.send_signal(signal.SIGTERM)
            trainer.wait(timeout=30)
        assert trainer.returncode == 128 + signal.SIGTERM
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # server unaffected
    for line in metrics.read_text().splitlines():
        json.loads(line)  # every record is complete


def test_failing_remote_environment_masks_rollouts_and_training_continues(tmp_path):
    config = "- agent_type: grpo_testing.fakes:FlakyDigits\n  env_id: flaky\n"
    with env_server(tmp_path, config) as (url, _):
        metrics = run_training(1, {**COMMON, "env-config": remote_config(tmp_path, url, "flaky")})
    assert len(metrics) == COMMON["train-iters"]
    failed = [m["placeholder_rollouts"] for m in metrics]
    assert sum(failed) > 0 and all(f < 64 for f in failed)


def test_raising_environment_gives_the_same_run_in_process_and_remote(tmp_path):
    """One fault policy: the groups a raising environment fails become the same placeholders
    in process and behind the env server, so the two runs log the same metrics."""
    config = "- agent_type: grpo_testing.fakes:RaisingDigits\n  env_id: raising\n"
    (tmp_path / "local.yaml").write_text(config)
    local = run_training(1, {**COMMON, "env-config": tmp_path / "local.yaml"})
    with env_server(tmp_path, config) as (url, _):
        remote = run_training(1, {**COMMON, "env-config": remote_config(tmp_path, url, "raising")})
    assert len(local) == len(remote) == COMMON["train-iters"]
    assert sum(m["placeholder_rollouts"] for m in local) > 0
    assert not all(m["batch_complete"] for m in local)
    for metric in [*TOLERANCES, "complete_groups", "batch_complete", "batch_id"]:
        assert [m[metric] for m in remote] == [m[metric] for m in local], metric
    log = (tmp_path / "env_server.log").read_text()
    assert log.count("Traceback") == 1 and "KeyError" in log  # the first raise, logged once


def test_keyed_servers_train_with_the_key_and_refuse_a_trainer_without_it(tmp_path):
    key = tmp_path / "key"
    key.write_text("job-key-123\n")
    with env_server(tmp_path, api_key_file=key) as (url, _):
        args = {**COMMON, "train-iters": 3, "env-config": remote_config(tmp_path, url)}
        metrics = run_training(1, {**args, "rl-api-key-file": key})
        assert [m["step"] for m in metrics] == [0, 1, 2]
        proc = subprocess.run(
            training_command(1, args),
            cwd=ROOT,
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"env server {url}" in proc.stderr and "HTTP 401" in proc.stderr
    assert "job-key-123" not in proc.stderr + (tmp_path / "env_server.log").read_text()


def test_environment_failing_everywhere_stops_the_run_with_its_error(tmp_path):
    config = tmp_path / "broken.yaml"
    config.write_text("- agent_type: grpo_testing.fakes:BrokenDigits\n  env_id: broken\n")
    proc = subprocess.run(
        training_command(1, {**COMMON, "env-config": config}),
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "every rollout of batch 0 failed" in proc.stderr
    assert "dataset shard missing" in proc.stderr and "(broken)" in proc.stderr


def test_env_server_sustains_256_concurrent_grouped_requests_without_errors(tmp_path):
    """tools/env_server_load.py: one client, 256 requests in flight, zero errors."""
    report = tmp_path / "load.json"
    proc = subprocess.run(
        [
            sys.executable,
            "tools/env_server_load.py",
            "--concurrency=256",
            "--requests=1024",
            f"--json={report}",
        ],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(report.read_text())
    assert result["errors"] == 0 and result["peak_in_flight"] == 256
    print(proc.stdout)


def test_a_reward_model_behind_the_env_server_scores_as_in_process(tmp_path):
    """agent_type reward_model on the env server (the model loads in the server): the trainer
    gets each rollout's reward_components over HTTP and logs reward/rm/reward_model, as the same
    config in process does."""
    import yaml

    from megatron.rl.models.hf.tiny import make_tiny_reward_model

    entries = yaml.safe_load(
        (ROOT / "examples/rl/environment_configs/reward_model.yaml").read_text()
    )
    entries[0]["agent_args"]["model_dir"] = str(make_tiny_reward_model(tmp_path / "rm"))
    config = yaml.safe_dump(entries)
    local = tmp_path / "local.yaml"
    local.write_text(config)
    args = {**COMMON, "train-iters": 4}
    in_process = run_training(1, {**args, "env-config": local})
    with env_server(tmp_path, config) as (url, _):
        remote = run_training(1, {**args, "env-config": remote_config(tmp_path, url, "rm")})
    assert len(remote) == len(in_process) == 4
    for r, p in zip(remote, in_process):
        assert r["placeholder_rollouts"] == p["placeholder_rollouts"] == 0
        assert r["staleness_max"] == p["staleness_max"] == min(r["step"], 2)
        assert r["reward/rm/reward_model"] == pytest.approx(p["reward/rm/reward_model"], abs=1e-5)
        assert r["reward_mean/rm"] == pytest.approx(r["reward/rm/reward_model"])
