"""Load test of the env server: many concurrent grouped-rollout requests from one client.

    python tools/env_server_load.py --concurrency 256 --requests 4096

By default the tool starts two processes: an env server (``python -m
megatron.rl.server.env_server``, the built-in digit-copy task unless ``--env-config``) and a
stub inference server standing in for the trainer (answers every completion at once with the
copied digits), so that the numbers measure the env server and its HTTP paths, not a model.
``--url``/``--inference-url`` point it at servers that are already running instead.

One client (one ``ClientPool``) keeps ``--concurrency`` requests in flight until ``--requests``
have completed, then reports errors and latency percentiles (and ``--json`` writes them).
Each grouped request makes the env server issue ``--group-size`` completion calls.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron.rl.http_client import ClientPool  # noqa: E402
from megatron.rl.inference.interface import InferenceInterface  # noqa: E402
from megatron.rl.tokenizer import CharTokenizer  # noqa: E402
from megatron.rl.wire import (  # noqa: E402
    GroupedRolloutCall,
    GroupedRolloutRequest,
    InferenceRequest,
    InferenceResponse,
    RolloutGroup,
)


class CopyingInference(InferenceInterface):
    """Completes a digit prompt with its digits (the copy task's answer), instantly."""

    def __init__(self) -> None:
        self.tokenizer = CharTokenizer()

    async def generate(self, request: InferenceRequest) -> InferenceResponse:
        """The digits before the task marker, then EOS."""
        prompt = request.prompt or self.tokenizer.decode(request.prompt_tokens)
        text = prompt.rstrip("=:,")[: request.sampling.max_tokens - 1]
        tokens = self.tokenizer.encode(text) + [self.tokenizer.eos_id]
        return InferenceResponse(
            prompt_tokens=self.tokenizer.encode(prompt),
            tokens=tokens,
            text=text,
            logprobs=[-0.01] * len(tokens),
            policy_versions=[0] * len(tokens),
            finish_reason="stop",
        )


def serve_stub_inference(port: int) -> None:
    """Run the stub inference server until killed."""
    import uvicorn

    from megatron.rl.server.inference_server import create_inference_app

    stub = CopyingInference()
    app = create_inference_app(stub, stub.tokenizer)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def spawned(cmd: list[str], health_url: str):
    """Start ``cmd`` and wait until ``health_url`` answers 200."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(health_url, timeout=1).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(cmd)} did not start")
            time.sleep(0.2)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


async def run_load(
    url: str, inference_url: str, requests: int, concurrency: int, group_size: int
) -> dict:
    """Fire the requests and return the measured statistics."""
    pool = ClientPool(concurrency, httpx.Timeout(300.0, connect=10.0))
    latencies: list[float] = []
    errors: list[str] = []
    slots = asyncio.Semaphore(concurrency)
    in_flight = peak = 0

    async def one(i: int) -> None:
        nonlocal in_flight, peak
        call = GroupedRolloutCall(
            request=GroupedRolloutRequest(
                batch_id=i // 64,
                index_in_batch=i % 64,
                groups_in_batch=64,
                group_size=group_size,
                seed=0,
                submission_policy_version=0,
            ),
            inference_url=inference_url,
        )
        async with slots:
            in_flight += 1
            peak = max(peak, in_flight)
            start = time.perf_counter()
            try:
                response = await pool.client().post(
                    f"{url}/v1/grouped_rollouts",
                    content=call.model_dump_json(),
                    headers={"content-type": "application/json"},
                )
                if response.status_code != 200:
                    errors.append(f"HTTP {response.status_code}: {response.text[:200]}")
                else:
                    group = RolloutGroup.model_validate_json(response.content)
                    if any(r.is_placeholder for r in group.rollouts):
                        errors.append(f"placeholder rollout: {group.rollouts[0].error}")
            except httpx.HTTPError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
            latencies.append(time.perf_counter() - start)
            in_flight -= 1

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(requests)))
    elapsed = time.perf_counter() - start
    await pool.aclose()
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    return {
        "requests": requests,
        "concurrency": concurrency,
        "peak_in_flight": peak,
        "group_size": group_size,
        "errors": len(errors),
        "first_errors": errors[:5],
        "seconds": elapsed,
        "requests_per_s": requests / elapsed,
        "rollouts_per_s": requests * group_size / elapsed,
        "latency_p50_ms": q[49] * 1000,
        "latency_p90_ms": q[89] * 1000,
        "latency_p99_ms": q[98] * 1000,
        "latency_max_ms": max(latencies) * 1000,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=4096, help="Grouped requests in total.")
    parser.add_argument("--concurrency", type=int, default=256, help="Requests kept in flight.")
    parser.add_argument("--group-size", type=int, default=8, help="Rollouts per group.")
    parser.add_argument("--url", help="An env server already running (default: start one).")
    parser.add_argument("--env-config", help="Env config of the env server the tool starts.")
    parser.add_argument("--inference-url", help="Inference server (default: start the stub).")
    parser.add_argument("--json", help="Also write the results to this file.")
    parser.add_argument(
        "--serve-stub-inference", type=int, metavar="PORT", help=argparse.SUPPRESS
    )  # internal: run the stub server
    args = parser.parse_args()
    if args.serve_stub_inference:
        serve_stub_inference(args.serve_stub_inference)
        return 0

    with contextlib.ExitStack() as stack:
        inference_url = args.inference_url
        if inference_url is None:
            port = free_port()
            inference_url = f"http://127.0.0.1:{port}"
            stack.enter_context(
                spawned(
                    [sys.executable, __file__, f"--serve-stub-inference={port}"],
                    f"{inference_url}/health",
                )
            )
        url = args.url
        if url is None:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = [
                sys.executable,
                "-m",
                "megatron.rl.server.env_server",
                f"--port={port}",
                "--log-level=warning",
            ]
            if args.env_config:
                cmd.append(f"--env-config={args.env_config}")
            stack.enter_context(spawned(cmd, f"{url}/health"))
        # warm-up: connections, imports
        warm = min(64, args.requests)
        asyncio.run(run_load(url, inference_url, warm, args.concurrency, args.group_size))
        result = asyncio.run(
            run_load(url, inference_url, args.requests, args.concurrency, args.group_size)
        )
    print(
        f"{result['requests']} grouped requests (group size {result['group_size']}), "
        f"concurrency {result['concurrency']} (peak in flight {result['peak_in_flight']}), "
        f"one client\n"
        f"errors: {result['errors']}\n"
        f"latency ms: p50 {result['latency_p50_ms']:.1f}  p90 {result['latency_p90_ms']:.1f}  "
        f"p99 {result['latency_p99_ms']:.1f}  max {result['latency_max_ms']:.1f}\n"
        f"throughput: {result['requests_per_s']:.1f} requests/s, "
        f"{result['rollouts_per_s']:.0f} rollouts/s over {result['seconds']:.1f} s"
    )
    for error in result["first_errors"]:
        print(f"  error: {error}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
