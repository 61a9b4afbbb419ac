"""``serve`` and ``evaluate`` with a LoRA adapter: a PEFT directory (``--lora-checkpoint``) or a LoRA
run's checkpoint (``--load`` with its ``--lora-rank`` flags) on the Hugging Face base generates
what the merged export generates, and evaluates as the trainer evaluated it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from golden_values import ROOT
from serving import (
    assert_greedy,
    assert_one_message,
    command_env,
    hf_logprobs,
    read_records,
    run,
    start_server,
)
from test_serve_and_evaluate import EVAL_FLAGS, MODEL_FLAGS, env_config  # noqa: F401 (fixture)

LORA_FLAGS = ["--lora-rank", "4", "--lora-alpha", "8"]


@pytest.fixture(scope="module")
def tiny(tiny_hf_checkpoints) -> Path:
    return tiny_hf_checkpoints["llama3"]


@pytest.fixture(scope="module")
def trained(tiny, env_config, tmp_path_factory) -> dict[str, Path]:
    """Two LoRA updates from the tiny checkpoint: its checkpoint, PEFT directory, merged export
    and the trainer's evaluation after them."""
    out = tmp_path_factory.mktemp("trained_lora")
    paths = {"ck": out / "CK", "hf": out / "merged", "lora": out / "adapter", "dump": out / "dump"}
    argv = [
        "--hf-checkpoint", str(tiny), "--env-config", str(env_config), *MODEL_FLAGS, *EVAL_FLAGS,
        *LORA_FLAGS, "--grpo-prompts-per-step", "2", "--grpo-group-size", "2",
        "--micro-batch-size", "4", "--train-iters", "2", "--lr", "0.2", "--lr-warmup-iters", "0",
        "--grpo-entropy-term-weight", "0.5", "--val-at-end", "--val-dump-dir", str(paths["dump"]),
        "--save", str(paths["ck"]), "--save-hf", str(paths["hf"]), "--save-lora", str(paths["lora"]),
        "--plot-file", "none",
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "pretrain_grpo.py", *argv], cwd=ROOT, env=command_env(),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return paths


@pytest.mark.parametrize("source", ["lora-checkpoint", "load"])
def test_served_adapter_generates_what_the_merged_model_generates(trained, tiny, source):
    flags = {
        "lora-checkpoint": ["--lora-checkpoint", str(trained["lora"])],
        "load": ["--load", str(trained["ck"]), *LORA_FLAGS],
    }[source]
    served = start_server(["--hf-checkpoint", str(tiny), "--seq-length", "64", *flags], command_env())
    try:
        choice = served.client(key="x").completions.create(
            model=served.name, prompt="copy: 1234 -> ", max_tokens=10, temperature=0, logprobs=1
        ).choices[0]
        tokens = assert_greedy(trained["hf"], choice, 10)
        prompt, logprobs = choice.model_extra["prompt_token_ids"], choice.logprobs.token_logprobs
        assert logprobs == pytest.approx(hf_logprobs(trained["hf"], prompt, tokens), abs=1e-4)
        base = hf_logprobs(tiny, prompt, tokens)
        assert max(abs(a - b) for a, b in zip(logprobs, base)) > 1e-3  # not the base
        assert served.stop(signal.SIGTERM) == 0
    finally:
        if served.proc.poll() is None:
            served.proc.kill()


def test_evaluation_of_the_lora_checkpoint_equals_the_trainers(trained, tiny, env_config, tmp_path):
    output = tmp_path / "eval.json"
    argv = [
        "--hf-checkpoint", str(tiny), "--env-config", str(env_config), *MODEL_FLAGS, *EVAL_FLAGS,
        *LORA_FLAGS, "--load", str(trained["ck"]), "--val-dump-dir", str(tmp_path / "dump"),
        "--output-json", str(output),
    ]  # fmt: skip
    proc = run("megatron.trainer.evaluate", argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(output.read_text())["policy_version"] == 2
    assert read_records(tmp_path / "dump" / "eval-v2.jsonl") == read_records(
        trained["dump"] / "eval-v2.jsonl"
    )


def test_a_lora_checkpoint_without_its_lora_flags_is_refused_naming_them(trained, tiny, env_config):
    argv = ["--hf-checkpoint", str(tiny), "--env-config", str(env_config), *MODEL_FLAGS, *EVAL_FLAGS,
            "--load", str(trained["ck"])]  # fmt: skip
    proc = run("megatron.trainer.evaluate", argv)
    assert_one_message(proc, 1, "--lora-rank", "(here: 0)")
