"""Latency of requests from outside training at the trainer's endpoint, under the deterministic
schedule, and whether they change the run.

    python tools/benchmarks/outside_requests.py [--out benchmarks/results] [--steps 60]

A short CPU training run at ``--rl-forced-lag 2`` (a tiny random Llama checkpoint with a chat
template, ``megatron.rl.models.hf.tiny``) whose environment, the digit-copy task, runs behind an
env server, so the trainer starts its inference server; the job's key is set
(``--rl-api-key-file`` for the trainer, ``--api-key-file`` for the env server). While it trains,
one client sends outside requests one after another through the ``openai`` client, alternating
``/v1/completions`` and ``/v1/chat/completions`` (4 tokens each, ``ignore_eos``), with the key
read from the file that the run's ``endpoint`` line names; the URL is that line's. For each
request: the wall-clock latency, and the engine steps from its arrival in the engine to its
answer (a read-only probe in the trainer process wraps ``ContinuousBatchingScheduler.generate``;
nothing under ``megatron/`` is changed). A request that arrives during a training step waits for
the next generation window (the engine is suspended while the weights change), so its wall-clock
latency is bounded by the step's time, not by engine steps. The same run without the client gives
the reference: every step's losses, rewards and policy versions must be bitwise equal.

``--outside-slots 0`` measures the engine without reserved slots (the behaviour before
``--rl-outside-request-slots``). Writes ``outside_requests.json`` and ``outside_requests.md``
(``outside_requests_report.markdown``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchmarks.common import REPO, machine, portable, subprocess_env  # noqa: E402
from tools.benchmarks.outside_requests_report import markdown  # noqa: E402

ENDPOINT = re.compile(
    r"^endpoint\s+(http://\S+/v1) \(OpenAI-style; (?:bearer key from (.+)|no key)\)"
)
COPY_ENV = "- agent_type: digits\n  env_id: copy\n  agent_args: {task: copy}\n"
VARYING = ("seconds", "per_s", "engine_", "generated_tokens", "memory", "time", "queue_depth")
"""Metric names that measure time or count the engine's work (outside requests included), and
the reassembly's ``queue_depth``, which behind an env server depends on when rewards come back
(as ``test_exact_resume.py`` says): every other metric must be bitwise equal."""


@dataclass
class Run:
    """One training run: its metrics, endpoint line and the outside requests it answered."""

    metrics: list[dict[str, Any]]
    endpoint: str
    key_source: str | None
    requests: list[dict[str, Any]] = field(default_factory=list)
    """Per request: ``route``, ``seconds`` (client side), ``answered``, ``engine_steps`` (arrival
    to answer)."""
    models: list[str] = field(default_factory=list)
    """The ids ``GET /v1/models`` listed through the ``openai`` client with the key."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def env_server(workdir: Path, key_file: Path) -> Iterator[str]:
    """``megatron.rl.server.env_server`` serving the digit-copy task with the key; its URL."""
    import httpx

    config = workdir / "server_envs.yaml"
    config.write_text(COPY_ENV)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(workdir / "env_server.log", "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "megatron.rl.server.env_server",
                f"--env-config={config}",
                "--host=127.0.0.1",
                f"--port={port}",
                "--log-level=warning",
                f"--api-key-file={key_file}",
            ],
            cwd=REPO,
            env=subprocess_env(1),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            headers = {"authorization": f"Bearer {key_file.read_text().strip()}"}
            deadline = time.monotonic() + 60
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{url}/health", headers=headers, timeout=1).status_code == 200:
                        break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"env server: {(workdir / 'env_server.log').read_text()}")
                time.sleep(0.2)
            yield url
        finally:
            proc.kill()
            proc.wait()


