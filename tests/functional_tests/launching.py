"""Launching the trainer and its servers in tests: torchrun command lines, the environment of
spawned processes, reading their metrics, killing a whole job, a real env server on a free port.

``golden_values.py`` (the golden cases) and the functional tests use these; ``golden_values``
re-exports them, so ``from golden_values import run_training`` keeps working.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORLD_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def training_command(
    nproc: int,
    args: dict,
    script: str = "pretrain_grpo.py",
    launcher: str = "megatron.trainer.launch",
) -> list[str]:
    """The command line of ``script`` with ``args`` (flag -> value; True: a switch) under
    ``launcher`` (the README's ``megatron.trainer.launch``, or ``torch.distributed.run``)."""
    argv = flag_argv(args)
    return [
        sys.executable,
        "-m",
        launcher,
        f"--nproc-per-node={nproc}",
        # the launcher's own store binds a port of the kernel's choice, which it hands to the
        # workers: no window in which another job can take a port picked here
        "--standalone",
        script,
        *argv,
    ]


def python_command(args: dict) -> list[str]:
    """``python pretrain_grpo.py`` with ``args`` (no launcher: a world of one)."""
    return [sys.executable, "pretrain_grpo.py", *flag_argv(args)]


def flag_argv(args: dict) -> list[str]:
    """``--flag=value`` per entry of ``args`` (flag without dashes -> value; True: a switch)."""
    return [f"--{k}" if v is True else f"--{k}={v}" for k, v in args.items()]


def subprocess_env() -> dict[str, str]:
    """Environment of spawned trainers/servers: one thread each, tests/ importable, and no
    distributed world's variables (a launcher sets its workers' own; a process alone needs none,
    and a world set up in this process must not leak into it)."""
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    own = {k: v for k, v in os.environ.items() if k not in WORLD_VARIABLES}
    return dict(own, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=path)


def read_metrics(path: Path) -> list[dict]:
    """The per-step records of a ``--metrics-file``."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_training(
    nproc: int, args: dict, timeout: float = 600, script: str = "pretrain_grpo.py"
) -> list[dict]:
    """Run ``script`` (pretrain_grpo.py) under torchrun with ``args``; its per-step metrics."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        cmd = training_command(nproc, {**args, "metrics-file": metrics}, script)
        proc = subprocess.run(
            cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=timeout
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
            )
        return read_metrics(metrics)


def checkpoint_of_iteration(root: Path, iteration: int, dest: Path) -> Path:
    """A ``--load`` folder ``dest`` whose latest checkpoint is ``root``'s at ``iteration``.

    Resuming from it continues the run that saved ``root`` (same flags, same ``--train-iters``),
    as if that run had stopped after ``iteration`` steps.
    """
    name = f"iter_{iteration:07d}"
    shutil.copytree(root / name, dest / name)
    (dest / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
    return dest


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    return tree


def kill_job(pid: int) -> None:
    """``kill -9`` every process of a torchrun job (its workers run in their own sessions)."""
    for p in process_tree(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def run_until_step_then_kill(nproc: int, args: dict, metrics: Path, step: int) -> None:
    """Start the job; ``kill -9`` all its processes once ``step`` is logged (a crash).

    Rank 0 stops itself right after logging ``step`` (``stop_after_step.py``), so the crash
    falls at that point however slowly this poller runs.
    """
    with tempfile.TemporaryFile() as err:
        script = str(Path(__file__).with_name("stop_after_step.py").relative_to(ROOT))
        cmd = training_command(nproc, {**args, "metrics-file": metrics}, script)
        env = {**subprocess_env(), "GRPO_TEST_STOP_AFTER_STEP": str(step)}
        job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 600
            while not (metrics.exists() and any(m["step"] >= step for m in read_metrics(metrics))):
                if job.poll() is not None:
                    err.seek(0)
                    raise RuntimeError(f"the job ended before step {step}:\n{err.read()[-4000:]}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the job did not reach step {step} in 600 s")
                time.sleep(0.05)
        finally:
            kill_job(job.pid)
            job.wait()
    logged = [m["step"] for m in read_metrics(metrics)]
    assert logged[-1] == step, f"the job logged steps {logged}; it should have stopped at {step}"


@contextlib.contextmanager
def env_server(
    workdir: Path, config: str, log_level: str = "warning", api_key_file: Path | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run ``python -m megatron.rl.server.env_server`` on a free port until the block exits
    (requiring the key in ``api_key_file``, if given).

    Yields the server's URL (once ``/health`` answers) and its process. A port taken by another
    job between picking it and the server binding it is picked again (up to three times).
    """
    env_config = workdir / "server_envs.yaml"
    env_config.write_text(config)
    log_path = workdir / "env_server.log"
    for attempt in range(3):
        port = free_port()
        command = [
            sys.executable,
            "-m",
            "megatron.rl.server.env_server",
            f"--env-config={env_config}",
            "--host=127.0.0.1",
            f"--port={port}",
            f"--log-level={log_level}",
            *([f"--api-key-file={api_key_file}"] if api_key_file else []),
        ]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                command, cwd=ROOT, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT
            )
        url = f"http://127.0.0.1:{port}"
        try:
            if _wait_for_health(url, proc, api_key_file):
                yield url, proc
                return
            output = log_path.read_text()
            if "address already in use" not in output or attempt == 2:
                raise RuntimeError(f"the env server exited:\n{output}")
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _wait_for_health(url: str, proc: subprocess.Popen, api_key_file: Path | None) -> bool:
    """Whether the server at ``url`` answers ``/health`` (False: its process exited first)."""
    import httpx

    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(httpx.TransportError):
            key = api_key_file.read_text().strip() if api_key_file else None
            headers = {"authorization": f"Bearer {key}"} if key else {}
            if httpx.get(f"{url}/health", timeout=1, headers=headers).status_code == 200:
                return True
        if proc.poll() is not None:
            return False
        if time.monotonic() > deadline:
            raise TimeoutError("the env server did not answer /health within 60 s")
        time.sleep(0.2)


def remote_env_config(workdir: Path, url: str, env_ids: list[str]) -> Path:
    """An env config of one ``remote`` agent per env id of the server at ``url``."""
    path = workdir / "remote_envs.yaml"
    path.write_text(
        "".join(
            f"- agent_type: remote\n  env_id: remote-{e}\n"
            f"  agent_args: {{url: '{url}', env_id: {e}, max_retries: 2, backoff_s: 0.2}}\n"
            for e in env_ids
        )
    )
    return path
