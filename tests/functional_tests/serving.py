"""Processes and checks of the serve and evaluate functional tests (``test_serve_and_evaluate.py``):
starting ``megatron.trainer.serve`` and waiting for its address, running a command, the one-message
check of a failure, greedy answers and logprobs against transformers, and evaluation numbers
against their dump records."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from golden_values import ROOT, subprocess_env
from grpo_testing.hf_models import hf_greedy_tokens

from megatron.rl.eval.confidence import wilson_interval
from megatron.rl.eval.passk import mean_pass_at_k

KEY = "job-key-of-the-serve-test"
SERVING = re.compile(
    r"^serving (\S+) at (http://127\.0\.0\.1:(\d+)/v1) \((key required|no key)(?:, from [^)]+)?\)$"
)


def command_env(**extra: str) -> dict[str, str]:
    """``subprocess_env()`` (no torch.distributed world: each command starts its own world of
    one) without a job key, plus ``extra``."""
    env = {k: v for k, v in subprocess_env().items() if k != "MEGATRON_RL_API_KEY"}
    return {**env, **extra}


@dataclass
class Served:
    """A running ``megatron.trainer.serve`` process and what it printed."""

    proc: subprocess.Popen
    name: str
    url: str
    keyed: bool
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=60)

    def cpu_seconds(self) -> float:
        """User + system CPU time of the process so far."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self, signum: int = signal.SIGTERM) -> int:
        """Send ``signum``; the exit status."""
        self.proc.send_signal(signum)
        return self.proc.wait(timeout=120)


def pump(stream, lines: list[str], ready: queue.Queue | None = None) -> None:
    """Collect a pipe's lines (and hand each to ``ready``) until it closes."""
    for line in stream:
        lines.append(line.rstrip("\n"))
        if ready is not None:
            ready.put(lines[-1])
    if ready is not None:
        ready.put(None)


def start_server(argv: list[str], env: dict[str, str], timeout: float = 300) -> Served:
    """Start the server on a free port; return once it printed where it listens."""
    cmd = [sys.executable, "-m", "megatron.trainer.serve", *argv, "--port", "0"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err, ready = [], [], queue.Queue()
    threading.Thread(target=pump, args=(proc.stdout, out, ready), daemon=True).start()
    threading.Thread(target=pump, args=(proc.stderr, err), daemon=True).start()
    deadline = time.monotonic() + timeout
    while True:
        line = ready.get(timeout=max(0.0, deadline - time.monotonic()))
        if line is None:
            proc.wait(timeout=30)
            raise AssertionError(f"the server exited with {proc.returncode}: {err[-20:]}")
        match = SERVING.match(line)
        if match:
            name, url, _, keyed = match.groups()
            return Served(proc, name, url, keyed == "key required", out, err)


@contextmanager
def running_server(argv: list[str], env: dict[str, str] | None = None) -> Iterator[Served]:
    """``start_server`` for a ``with`` block: the server is stopped (SIGTERM) at its end, killed
    if it does not stop."""
    served = start_server(argv, env or command_env())
    try:
        yield served
    finally:
        if served.proc.poll() is None:
            served.proc.terminate()
            try:
                served.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                served.proc.kill()
                served.proc.wait()


def run(module: str, argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m module argv`` from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", module, *argv],
        cwd=ROOT,
        env=command_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def error_lines(stderr: str) -> list[str]:
    """The lines of stderr that report an error (library warnings left out)."""
    return [line for line in stderr.splitlines() if "error:" in line and "Warning" not in line]


def assert_one_message(proc: subprocess.CompletedProcess, status: int, *needles: str) -> str:
    """One error message (its first line, and the indented lines of a list of problems) with
    ``status``, no traceback; the message."""
    assert proc.returncode == status, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    (first,) = error_lines(proc.stderr)
    lines = proc.stderr.splitlines()
    start = lines.index(first)
    rest = [line for line in lines[start + 1 :] if line.startswith("  ") and "warn" not in line]
    message = "\n".join([first, *rest])
    for needle in needles:
        assert needle in message, message
    return message


# ------------------------------------------------------------------ checks


def assert_greedy(directory: Path, choice, max_tokens: int) -> list[int]:
    """The choice's tokens are transformers' greedy continuation of its prompt (up to and with
    the stop token, else ``max_tokens`` of them); the tokens."""
    extra = choice.model_extra
    tokens, prompt = extra["token_ids"], extra["prompt_token_ids"]
    (expected,) = hf_greedy_tokens(directory, [prompt], steps=max_tokens)
    assert tokens == expected[: len(tokens)], (tokens, expected)
    assert len(tokens) == max_tokens or choice.finish_reason == "stop"
    return tokens


def hf_logprobs(directory: Path, prompt: list[int], tokens: list[int]) -> list[float]:
    """transformers' log-probabilities of ``tokens`` after ``prompt`` (temperature 1, over the
    tokenizer's ids, as the engine reports them for greedy requests)."""
    import torch
    import transformers

    from megatron.rl.models.hf.tokenizer import HuggingFaceTokenizer

    vocab = HuggingFaceTokenizer(directory).vocab_size
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        logits = model.eval()(input_ids=torch.tensor([prompt + tokens])).logits[0, :, :vocab]
    logp = torch.log_softmax(logits, dim=-1)  # (T, V)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_numbers_match_records(numbers: dict, records: list[dict]) -> None:
    """Every number of ``--output-json`` recomputed from the ``--val-dump-dir`` records."""
    threshold, n = numbers["correct_threshold"], numbers["samples_per_prompt"]
    assert {r["policy_version"] for r in records} == {numbers["policy_version"]}
    for env in numbers["environments"]:
        mine = [r for r in records if r["env_id"] == env["env_id"]]
        greedy = [r for r in mine if r["pass"] == "greedy"]
        sampled = [r for r in mine if r["pass"] == "sample"]
        assert len(greedy) == env["prompts"] and len(sampled) == n * env["prompts"]
        correct = sum(r["error"] is None and r["reward"] >= threshold for r in greedy)
        assert env["greedy_correct"] == correct
        assert env["greedy_accuracy"] == pytest.approx(correct / len(greedy))
        assert env["greedy_accuracy_ci95"] == pytest.approx(wilson_interval(correct, len(greedy)))
        mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
        assert env["greedy_reward"] == pytest.approx(mean(greedy, "reward"))
        assert env["sample_reward"] == pytest.approx(mean(sampled, "reward"))
        counts = [
            sum(
                r["error"] is None and r["reward"] >= threshold
                for r in sampled
                if r["problem"] == p
            )
            for p in range(env["prompts"])
        ]
        for k, value in env["pass_at_k"].items():
            assert value == pytest.approx(mean_pass_at_k(counts, n, int(k)))
        for name, rows in (("greedy", greedy), ("sample", sampled)):
            real = [r for r in rows if r["error"] is None]
            lengths = [r["response_tokens"] for r in real]
            assert env[f"{name}_response_length_mean"] == pytest.approx(sum(lengths) / len(real))
            assert env[f"{name}_response_length_max"] == max(lengths)
            assert env[f"{name}_truncated_fraction"] == pytest.approx(mean(real, "truncated"))
        assert env["failed"] == sum(r["error"] is not None for r in mine)
        several = len(numbers["environments"]) > 1
        metric = "eval/greedy_reward" + (f"/{env['env_id']}" if several else "")
        assert numbers["metrics"][metric] == pytest.approx(env["greedy_reward"])
