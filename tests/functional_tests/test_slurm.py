"""examples/rl/slurm/train_grpo.sh on a real Slurm: munged, slurmctld and two slurmd on localhost.

The cluster lives in a temporary folder (slurm.conf, munge key and socket, state, logs) on free
ports; nothing under /etc is used. Its two nodes ``n1`` and ``n2`` are two slurmd processes on
this machine, so a job can put the env server on a node of its own. Needs root and Debian's
``slurm-wlm`` and ``munge`` (``.ci/run`` installs them): skipped without them, failed under CI.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from golden_values import ROOT, free_port, read_metrics, subprocess_env

pytestmark = pytest.mark.slurm

SCRIPT = "examples/rl/slurm/train_grpo.sh"
SBIN = ("munged", "slurmctld", "slurmd")
BIN = ("sbatch", "scontrol", "squeue", "scancel", "sinfo", "srun")
JOB_TIMEOUT_S = 420.0
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}  # fmt: skip
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


def _slurm_binary(name: str) -> str | None:
    """``name`` on PATH or in /usr/sbin (not always on a non-login PATH)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")


def _unavailable() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    missing = [name for name in SBIN + BIN if _slurm_binary(name) is None]
    if missing:
        return (
            f"Slurm binaries not found: {', '.join(missing)} (apt-get install slurm-wlm munge; "
            ".ci/run does)"
        )
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (slurmd launches jobs as their user)"
    return None


@dataclass
class Cluster:
    """A running local cluster: its folder and the environment that reaches it."""

    root: Path
    env: dict[str, str]

    def run(self, *cmd: str, timeout: float = 30, check: bool = True) -> str:
        """Run a Slurm client command against this cluster; its stdout."""
        proc = subprocess.run(
            cmd, env=self.env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr}")
        return proc.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, ...)."""
        out = self.run("scontrol", "--oneliner", "show", "job", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def logs(self) -> str:
        """The tails of the daemons' logs and outputs."""
        parts = []
        for path in sorted([*self.root.glob("*.log"), *self.root.glob("*.out")]):
            lines = path.read_text(errors="replace").splitlines()[-40:]
            parts.append(f"----- {path.name} (last {len(lines)} lines)\n" + "\n".join(lines))
        return "\n".join(parts)


SLURM_CONF = """\
ClusterName=grpotest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
# No cgroups: processes are tracked through /proc, tasks are not pinned.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Trust the CPU counts below (two slurmd share this machine).
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=10
MinJobAge=600
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n1_port} CPUs=2 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n2_port} CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM a daemon we started, SIGKILL it after 15 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_until(condition, timeout: float, what: str, cluster_root: Path) -> None:
    """Poll ``condition()`` every 0.2 s; fail naming ``what`` (with the logs) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            logs = Cluster(cluster_root, {}).logs()
            raise AssertionError(f"{what} not within {timeout:.0f} s\n{logs}")
        time.sleep(0.2)


@contextlib.contextmanager
def local_cluster() -> Iterator[Cluster]:
    """Start munged, slurmctld and slurmd for n1 and n2 in a fresh folder; stop them after."""
    # munged wants every directory above its socket to be searchable by all: not pytest's tmp.
    root = Path(tempfile.mkdtemp(prefix="grpo-slurm-"))
    root.chmod(0o755)
    (root / "state").mkdir()
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    conf = root / "slurm.conf"
    ports = {"ctld_port": free_port(), "n1_port": free_port(), "n2_port": free_port()}
    conf.write_text(SLURM_CONF.format(root=root, **ports))
    env = {  # never inherit an outer allocation's settings
        k: v
        for k, v in subprocess_env().items()
        if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))
    }
    env["SLURM_CONF"] = str(conf)
    daemons: list[subprocess.Popen] = []

    def start(*cmd: str) -> None:
        log = open(root / f"{Path(cmd[0]).name}-{len(daemons)}.out", "w")
        with log:
            daemons.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))

    try:
        start(
            _slurm_binary("munged"), "--foreground", "--force", f"--key-file={key}",
            f"--socket={root}/munge.socket", f"--pid-file={root}/munged.pid",
            f"--log-file={root}/munged.log", f"--seed-file={root}/munged.seed",
        )  # fmt: skip
        cluster = Cluster(root, env)

        def alive() -> None:
            for proc in daemons:
                assert proc.poll() is None, f"{proc.args[0]} exited\n{cluster.logs()}"

        def socket_ready() -> bool:
            alive()
            return (root / "munge.socket").exists()

        def idle() -> bool:
            alive()
            out = cluster.run("sinfo", "--Node", "--noheader", "--format=%N %t", check=False)
            return sorted(out.split()) == sorted(["n1", "idle", "n2", "idle"])

        _wait_until(socket_ready, 30, "munged socket", root)
        start(_slurm_binary("slurmctld"), "-D", "-f", str(conf))
        for node in ("n1", "n2"):
            start(_slurm_binary("slurmd"), "-D", "-f", str(conf), "-N", node)
        _wait_until(idle, 60, "nodes n1 and n2 idle", root)
        yield cluster
    finally:
        if daemons:
            with contextlib.suppress(Exception):  # end leftover jobs before their slurmd
                Cluster(root, env).run("scancel", "--user=root", check=False)
                _wait_until(
                    lambda: not Cluster(root, env).run("squeue", "--noheader", check=False),
                    60, "leftover jobs ended", root,
                )  # fmt: skip
        for proc in reversed(daemons):
            _stop(proc)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """The module's local cluster; skip (or, under CI, fail) where it cannot run."""
    reason = _unavailable()
    if reason is not None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI is set but the slurm tests cannot run: {reason}", pytrace=False)
        pytest.skip(reason)
    with local_cluster() as running:
        yield running


def submit(cluster: Cluster, tmp_path: Path, nodes: int, script_args: list[str]) -> str:
    """``sbatch`` the launcher from the repository root; the job id."""
    out = cluster.run(
        "sbatch", "--parsable", f"--nodes={nodes}", f"--chdir={ROOT}",
        f"--output={tmp_path}/slurm-%j.out", SCRIPT, f"--run-dir={tmp_path}/run",
        f"--python={sys.executable}", f"--rdzv-port={free_port()}", *script_args,
    )  # fmt: skip
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
        r"^[01]: parallelism  tier: cpu; world 2 = TP 1 x PP 1 x DP 2$", log, re.MULTILINE
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
    args = [f"--model-config={config}", f"--env-config={envs}", "--env-server-node",
            f"--env-server-port={free_port()}", "--", *SHORT_RUN]  # fmt: skip
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
    args = [f"--model-config={config}", "--", "--train-iters=40", "--lr-warmup-iters=2",
            "--save-interval=2"]  # fmt: skip
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
    _wait_until(lambda: cluster.job(job_id)["JobState"] == "PENDING", 120, "requeue", cluster.root)
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
    args = [f"--model-config={config}", "--", "--train-iters=100000", "--lr-warmup-iters=2",
            "--save-interval=100000"]  # fmt: skip
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