def training_flags(checkpoint: Path, env_config: Path, key_file: Path, steps: int) -> list[str]:
    """The measured run: forced lag 2, the deterministic schedule (default), the key file."""
    return [
        "--hf-checkpoint",
        str(checkpoint),
        "--env-config",
        str(env_config),
        "--rl-forced-lag",
        "2",
        "--train-iters",
        str(steps),
        "--lr-warmup-iters",
        "1",
        "--seq-length",
        "128",
        "--grpo-prompts-per-step",
        "4",
        "--grpo-group-size",
        "4",
        "--micro-batch-size",
        "8",
        "--inference-max-requests",
        "16",
        "--seed",
        "1234",
        "--rl-api-key-file",
        str(key_file),
        "--plot-file",
        "none",
    ]


def send_requests(url: str, key: str, chat: bool, stop: threading.Event, out: list) -> None:
    """Send outside requests one at a time until ``stop``; each one's route and seconds."""
    import openai

    client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=600)
    for i in range(10**9):
        if stop.is_set():
            return
        route = "chat" if chat and i % 2 else "completions"
        extra = {"ignore_eos": True}
        start = time.perf_counter()
        try:
            if route == "chat":
                client.chat.completions.create(
                    model="policy",
                    messages=[{"role": "user", "content": f"say {i}"}],
                    max_completion_tokens=4,
                    seed=i,
                    extra_body=extra,
                )
            else:
                client.completions.create(
                    model="policy", prompt=f"12{i}", max_tokens=4, seed=i, extra_body=extra
                )
        except (openai.APIConnectionError, openai.InternalServerError) as exc:
            if isinstance(exc, openai.InternalServerError) and exc.status_code != 503:
                raise
            # The run ended (503: its engine shut down) before the answer.
            out.append({"route": route, "seconds": time.perf_counter() - start, "answered": False})
            return
        out.append({"route": route, "seconds": time.perf_counter() - start, "answered": True})
        stop.wait(0.05)


def train(workdir: Path, flags: list[str], outside: bool, chat: bool, timeout_s: float) -> Run:
    """One run of the worker (this file, ``--worker``) with or without the outside client."""
    import openai  # noqa: F401  (before the run: importing it takes a second)

    probe, metrics = workdir / "probe.json", workdir / "metrics.jsonl"
    for path in (probe, metrics):
        path.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        str(probe),
        "--",
        *flags,
        f"--metrics-file={metrics}",
    ]
    log = workdir / "trainer.log"
    key_file = Path(flags[flags.index("--rl-api-key-file") + 1])
    sent: list[dict[str, Any]] = []
    stop = threading.Event()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(1), stdout=out, stderr=out)
        client = None
        try:
            deadline = time.monotonic() + timeout_s
            endpoint = None
            while endpoint is None and proc.poll() is None and time.monotonic() < deadline:
                endpoint = next(
                    filter(None, map(ENDPOINT.match, log.read_text().splitlines())), None
                )
                time.sleep(0.1)
            if endpoint is None:
                raise RuntimeError(f"no endpoint line:\n{log.read_text()[-3000:]}")
            if outside:
                key = key_file.read_text().strip()  # where the endpoint line says the key is
                models = openai_models(endpoint.group(1), key)
                args = (endpoint.group(1), key, chat, stop, sent)
                client = threading.Thread(target=send_requests, args=args, daemon=True)
                client.start()
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
        finally:
            stop.set()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if client is not None:
                client.join(timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"trainer failed ({proc.returncode}):\n{log.read_text()[-3000:]}")
    steps = json.loads(probe.read_text())
    for request, engine_steps in zip([r for r in sent if r["answered"]], steps):
        request["engine_steps"] = engine_steps
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return Run(records, endpoint.group(1), endpoint.group(2), sent, models if outside else [])


def openai_models(url: str, key: str) -> list[str]:
    """The model ids of ``GET /v1/models`` through the ``openai`` client."""
    import openai

    client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=600)
    return [m.id for m in client.models.list()]


