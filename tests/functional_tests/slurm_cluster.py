"""A local Slurm cluster for the functional tests: munged, slurmctld and two slurmd on localhost.

``local_cluster()`` writes slurm.conf, a munge key and the daemons' state and logs into a fresh
temporary folder, on free ports (nothing under /etc is used), and starts the daemons; its two
nodes ``n1`` and ``n2`` are two slurmd processes on this machine. ``unavailable()`` says why this
machine cannot run it (no ``slurm-wlm``/``munge`` binaries, not root).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from golden_values import ROOT, free_port, subprocess_env

SBIN = ("munged", "slurmctld", "slurmd")
BIN = ("sbatch", "scontrol", "squeue", "scancel", "sinfo", "srun")


def slurm_binary(name: str) -> str | None:
    """``name`` on PATH or in /usr/sbin (not always on a non-login PATH)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")


def unavailable() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    missing = [name for name in SBIN + BIN if slurm_binary(name) is None]
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


def wait_until(condition, timeout: float, what: str, cluster_root: Path) -> None:
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
            slurm_binary("munged"),
            "--foreground",
            "--force",
            f"--key-file={key}",
            f"--socket={root}/munge.socket",
            f"--pid-file={root}/munged.pid",
            f"--log-file={root}/munged.log",
            f"--seed-file={root}/munged.seed",
        )
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

        wait_until(socket_ready, 30, "munged socket", root)
        start(slurm_binary("slurmctld"), "-D", "-f", str(conf))
        for node in ("n1", "n2"):
            start(slurm_binary("slurmd"), "-D", "-f", str(conf), "-N", node)
        wait_until(idle, 60, "nodes n1 and n2 idle", root)
        yield cluster
    finally:
        if daemons:
            with contextlib.suppress(Exception):  # end leftover jobs before their slurmd
                Cluster(root, env).run("scancel", "--user=root", check=False)
                wait_until(
                    lambda: not Cluster(root, env).run("squeue", "--noheader", check=False),
                    60,
                    "leftover jobs ended",
                    root,
                )
        for proc in reversed(daemons):
            _stop(proc)
        shutil.rmtree(root, ignore_errors=True)
