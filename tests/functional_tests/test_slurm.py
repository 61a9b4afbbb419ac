"""examples/rl/slurm/train_grpo.sh on a real Slurm: munged, slurmctld and two slurmd on localhost.

The cluster (``slurm_cluster.local_cluster``) lives in a temporary folder (slurm.conf, munge key
and socket, state, logs) on free ports; nothing under /etc is used. Its two nodes ``n1`` and
``n2`` are two slurmd processes on this machine, so a job can put the env server on a node of its
own. Needs root and Debian's ``slurm-wlm`` and ``munge`` (``.ci/run`` installs them): skipped
without them, failed under CI.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from golden_values import ROOT, free_port, read_metrics
from slurm_cluster import Cluster, local_cluster, unavailable, wait_until

pytestmark = pytest.mark.slurm

SCRIPT = "examples/rl/slurm/train_grpo.sh"
JOB_TIMEOUT_S = 420.0
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}
SHORT_RUN = ["--train-iters=5", "--lr-warmup-iters=2", "--seed=1234"]

MODEL_ARGS_CONFIG = """\
# tiny CPU model (MODEL_ARGS convention)
MODEL_ARGS=(
    --num-layers 2 --hidden-size 64 --num-attention-heads 4  # shape
    --seq-length 32 --micro-batch-size 32
)
"""
PLAIN_FLAGS_CONFIG = """\
# tiny CPU model (flags only)
--num-layers 2 --hidden-size 64
--num-attention-heads 4 --seq-length 32  # shape
"""
ENV_CONFIG = """\
- agent_type: digits
  env_id: copy
  agent_args: {task: copy}
  weight: 3
- agent_type: digits
  env_id: add
  agent_args: {task: add, max_digits: 2}
  weight: 1
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """The module's local cluster; skip (or, under CI, fail) where it cannot run."""
    reason = unavailable()
    if reason is not None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI is set but the slurm tests cannot run: {reason}", pytrace=False)
        pytest.skip(reason)
    with local_cluster() as running:
        yield running


def submit(cluster: Cluster, tmp_path: Path, nodes: int, script_args: list[str]) -> str:
    """``sbatch`` the launcher from the repository root; the job id."""
    out = cluster.run(
        "sbatch",
        "--parsable",
        f"--nodes={nodes}",
        f"--chdir={ROOT}",
        f"--output={tmp_path}/slurm-%j.out",
        SCRIPT,
        f"--run-dir={tmp_path}/run",
        f"--python={sys.executable}",
        f"--rdzv-port={free_port()}",
        *script_args,
    )
    return out.strip().split(";")[0]


def diagnostics(cluster: Cluster, tmp_path: Path, job_id: str) -> str:
    """Job state, job output, env server log and daemon logs, for a failure message."""
    parts = [f"----- scontrol show job {job_id}\n{cluster.job(job_id)}"]
    for path in [*sorted(tmp_path.glob("slurm-*.out")), tmp_path / "run" / "env_server.log"]:
        if path.exists():
            text = path.read_text(errors="replace")[-6000:]
            parts.append(f"----- {path.name}\n{text}")
    parts.append(cluster.logs())
    return "\n".join(parts)