def training_values(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each step's metrics without the ones that measure time or the engine's work."""
    return [{k: v for k, v in r.items() if not any(p in k for p in VARYING)} for r in records]


def percentiles(values: list[float]) -> dict[str, float]:
    """p50 and p99 (nearest rank) and the maximum."""
    ordered = sorted(values)
    if not ordered:
        return {"p50": None, "p99": None, "max": None, "n": 0}
    rank = lambda q: ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]  # noqa
    return {"p50": rank(0.5), "p99": rank(0.99), "max": ordered[-1], "n": len(ordered)}


def worker(probe: Path, flags: list[str]) -> None:
    """Train with ``flags``, recording the engine steps of every unkeyed request (arrival to
    answer) in arrival order into ``probe``."""
    from megatron.rl.inference.scheduler import ContinuousBatchingScheduler
    from megatron.trainer.flags.parse import parse_args
    from megatron.trainer.grpo import train as train_run

    generate, steps = ContinuousBatchingScheduler.generate, []

    async def probed(self, prompt_tokens, sampling, seed, key=None, continued=False):
        if key is not None:
            return await generate(self, prompt_tokens, sampling, seed, key, continued)
        before = self.counters.steps
        try:
            return await generate(self, prompt_tokens, sampling, seed, key, continued)
        finally:
            steps.append(self.counters.steps - before)

    ContinuousBatchingScheduler.generate = probed
    try:
        train_run(parse_args(flags))
    finally:
        probe.write_text(json.dumps(steps))


def measure(workdir: Path, steps: int, outside_slots: int | None) -> dict[str, Any]:
    """The reference run and the run with outside requests; their comparison and latencies."""
    from megatron.rl.models.hf.tiny import make_tiny_checkpoint

    checkpoint = make_tiny_checkpoint("llama", workdir / "llama", seed=0)
    key_file = workdir / "job.key"
    key_file.write_text("key-of-the-outside-requests-benchmark\n")
    with env_server(workdir, key_file) as url:
        env_config = workdir / "remote_envs.yaml"
        env_config.write_text(
            f"- agent_type: remote\n  env_id: remote-copy\n  agent_args: {{url: '{url}', "
            "env_id: copy}\n"
        )
        flags = training_flags(checkpoint, env_config, key_file, steps)
        if outside_slots is not None:
            flags += ["--rl-outside-request-slots", str(outside_slots)]
        reference = train(workdir, flags, outside=False, chat=True, timeout_s=900)
        loaded = train(workdir, flags, outside=True, chat=True, timeout_s=900)
    want, got = training_values(reference.metrics), training_values(loaded.metrics)
    differences = [
        {"step": i, "metric": k, "without": w.get(k), "with": g.get(k)}
        for i, (w, g) in enumerate(zip(want, got))
        for k in sorted(set(w) | set(g))
        if w.get(k) != g.get(k)
    ]
    equal = want == got
    requests = [r for r in loaded.requests if r["answered"]]
    unanswered = [r["seconds"] for r in loaded.requests if not r["answered"]]
    return {
        "flags": flags,
        "endpoint_key_source": loaded.key_source,
        "models": loaded.models,
        "steps": len(loaded.metrics),
        "metrics_bitwise_equal": equal,
        "differences": differences[:20],
        "requests": requests,
        "unanswered_seconds": unanswered,
        "outside_request_slots": outside_slots,
        "seconds": percentiles([r["seconds"] for r in requests]),
        "engine_steps": percentiles([r["engine_steps"] for r in requests]),
        "by_route": {
            route: percentiles([r["seconds"] for r in requests if r["route"] == route])
            for route in sorted({r["route"] for r in requests})
        },
        "train_seconds": percentiles([m["train_seconds"] for m in loaded.metrics]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--steps", type=int, default=60, help="Training steps of each run.")
    parser.add_argument(
        "--outside-slots",
        type=int,
        default=None,
        help="--rl-outside-request-slots of the runs (default: the flag's).",
    )
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("flags", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker is not None:
        worker(opts.worker, opts.flags[1:] if opts.flags[:1] == ["--"] else opts.flags)
        return
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(Path(tmp), opts.steps, opts.outside_slots)
    result = portable({**result, "machine": machine()})
    name = (
        "outside_requests"
        if opts.outside_slots is None
        else f"outside_requests_slots{opts.outside_slots}"
    )
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (opts.out / f"{name}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