def wait_for_job(
    cluster: Cluster, tmp_path: Path, job_id: str, timeout: float = JOB_TIMEOUT_S
) -> dict[str, str]:
    """Wait until the job has ended; its ``scontrol show job`` record (cancelled on timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        job = cluster.job(job_id)
        if job["JobState"] in FINAL_STATES:
            return job
        if time.monotonic() > deadline:
            details = diagnostics(cluster, tmp_path, job_id)
            cluster.run("scancel", job_id, check=False)
            pytest.fail(f"job {job_id} still {job['JobState']} after {timeout:.0f} s\n{details}")
        time.sleep(0.5)


def assert_completed(cluster: Cluster, tmp_path: Path, job_id: str, job: dict[str, str]) -> None:
    """The job ended COMPLETED with exit code 0 (else the logs are shown)."""
    if job["JobState"] != "COMPLETED" or job["ExitCode"] != "0:0":
        details = diagnostics(cluster, tmp_path, job_id)
        pytest.fail(f"job {job_id} ended {job['JobState']} ({job['ExitCode']})\n{details}")


def test_sbatch_runs_a_five_step_cpu_job_on_two_nodes(cluster, tmp_path):
    config = tmp_path / "tiny.sh"
    config.write_text(MODEL_ARGS_CONFIG)
    start = time.monotonic()
    job_id = submit(cluster, tmp_path, 2, [f"--model-config={config}", "--", *SHORT_RUN])
    job = wait_for_job(cluster, tmp_path, job_id)
    print(f"job {job_id}: {job['JobState']} in {time.monotonic() - start:.1f} s")
    assert_completed(cluster, tmp_path, job_id, job)
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]
    assert all(m["lag"] == 2 for m in metrics)  # the launcher's default --rl-forced-lag
    tracker = tmp_path / "run" / "checkpoints" / "latest_checkpointed_iteration.txt"
    assert tracker.read_text().strip() == "5"  # saved at the end
    log = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert "training on n1 n2 (1 ranks each)" in log
    # One torchrun per node (srun --label prefixes its task number) with one rank each, joined into
    # one world of two; rank 0 (the only one that logs) is on whichever node joined first.
    assert re.search(
        r"^[01]: parallelism  tier: cpu \| allocator \w+; world 2 = TP 1 x PP 1 x DP 2$",
        log,
        re.MULTILINE,
    )
    assert re.search(r"^[01]: step     4/5", log, re.MULTILINE)


def test_bad_arguments_fail_the_job_with_a_message(cluster, tmp_path):
    job_id = submit(cluster, tmp_path, 1, ["--", *SHORT_RUN])
    job = wait_for_job(cluster, tmp_path, job_id)
    assert job["JobState"] == "FAILED" and job["ExitCode"] == "2:0"
    log = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert "error: --model-config FILE is required" in log


def test_env_server_runs_on_a_node_of_its_own(cluster, tmp_path):
    config, envs = tmp_path / "tiny_flags.txt", tmp_path / "envs.yaml"
    config.write_text(PLAIN_FLAGS_CONFIG)
    envs.write_text(ENV_CONFIG)
    args = [
        f"--model-config={config}",
        f"--env-config={envs}",
        "--env-server-node",
        f"--env-server-port={free_port()}",
        "--",
        *SHORT_RUN,
    ]
    job_id = submit(cluster, tmp_path, 2, args)
    job = wait_for_job(cluster, tmp_path, job_id)
    assert_completed(cluster, tmp_path, job_id, job)
    assert job["NodeList"] == "n[1-2]"
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]
    assert {"reward_mean/copy", "reward_mean/add"} <= set(metrics[0])
    assert sum(m["placeholder_rollouts"] for m in metrics) == 0
    log = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert "env server on n2" in log and "training on n1 " in log
    server_log = (tmp_path / "run" / "env_server.log").read_text()
    assert "POST /v1/grouped_rollouts" in server_log
    assert "environments and connections closed" in server_log  # stopped with SIGTERM


def test_requeued_job_resumes_from_its_last_checkpoint(cluster, tmp_path):
    config = tmp_path / "tiny.sh"
    config.write_text(MODEL_ARGS_CONFIG)
    args = [
        f"--model-config={config}",
        "--",
        "--train-iters=40",
        "--lr-warmup-iters=2",
        "--save-interval=2",
    ]
    job_id = submit(cluster, tmp_path, 1, args)
    tracker = tmp_path / "run" / "checkpoints" / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not tracker.exists():
        if cluster.job(job_id)["JobState"] in FINAL_STATES:
            details = diagnostics(cluster, tmp_path, job_id)
            pytest.fail(f"job {job_id} ended before its first checkpoint\n{details}")
        assert time.monotonic() < deadline, diagnostics(cluster, tmp_path, job_id)
        time.sleep(0.1)
    # What Slurm sends before the time limit (--signal=B:USR1@300): the script requeues itself.
    cluster.run("scancel", "--batch", "--signal=USR1", job_id)
    wait_until(lambda: cluster.job(job_id)["JobState"] == "PENDING", 120, "requeue", cluster.root)
    # A requeued job waits ~2 min before it is eligible again; start it now.
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    job = wait_for_job(cluster, tmp_path, job_id)
    assert_completed(cluster, tmp_path, job_id, job)
    assert job["Restarts"] == "1"

    log = (tmp_path / f"slurm-{job_id}.out").read_text()  # both runs (--open-mode=append)
    resumed = re.search(r"resuming from \S+, iteration (\d+)", log)
    assert resumed, log[-4000:]
    iteration = int(resumed.group(1))
    assert 2 <= iteration < 40
    # The resumed run dropped the first run's records of steps it trains again: each step once.
    steps = [m["step"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert steps == list(range(40))
    print(f"requeued and resumed at iteration {iteration}")


def test_scancel_stops_the_trainer_after_a_step_with_a_checkpoint(cluster, tmp_path):
    """scancel sends SIGTERM to every process of the job: the trainer finishes its step, drains,
    saves and exits 143 within Slurm's KillWait (10 s here), with no traceback in the log."""
    config = tmp_path / "tiny.sh"
    config.write_text(MODEL_ARGS_CONFIG)
    args = [
        f"--model-config={config}",
        "--",
        "--train-iters=100000",
        "--lr-warmup-iters=2",
        "--save-interval=100000",
    ]
    job_id = submit(cluster, tmp_path, 1, args)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        if cluster.job(job_id)["JobState"] in FINAL_STATES:
            pytest.fail(f"job {job_id} ended early\n{diagnostics(cluster, tmp_path, job_id)}")
        assert time.monotonic() < deadline, diagnostics(cluster, tmp_path, job_id)
        time.sleep(0.2)
    cluster.run("scancel", job_id)
    job = wait_for_job(cluster, tmp_path, job_id)
    assert job["JobState"] == "CANCELLED", diagnostics(cluster, tmp_path, job_id)
    tracker = tmp_path / "run" / "checkpoints" / "latest_checkpointed_iteration.txt"
    assert tracker.exists(), diagnostics(cluster, tmp_path, job_id)
    iteration = int(tracker.read_text())
    log = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert f"SIGTERM: stopped after step {iteration - 1}, saved iteration {iteration}" in log, log
    assert "Traceback" not in log and "ChildFailedError" not in log, log
    assert [m["step"] for m in read_metrics(metrics)] == list(range(iteration))
    assert not list((tmp_path / "run" / "checkpoints").glob("*.partial"))
    print(f"scancel: saved iteration {iteration}")
